"""The GPU path (CUDA only; skipped without a GPU): packed rows through torch's varlen kernel (and flex, and flash-attn
where installed) train as the same samples unpacked; the auto defaults (varlen, Liger's fused loss, regional compile)
learn and give the losses of the plain path; `bench` measures a compiled checkpointed sweep.
On a machine without PyPI access the missing wheels travel in .whl/ (benchmarks/gpu_check.sh installs them)."""
from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp

import pytest
import torch

from helpers import losses, run_cli, sft_cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU = ["train.mixed_precision=bf16", "train.micro_batch_size=8", "train.max_steps=6", "train.log_interval=1"]
PLAIN = ["model.attn_implementation=sdpa", "model.liger=false", "model.compile=false"]  # the defaults before auto


def run(model_dir, data, out, *extra):
    proc = sft_cli(model_dir, data, out, *GPU, *extra, fresh=True)  # CUDA starts in a fresh interpreter
    return losses(out), proc.stdout


def _in_fresh_process(queue, fn, args):
    import traceback
    try:
        queue.put(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - the test shows it
        queue.put(("error", traceback.format_exc()))


def fresh_process(fn, *args):
    """fn(*args) in a spawned process (its own NCCL group of one: the fork server's ranks are gloo, CPU only)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_in_fresh_process, args=(queue, fn, args))
    proc.start()
    status, result = queue.get(timeout=900)
    proc.join()
    assert status == "ok", result
    return result


def test_varlen_and_flex_train_packed_rows_as_the_samples_unpacked(llama_dir, chat_file):
    from test_attention import packed_and_unpacked
    attentions = ["varlen", "sdpa", "flex_attention"] + ["flash_attention_2"] * bool(importlib.util.find_spec(
        "flash_attn"))
    results = fresh_process(packed_and_unpacked, str(llama_dir), str(chat_file), attentions, False, "bf16")
    for key, ((loss, norm), (ref_loss, ref_norm)) in results.items():  # bf16: other shapes round differently
        assert loss == pytest.approx(ref_loss, rel=1e-2) and norm == pytest.approx(ref_norm, rel=5e-2), key


def test_the_auto_defaults_learn_on_cuda(llama_dir, chat_file, tmp_path):
    got, stdout = run(llama_dir, chat_file, tmp_path / "a", "train.max_steps=30", "train.lr=1e-2")
    assert "kernels: attention varlen, Liger fused loss only (compiled blocks), regional compile on (auto on cuda)" in \
        stdout, stdout
    assert len(got) == 30 and all(x == x for x in got)
    assert sum(got[-5:]) / 5 < 0.8 * sum(got[:5]) / 5, got


@pytest.fixture(scope="module")
def plain(llama_dir, chat_file, tmp_path_factory):
    return run(llama_dir, chat_file, tmp_path_factory.mktemp("plain"), *PLAIN)[0]


@pytest.mark.parametrize("extra", [["model.liger=true"], ["model.compile=true", "ac.ratio=1"],
                                   ["model.attn_implementation=varlen"],
                                   ["model.attn_implementation=varlen", "model.liger=true", "model.compile=true",
                                    "ac.ratio=0.5"]],
                         ids=["liger", "compile_ac", "varlen", "varlen_liger_compile_ac"])
def test_kernels_and_compile_match_the_plain_path(llama_dir, chat_file, tmp_path, plain, extra):
    pytest.importorskip("liger_kernel") if "model.liger=true" in extra else None
    other = run(llama_dir, chat_file, tmp_path / "x", *PLAIN, *extra)[0]
    # bf16 compute: fused kernels and compiled blocks round differently, step by step
    assert other == pytest.approx(plain, rel=2e-2), (plain, other)


def test_bench_sweeps_a_compiled_checkpointed_model(llama_dir, chat_file, tmp_path):
    run_cli("bench", "--model", llama_dir, "--dataset", chat_file, "--sac-ratios", "0,1", "--steps", "2",
            "--warmup", "1", "-o", tmp_path, "model.compile=true", "train.mixed_precision=bf16", fresh=True)
    rows = json.loads((tmp_path / "bench.json").read_text())["points"]
    assert [r["ac_ratio"] for r in rows] == [0, 1] and all("error" not in r for r in rows), rows
    assert rows[1]["saved_mb"] < rows[0]["saved_mb"] and rows[1]["saved_eager"], rows


def test_ac_offload_on_streams_gives_the_gradients_without_it(llama_dir):
    """The copy stream's D2H/H2D (finetune.memory.offload) hand every checkpointed block its own inputs back, one block
    ahead of the backward, and keep them off the GPU."""
    from test_context import offload_saved
    plain, grads, _ = fresh_process(offload_saved, str(llama_dir), False)
    offloaded, grads_off, taken = fresh_process(offload_saved, str(llama_dir), True)
    assert grads_off == pytest.approx(grads, rel=1e-5) and offloaded < plain
    assert [f for _, f in taken].count(False) == len(taken) // 4  # only the last block's were not on their way
