"""Regression tests for what probing the multi-node features found (plan, [parallel], apply_fsdp)."""
from __future__ import annotations

import json

import pytest

from finetune.config import ConfigError
from finetune.plan import GIB, parse_gpu_memory
from helpers import invoke


def test_gpu_memory_takes_the_usual_spellings_and_refuses_a_size_of_no_bytes():
    assert [parse_gpu_memory(t) for t in ("80GB", "80G", "80gib", "80", "81920MB", "81920M")] == [80 * GIB] * 6
    assert parse_gpu_memory("1TB") == parse_gpu_memory("1T") == 1024 * GIB
    for text in ("0GB", "0.0000000001GB", "1e3", "80PB", "-1"):  # the second rounded to 0 bytes: division by zero
        with pytest.raises(ConfigError, match="--gpu-memory must be a size like 80GB"):
            parse_gpu_memory(text)
    result = invoke("plan", "--gpu-memory", "0.0000000001GB")
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "error: --gpu-memory must be a size like 80GB or 24576MB, got '0.0000000001GB'"]


def test_a_gpu_attention_implementation_is_planned_on_the_cpu(llama_dir):
    """A GPU preset's flash_attention_2 was refused ("needs a CUDA device") and flex_attention crashed the process
    (fake tensors): both save O(seq) state for backward, which CPU sdpa stands in for."""
    def plan(attn):
        result = invoke("plan", "--model", llama_dir, "--nproc-per-node", 2, "--sac-ratios", 0, "--micro-batch-sizes",
                        1, "--json", "data.max_seq_len=32", f"model.attn_implementation={attn}")
        assert result.exit_code == 0, (attn, result.output, result.exception)
        return json.loads(result.stdout)["points"]
    sdpa = plan("sdpa")
    assert plan("flash_attention_2") == sdpa and plan("flex_attention") == sdpa
    assert plan("eager")[0]["activations"] > sdpa[0]["activations"]  # seq x seq probabilities are saved
