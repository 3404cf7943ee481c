"""Activation checkpointing: which blocks are wrapped (ac.ratio spread over depth), that losses and gradients are
unchanged for any ratio and mode, that recompute really happens, and the same through FSDP and train()."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from finetune.memory.sac import op_level
from finetune.model import ac_layer_ids, apply_ac, clean_child, find_layers
from finetune.weights import clean_fqn
from helpers import read_metrics, sft

CASES = [(0.25, "block"), (0.5, "block"), (1.0, "block"), (0.5, "op"), (1.0, "op")]


def is_checkpointed(layer) -> bool:
    return hasattr(layer, "_checkpoint_wrapped_module")


@pytest.fixture(scope="module")
def model8():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).float().train()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 128, (3, 40), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 30:] = 0  # a padded row: the mask must reach the recompute too
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {clean_fqn(n): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("num_layers, ratio, expected", [
    (8, 0.5, [1, 3, 5, 7]), (8, 0.25, [3, 7]), (8, 0.0, []), (8, 1.0, list(range(8))), (8, 0.75, [1, 2, 3, 5, 6, 7]),
    (4, 0.5, [1, 3]), (32, 0.125, [7, 15, 23, 31]), (5, 0.4, [2, 4]),
])
def test_ratio_picks_blocks_spread_evenly(num_layers, ratio, expected):
    ids = ac_layer_ids(num_layers, ratio)
    assert ids == expected
    assert len(ids) == round(ratio * num_layers)


@pytest.mark.parametrize("ratio, count", [(0.5, 4), (0.25, 2), (0.0, 0), (1.0, 8)])
def test_apply_ac_wraps_that_many_blocks_and_keeps_parameter_names(model8, ratio, count):
    model = copy.deepcopy(model8)
    ids = apply_ac(model, ratio)
    layers = find_layers(model)
    wrapped = [i for i, layer in enumerate(layers) if is_checkpointed(layer)]
    assert wrapped == ids and len(ids) == count
    if count > 1:  # spread evenly: equal gaps, the last block included (not the first k)
        assert len({b - a for a, b in zip(ids, ids[1:])}) == 1 and ids[-1] == 7
    assert [clean_fqn(n) for n, _ in model.named_parameters()] == [n for n, _ in model8.named_parameters()]
    assert all(type(clean_child(layer)) is type(model8.model.layers[0]) for layer in layers)


@pytest.mark.parametrize("ratio, mode", CASES)
def test_losses_and_gradients_equal_no_checkpointing(model8, batch, ratio, mode):
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model8), batch)
    model = copy.deepcopy(model8)
    apply_ac(model, ratio, [op_level()] if mode == "op" else [])
    loss, grads = loss_and_grads(model, batch)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("ratio, mode", [(0.0, "block"), *CASES])
def test_checkpointed_blocks_run_again_in_backward(model8, batch, ratio, mode):
    model = copy.deepcopy(model8)
    ids = apply_ac(model, ratio, [op_level()] if mode == "op" else [])
    calls = [0] * 8
    for i, layer in enumerate(find_layers(model)):
        # a pre-hook: non-reentrant recompute stops early, once the saved tensors are back, so no post-hook
        clean_child(layer).register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    loss = model(**batch, use_cache=False).loss
    assert calls == [1] * 8
    loss.backward()
    assert calls == [2 if i in ids else 1 for i in range(8)]


def test_block_mode_recomputes_matmuls_and_op_mode_keeps_them(model8, batch):
    """Backward FLOPs: whole-block AC adds one forward of each wrapped block; op-level AC caches the matmul and
    attention outputs, so it adds none (it recomputes only pointwise ops)."""
    def flops(ratio, mode):
        model = copy.deepcopy(model8)
        apply_ac(model, ratio, [op_level()] if mode == "op" else [])
        with FlopCounterMode(display=False) as fwd:
            loss = model(**batch, use_cache=False).loss
        with FlopCounterMode(display=False) as bwd:
            loss.backward()
        return fwd.get_total_flops(), bwd.get_total_flops()

    fwd0, bwd0 = flops(0.0, "block")
    _, bwd_half = flops(0.5, "block")
    _, bwd_all = flops(1.0, "block")
    block_fwd = bwd_all - bwd0  # one forward of all 8 blocks
    assert 0 < block_fwd < fwd0
    assert bwd_half - bwd0 == block_fwd // 2
    assert flops(1.0, "op")[1] == bwd0


RUN = ("train.max_steps=3", "data.max_seq_len=96")  # global batch 4 samples


@pytest.fixture(scope="module")
def llama8_dir(tmp_path_factory):
    from conftest import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("llama8"), "llama3", "llama", tied=False, num_layers=8)


@pytest.mark.parametrize("ratio, mode, nproc", [(0.5, "block", 2), (0.75, "op", 1)])
def test_sft_with_ac_matches_sft_without(llama8_dir, chat_file, tmp_path, reference, ratio, mode, nproc):
    """The real path (FSDP2 + train(), in-process ranks): the same losses and grad norms with and without
    checkpointing."""
    ref = read_metrics(reference(llama8_dir, chat_file, *RUN, "train.micro_batch_size=4"))
    got = sft(llama8_dir, chat_file, tmp_path / "ac", *RUN, f"train.micro_batch_size={4 // nproc}",
              f"ac.ratio={ratio}", f"ac.mode={mode}", nproc=nproc)
    assert [r["num_tokens"] for r in got] == [r["num_tokens"] for r in ref]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in ref], rel=1e-5), key


def test_op_mode_keeps_the_varlen_and_flex_attention_ops():
    """Op-level AC keeps torch's varlen kernel's output (CUDA: torch_attn::_varlen_attn) and flex attention's, as
    sdpa's: attention is not recomputed in backward (the gpu_check.sh `opac` stage counts it on CUDA)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from finetune.memory.sac import op_sac_policy
    import torch.nn.attention.varlen  # noqa: F401 - registers torch_attn::_varlen_attn
    policy = op_sac_policy().args[0]
    for op in (torch.ops.torch_attn._varlen_attn.default, torch.ops.higher_order.flex_attention,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    assert policy(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


def test_op_mode_passes_the_block_nothing_of_checkpoints_own(model8, batch):
    """checkpoint()'s own arguments stay with checkpoint(): on torch 2.11, where respect_saved_tensors_hooks is not
    one of them, it must not reach the decoder block's forward as a keyword argument (ext.sac.sac_hooks_kwargs)."""
    model = copy.deepcopy(model8)
    seen = []
    for layer in find_layers(model):
        layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    apply_ac(model, 1.0, [op_level()])
    model(**batch, use_cache=False).loss.backward()
    assert seen and not any("respect_saved_tensors_hooks" in k for k in seen), seen
