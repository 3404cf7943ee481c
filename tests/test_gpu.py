"""The GPU path (CUDA only; skipped without a GPU): packed rows through torch's varlen kernel (and flex, and flash-attn
where installed) train as the same samples unpacked; the auto defaults (varlen, Liger's fused loss, regional compile)
learn and give the losses of the plain path; `bench` measures a compiled checkpointed sweep; parallel.cpu_offload
(LoRA, QLoRA) trains as on the device with its shards in pinned host memory.
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


def offload_steps(model_dir: str, data: str, overrides: list[str], steps: int = 4) -> dict:
    """One rank (CUDA where there is one), the LoRA model `overrides` configure: the losses of `steps` train_steps on
    one fixed batch; the device's peak bytes over them and the bytes still allocated after them (over what was
    allocated before the build: an earlier call's leftovers do not count); FSDP's parameters,
    those whose shards (every inner tensor of a subclass) are in host memory, pinned, and their bytes; the AdamW
    states in host memory, of all; the NF4 weights and those on the device."""
    import gc

    from finetune.adapters.qlora import is_nf4
    from finetune.build import transforms
    from finetune.compat import fsdp_param_group, local_tensor
    from finetune.distributed import init_distributed
    from finetune.loss import label_targets
    from finetune.train import build_model_and_optimizer, train_step
    from helpers import sft_config
    cfg = sft_config(model_dir, data, "unused", *overrides)
    device, dims = init_distributed()
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else 0
    torch.manual_seed(0)
    model, optimizer, _ = build_model_and_optimizer(cfg, device, dims, transforms(cfg, dims, device))
    ids = torch.randint(model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {k: v.to(device) for k, v in {"input_ids": ids, **label_targets(ids, None)}.items()}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    got = [float(train_step(model, optimizer, [batch], num_input_tokens=ids.numel(), max_grad_norm=1.0)[0]["loss"])
           for _ in range(steps)]

    def inner(t):  # a subclass's (NF4's) tensors, else the tensor
        return [getattr(t, n) for n in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else [t]
    fsdp = [fp for m in model.modules() if (group := fsdp_param_group(m)) for fp in group.fsdp_params]
    host = [inner(local_tensor(fp.sharded_param)) for fp in fsdp]
    host = [ts for ts in host if all(t.device.type == "cpu" for t in ts)]
    states = [s for st in optimizer.state.values() for s in st.values() if torch.is_tensor(s) and s.dim()]
    nf4 = [p for p in model.parameters() if is_nf4(p)]
    result = {"losses": got, "peak": torch.cuda.max_memory_allocated(device) - base if cuda else None,
              "allocated": torch.cuda.memory_allocated(device) - base if cuda else None, "fsdp": len(fsdp),
              "on_host": len(host), "pinned": sum(all(t.is_pinned() for t in ts) for ts in host),
              "host_bytes": sum(t.nbytes for ts in host for t in ts), "states": len(states),
              "states_on_host": sum(s.device.type == "cpu" for s in states), "nf4": len(nf4),
              "nf4_on_device": sum(all(t.device == device for t in inner(local_tensor(p))) for p in nf4)}
    del model, optimizer, batch
    gc.collect()
    return result


def offload_pair(model_dir: str, data: str, overrides: list[str]) -> tuple[dict, dict]:
    """offload_steps without and with parallel.cpu_offload, one after the other in this process."""
    return (offload_steps(model_dir, data, overrides),
            offload_steps(model_dir, data, [*overrides, "parallel.cpu_offload=true"]))


@pytest.mark.parametrize("quantize_base", ["none", "nf4"], ids=["lora", "qlora"])
def test_host_offload_trains_as_on_the_device_from_pinned_shards_with_less_gpu_memory(quantize_base, chat_file,
                                                                                      tmp_path):
    """parallel.cpu_offload on one GPU: the same losses (the optimizer steps on the CPU), every FSDP shard and AdamW
    state in pinned host memory (on one rank QLoRA's NF4 weights stay outside FSDP, on the device), and the device
    no longer holds them: its bytes after the steps lower by at least the shards', its peak lower."""
    from conftest import make_model_dir
    from test_qlora import SIZES
    model_dir = make_model_dir(tmp_path / "model", "llama3", "llama", tied=False, num_layers=4, **SIZES)
    overrides = [*PLAIN, "train.mixed_precision=bf16", "lora.rank=4", "lora.alpha=8", "train.lr=1e-2",
                 f"lora.quantize_base={quantize_base}"]
    plain, host = fresh_process(offload_pair, str(model_dir), str(chat_file), overrides)
    assert host["losses"] == pytest.approx(plain["losses"], rel=1e-3), (plain["losses"], host["losses"])
    assert plain["on_host"] == 0 and host["fsdp"] == host["on_host"] == host["pinned"] > 0, host
    assert host["states"] == host["states_on_host"] > 0 and plain["states_on_host"] == 0, (plain, host)
    assert host["nf4"] == host["nf4_on_device"] == (4 * 7 if quantize_base == "nf4" else 0), host
    assert host["allocated"] <= plain["allocated"] - host["host_bytes"] and host["peak"] < plain["peak"], (plain, host)
