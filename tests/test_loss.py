"""The loss only at label positions equals the loss over full logits, and so do its gradients: untied and tied
embeddings, LoRA with lm_head trained in full, logits soft-capped after lm_head (Gemma2), packed rows."""
from __future__ import annotations

import pytest
import torch

from conftest import make_model_dir


def full_logits_loss(model, batch):
    """Today's reference: the causal LM's own loss over every position (summed), the targets shifted as ours."""
    from finetune.loss import LOSS_KEYS
    shifted = torch.full_like(batch["input_ids"], -100).flatten()
    shifted[batch["label_index"]] = batch["label_targets"]
    inputs = {k: v for k, v in batch.items() if k not in LOSS_KEYS}
    out = model(**inputs, labels=shifted.view_as(batch["input_ids"]), shift_labels=shifted.view_as(batch["input_ids"]),
                num_items_in_batch=torch.ones(()), use_cache=False)
    return out.loss, out.logits.numel()


def check_equal(model, batch):
    from finetune.loss import token_loss_sum
    trained = [p for p in model.parameters() if p.requires_grad]
    ref, ref_logits = full_logits_loss(model, batch)
    ref_grads = torch.autograd.grad(ref, trained)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.numel()))
    got = token_loss_sum(model, batch)
    hook.remove()
    grads = torch.autograd.grad(got, trained)
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    for g, r in zip(grads, ref_grads):  # fp32 sums in another order: 1e-6 of the gradient's norm
        assert (g - r).norm() <= 1e-6 * r.norm(), ((g - r).norm() / r.norm()).item()
    # lm_head saw the label tokens only (far fewer than the full logits)
    assert seen[-1] == batch["label_targets"].numel() * model.config.vocab_size < ref_logits


def packed_batch(model_dir, data, rows: int = 3, max_seq_len: int = 256):
    from finetune.data import build_samples
    from finetune.model import load_tokenizer
    from finetune.train import next_micro_batches
    tok = load_tokenizer(str(model_dir))
    samples = iter(build_samples(str(data), tok, max_seq_len=max_seq_len, packing=True, shuffle=False))
    batch = next_micro_batches(samples, rows, 1, tok.pad_token_id, None)[0][0]
    assert (batch["position_ids"] == 0).sum() > rows  # packed: several samples a row
    return batch


def load(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()


@pytest.mark.parametrize("model_name", ["llama_dir", "qwen_tied_dir"])
def test_label_positions_loss_equals_full_logits_loss(model_name, chat_file, request):
    model_dir = request.getfixturevalue(model_name)
    model = load(model_dir)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == (model_name == "qwen_tied_dir")
    check_equal(model, packed_batch(model_dir, chat_file))


def test_label_positions_loss_with_lora_and_a_trained_lm_head(llama_dir, chat_file):
    from finetune.adapters.lora import apply_lora
    from finetune.model import find_layers
    model = load(llama_dir)
    apply_lora(model, find_layers(model), rank=4, alpha=8, dropout=0.0, target_modules="all-linear",
               modules_to_save=["lm_head"], base_dtype=torch.float32)
    with torch.no_grad():  # nonzero B, so every adapter gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    assert any("modules_to_save" in n for n, p in model.named_parameters() if p.requires_grad)
    check_equal(model, packed_batch(llama_dir, chat_file))


def test_label_positions_loss_keeps_logit_soft_capping(tmp_path, chat_file):
    gemma = make_model_dir(tmp_path / "gemma2", "llama3", "gemma2", tied=True, num_layers=2)
    model = load(gemma)
    assert model.config.final_logit_softcapping  # applied to the logits after lm_head
    check_equal(model, packed_batch(gemma, chat_file, rows=2, max_seq_len=128))


def test_label_targets_stop_at_packed_boundaries_and_keep_one_position():
    from finetune.loss import label_targets
    labels = torch.tensor([[-100, 5, 6, 7, 8, 9]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    got = label_targets(labels, pos)  # position 2 would predict 7, the first token of the next sample: no target
    assert got["label_index"].tolist() == [0, 1, 3, 4] and got["label_targets"].tolist() == [5, 6, 8, 9]
    none = label_targets(torch.full((2, 3), -100), None)
    assert none["label_index"].tolist() == [0] and none["label_targets"].tolist() == [-100]


def test_fused_loss_accumulates_its_gradients_in_fp32(llama_dir, monkeypatch):
    """Liger's fused linear cross-entropy gets accum_dtype=torch.float32 (its lm_head gradient summed over the vocab
    chunks in fp32, not bf16), and its loss is still the token loss sum. The kernel is a stand-in with Liger's
    signature (the Triton kernel itself: gpu_check.sh `flce`, which measures the gradient error with and without)."""
    import functools

    import liger_kernel.transformers.functional as liger_f

    from finetune.loss import label_targets, token_loss_sum
    from finetune.kernels.liger import apply_kernels
    real, seen = liger_f.liger_fused_linear_cross_entropy, []

    @functools.wraps(real)  # the same signature: Liger passes on only the arguments its function takes
    def fused(input, weight, target, *args, reduction="mean", ignore_index=-100, accum_dtype=None, **kwargs):
        seen.append(accum_dtype)
        return torch.nn.functional.cross_entropy((input @ weight.T).float(), target, ignore_index=ignore_index,
                                                 reduction=reduction)

    monkeypatch.setattr(liger_f, "liger_fused_linear_cross_entropy", fused)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, plain = load(llama_dir), load(llama_dir)
    apply_kernels(model, compile=True)  # the fused loss only, as with regional compile
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, **label_targets(ids, None)}
    got = token_loss_sum(model, batch)
    assert seen == [torch.float32]
    assert got.item() == pytest.approx(token_loss_sum(plain, batch).item(), rel=1e-5)
