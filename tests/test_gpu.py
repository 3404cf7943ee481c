"""The GPU path (CUDA only; skipped without a GPU): bf16 training learns, Liger's kernels and regional compile with
activation checkpointing give the losses of the plain path, and `bench` measures a compiled checkpointed sweep.
On a machine without PyPI access the missing wheels travel in .whl/ (benchmarks/gpu_check.sh installs them)."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import losses, run_cli, sft_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU = ["train.mixed_precision=bf16", "train.micro_batch_size=8", "train.max_steps=6", "train.log_interval=1"]


def run(model_dir, data, out, *extra) -> list[float]:
    sft_cli(model_dir, data, out, *GPU, *extra)
    return losses(out)


def test_bf16_training_learns_on_cuda(llama_dir, chat_file, tmp_path):
    got = run(llama_dir, chat_file, tmp_path / "a", "train.max_steps=30", "train.lr=1e-2")
    assert len(got) == 30 and all(x == x for x in got)
    assert sum(got[-5:]) / 5 < 0.8 * sum(got[:5]) / 5, got


@pytest.mark.parametrize("extra", [["model.liger=true"], ["model.compile=true", "ac.ratio=1"]],
                         ids=["liger", "compile_ac"])
def test_kernels_and_compile_match_the_plain_path(llama_dir, chat_file, tmp_path, extra):
    pytest.importorskip("liger_kernel") if "model.liger=true" in extra else None
    plain, other = run(llama_dir, chat_file, tmp_path / "plain"), run(llama_dir, chat_file, tmp_path / "x", *extra)
    # bf16 compute: fused kernels and compiled blocks round differently, step by step
    assert other == pytest.approx(plain, rel=2e-2), (plain, other)


def test_bench_sweeps_a_compiled_checkpointed_model(llama_dir, chat_file, tmp_path):
    run_cli("bench", "--model", llama_dir, "--dataset", chat_file, "--sac-ratios", "0,1", "--steps", "2",
            "--warmup", "1", "-o", tmp_path, "model.compile=true", "train.mixed_precision=bf16")
    rows = json.loads((tmp_path / "bench.json").read_text())["points"]
    assert [r["ac_ratio"] for r in rows] == [0, 1] and all("error" not in r for r in rows), rows
    assert rows[1]["saved_mb"] < rows[0]["saved_mb"] and rows[1]["saved_eager"], rows
