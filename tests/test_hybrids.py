"""Hybrid and linear-attention families beyond what test_families.py checks for each (packed == unpacked, 2 ranks ==
1 process at lr 0): a few steps at lr > 0 with every block recomputed, and sparse attention's refusal of the
attention kernels that build no mask."""
from __future__ import annotations

import pytest
import transformers as T

from families import DSA, FAMILIES, family_kwargs, make_family_dir
from helpers import BASE, invoke, sft, write_jsonl


def chat_rows(n: int) -> list[dict]:
    """`n` short conversations of different lengths (each a few dozen tokens)."""
    words = "alpha beta gamma delta echo fox golf hotel".split()
    return [{"messages": [{"role": "user", "content": " ".join(words[: 1 + i % 7])},
                          {"role": "assistant", "content": " ".join(words[i % 3: 2 + i % 8])}]} for i in range(n)]


def test_a_hybrid_trains_packed_on_two_ranks_as_one_process(tmp_path):
    """Qwen3-Next (gated delta rule, full attention, MoE), packed rows of 128 tokens, lr 1e-2: 2 gloo ranks of one row
    each (every block recomputed in backward: the per-sample path again) give the losses of one process with both
    rows in its micro-batch."""
    model_dir = make_family_dir(tmp_path / "model", FAMILIES["qwen3_next"][0], family_kwargs("qwen3_next"))
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    common = ("train.lr=1e-2", "train.max_steps=3", "data.max_seq_len=128")
    one = sft(model_dir, data, tmp_path / "one", *common, "train.micro_batch_size=2")
    two = sft(model_dir, data, tmp_path / "two", *common, "train.micro_batch_size=1", "ac.ratio=1", nproc=2)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["num_tokens"] for r in two] == [r["num_tokens"] for r in one]


def test_sparse_attention_other_than_eager_is_one_line_and_exit_2(tmp_path):
    """DeepSeek sparse attention (V3.2's indexer, V4's compressed KV) reads a materialized causal mask: varlen and flash
    give none, sdpa none for a row without padding or packing (V3.2 crashed: 'NoneType' object is not subscriptable;
    V4 let every query see every compressed block); auto picks eager."""
    from _tokenizers import build_tokenizer
    model_dir = tmp_path / "dsa"  # config and tokenizer only: the run stops before any weight is read
    T.DeepseekV32Config(**DSA, hidden_size=32, num_hidden_layers=2, num_attention_heads=2).save_pretrained(model_dir)
    build_tokenizer("chatml").save_pretrained(model_dir)
    # its module imported here, not in the run: torchao, which it imports, warns on stderr once per process
    from transformers import DeepseekV32ForCausalLM  # noqa: F401
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(2))
    result = invoke("sft", "--model", model_dir, "--dataset", data, "--output-dir", tmp_path / "run", *BASE,
                    "model.attn_implementation=sdpa")
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "error: model.attn_implementation=sdpa: DeepseekV32ForCausalLM's sparse attention needs the causal mask only "
        "eager always builds; use eager (or auto)"], result.output
