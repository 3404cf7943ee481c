"""SFT (in-process ranks): FSDP on 2 gloo ranks equals 1 process; any micro-batch/accumulation split gives the
same losses; tied embeddings of another architecture train; AdamW groups and the schedule; config errors."""
from __future__ import annotations

import pytest
import torch

from helpers import read_metrics, run_cli, sft

TWO_RANKS = ("train.max_steps=8", "train.micro_batch_size=2")  # the 2-rank reference run (also test_checkpoint's)
ONE_RANK = ("train.max_steps=8", "train.micro_batch_size=4")  # the same global batch on 1 rank


def test_two_ranks_equal_one_process(llama_dir, chat_file, reference):
    one, two = read_metrics(reference(llama_dir, chat_file, *ONE_RANK)), \
        read_metrics(reference(llama_dir, chat_file, *TWO_RANKS, nproc=2))
    assert len(one) == len(two) == 8
    assert one[-1]["loss"] < one[0]["loss"]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    # the same global batch: same label-token counts at every step
    assert [r["num_tokens"] for r in one] == [r["num_tokens"] for r in two]


def test_micro_batch_and_accumulation_splits_agree(llama_dir, chat_file, tmp_path, reference):
    ref = read_metrics(reference(llama_dir, chat_file, *ONE_RANK))[:4]  # constant lr: the first 4 of 8 steps
    for mbs, accum in [(2, 2), (1, 4)]:
        recs = sft(llama_dir, chat_file, tmp_path / f"m{mbs}a{accum}", "train.max_steps=4",
                   f"train.micro_batch_size={mbs}", f"train.grad_accum_steps={accum}")
        assert [r["num_tokens"] for r in recs] == [r["num_tokens"] for r in ref], (mbs, accum)
        assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref], rel=1e-5), (mbs, accum)
        assert [r["grad_norm"] for r in recs] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4), (mbs, accum)


def test_tied_embedding_model_of_another_architecture_trains_on_two_ranks(qwen_tied_dir, chat_file, tmp_path):
    ls = [r["loss"] for r in sft(qwen_tied_dir, chat_file, tmp_path / "qwen", "train.max_steps=8",
                                 "train.micro_batch_size=4", nproc=2)]
    assert len(ls) == 8 and all(x == x for x in ls)
    assert sum(ls[-2:]) < sum(ls[:2])


def test_adamw_groups_exclude_embeddings_norms_biases():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from finetune.optim import param_groups
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    name = {id(p): n for n, p in model.named_parameters()}
    decayed = {name[id(p)] for p in decay["params"]}
    kept = {name[id(p)] for p in no_decay["params"]}
    assert "model.embed_tokens.weight" in kept  # also the tied lm_head
    assert all(n.endswith("bias") or "norm" in n or "embed" in n for n in kept), kept
    assert all(n.endswith(".weight") and "norm" not in n and "embed" not in n for n in decayed), decayed
    assert "model.layers.0.self_attn.q_proj.bias" in kept  # Qwen2 has q/k/v biases
    assert len(decayed) + len(kept) == len(list(model.parameters()))


def test_lr_schedule_warmup_then_cosine():
    from finetune.optim import lr_at
    kw = dict(warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    values = [lr_at(s, **kw) for s in range(20)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))
    assert values[-1] == pytest.approx(0.1)


CONFIG_ERRORS = [
    (["train.lrr=1"], "unknown config key 'train.lrr' (did you mean 'lr'?)"),
    (["train.mixed_precision=bf61"], "train.mixed_precision must be one of 'bf16', 'fp32', got 'bf61' (did you mean 'bf16'?)"),
    (["data.max_seq_len=-1"], "data.max_seq_len must be > 0, got -1"),
    (["ac.ratio=2"], "ac.ratio must be in [0, 1], got 2.0"),
    (["--model", "/nonexistent/model"], "model path '/nonexistent/model' does not exist"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
    (["--dataset", "/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
]


@pytest.mark.parametrize("args, expect", CONFIG_ERRORS)
def test_config_errors_are_one_clean_line(args, expect, tmp_path, llama_dir):
    """In-process through the typer app (what `finetune sft` runs); the next test runs one case as a real process."""
    from typer.testing import CliRunner
    from finetune.cli import app
    model = [] if "--model" in args else ["--model", str(llama_dir)]
    result = CliRunner().invoke(app, ["sft", "--output-dir", str(tmp_path / "out"), *model, *args])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_a_config_error_from_the_real_command_is_one_line_and_exit_2(tmp_path, llama_dir):
    args, expect = CONFIG_ERRORS[0]
    proc = run_cli("sft", "--output-dir", tmp_path, "--model", llama_dir, *args, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expect}"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_shift_labels_masks_packed_boundaries():
    from finetune.train import shift_labels
    labels = torch.tensor([[-100, 5, 6, -100, 8, 9]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert shift_labels(labels, pos).tolist() == [[5, 6, -100, 8, 9, -100]]
    labels = torch.tensor([[1, 5, 6, 7, 8, 9]])
    assert shift_labels(labels, pos).tolist() == [[5, 6, -100, 8, 9, -100]]


def test_attention_implementation_is_resolved_per_model_class(monkeypatch):
    from transformers import Gemma2Config, LlamaConfig
    from finetune.model import ModelError, resolve_attn_implementation
    assert resolve_attn_implementation(LlamaConfig(), "sdpa") == "sdpa"
    assert resolve_attn_implementation(LlamaConfig(), "eager") == "eager"
    assert resolve_attn_implementation(Gemma2Config(), "sdpa") == "eager"  # Gemma2 has no sdpa path
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match="flash_attention_2 needs a CUDA device and the flash_attn package"):
        resolve_attn_implementation(LlamaConfig(), "flash_attention_2")
