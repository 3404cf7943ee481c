"""The GPU figures of issue 50, one stage a call (each under 10 minutes on an H100), in the order that closes the
most; benchmarks/gpu_check.sh runs them. Each stage appends its JSON lines (results.py: commit, device, torch, the
command, per-step figures) to benchmarks/results/<stage>.jsonl. Without CUDA (or with --dry-run) a stage builds its
small inputs, prints its commands and stops where CUDA is first needed; --tiny runs a stage to the end at toy widths
on any device where it can (peers, moe30b, profile on CPU), its lines under <work>/results.

  peers        compare_peers.py: finetune defaults vs TRL at its fastest (packing, padding-free, Liger, bf16, no
               gradient checkpointing), alternated for ROUNDS rounds (2), on the realistic rows of chat_data.py;
               MFU by both counts (run/mfu: the convention, and lm_head at the label positions)
  fp8          finetune bench --fp8 off,tensorwise,rowwise on an 8-layer slice of Llama-3-8B's widths (2.8B params),
               packed realistic rows of 8,192 tokens, no AC, compiled blocks
  moe30b       finetune bench at Qwen3-30B-A3B's widths (a 4-layer slice: 128 experts of 768, 8 a token, hidden 2048,
               vocab 151,936; 3.1B params), experts grouped_mm vs eager, compiled blocks, dynamo's recompiles counted
  profile      the defaults (the 886M Llama, 8 packed rows of 2,048 realistic tokens) with one step after warm-up under
               torch.profiler: device time by kind (GEMMs, attention, loss, optimizer, FSDP copies, the rest), the
               top kernels, and the step's time the kernels leave idle
  offload131k  the 886M Llama on packed rows of 131,072 realistic tokens, every block checkpointed, compiled:
               ac.offload off and on, peak memory
  lora8b, full gpu_points.py (finetune plan vs the measured peak), its gpu_points.json entry as a line

    python3 benchmarks/gpu_figures.py STAGE... [--dry-run] [--tiny] [--work DIR] [--results-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
STAGES = ("peers", "fp8", "moe30b", "profile", "offload131k", "lora8b", "full")
# Qwen3-30B-A3B's widths (its config.json), sliced to a few layers so one GPU holds AdamW's state
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, norm_topk_prob=True, max_position_embeddings=8192, rope_theta=1e6)
# kinds of device time in the profile, first match wins (flash attention 3's kernels are named cutlass::...flash);
# "fsdp copies" holds FSDP's all-gather copy-in/out and the other copy kernels (dtype casts) alike
KINDS = [("attention", r"flash|fmha|attention|attn|varlen|sdpa"),
         ("loss", r"liger|cross_entropy|nll_loss|log_softmax"),
         ("optimizer", r"adam|multi_tensor|foreach"),
         ("fsdp copies", r"all_gather|allgather|reduce_scatter|chunk_cat|split_with_sizes|memcpy|nccl|copy_"),
         ("gemm", r"gemm|cutlass|xmma|nvjet|wgmma|cublas|aten::(mm|addmm|bmm|matmul)\b|grouped_mm")]
ARGS = argparse.Namespace(dry_run=True, tiny=False)


def cuda_or_stop(stage: str) -> bool:
    """The dry-run stop: False (and one line) where there is no CUDA or --dry-run; --tiny runs on."""
    import torch
    if ARGS.tiny or (torch.cuda.is_available() and not ARGS.dry_run):
        return True
    print(f"{stage}: needs a CUDA device from here on (dry run: stops here)", flush=True)
    return False


def run(cmd: list[str], env: dict | None = None) -> str:
    """Run (from the repo), echo and return its output; a failure is printed, not raised (the stage goes on)."""
    print("$ " + shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "WANDB_MODE": "disabled", **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("\n".join(proc.stdout.splitlines()[-12:]), flush=True)
    if proc.returncode:
        print(f"(exit code {proc.returncode})", flush=True)
    return proc.stdout


def realistic_rows(work: Path, max_tokens: int = 8192) -> Path:
    num_rows = ARGS.rows
    from transformers import AutoTokenizer

    from chat_data import write_rows
    path = work / f"chat-realistic-{num_rows}-{max_tokens}.jsonl"
    if not path.exists():
        write_rows(path, AutoTokenizer.from_pretrained(REPO / "examples" / "tiny-llama"), num_rows, 0, max_tokens)
    return path


def m1b(work: Path) -> Path:
    """The 886M Llama of the bench stages (benchmarks/gpu_check.sh m1b); toy widths under --tiny."""
    from load_and_export import make_model_dir
    path = work / ("m-tiny" if ARGS.tiny else "m1b")
    if not path.exists():
        sizes, heads = ((2, 64, 128, 1024), dict(num_attention_heads=4, num_key_value_heads=2)) if ARGS.tiny else \
            ((16, 2048, 5632, 32000), {})
        make_model_dir(path, *sizes, max_position_embeddings=8192, **heads)
    return path


def bench(stage: str, model: Path, data: Path, out: Path, flags: list[str], variant: str,
          env: dict | None = None, **extra) -> list[dict]:
    """`finetune bench` at one setting; its points as JSON lines (with `extra`, e.g. recompiles)."""
    import results
    cmd = [sys.executable, "-m", "finetune", "bench", "--model", str(model), "--dataset", str(data),
           "--output-dir", str(out), "train.mixed_precision=bf16", "data.packing=true", *flags]
    output = run(cmd, env)
    if not (out / "bench.json").exists():
        return results.append(stage, [{"variant": variant, "error": output.strip().splitlines()[-1:]}],
                              shlex.join(cmd), ARGS.results_dir)
    records = [{**r, **{k: f(output) if callable(f) else f for k, f in extra.items()}}
               for r in results.bench_records(out / "bench.json", variant)]
    return results.append(stage, records, shlex.join(cmd), ARGS.results_dir)


# ----------------------------------------------------------------------------------------------- the stages


def stage_peers(work: Path) -> None:
    import results
    out = work / "peers"
    cmd = [sys.executable, "benchmarks/compare_peers.py", "--only", "peers", "--rounds", os.environ.get("ROUNDS", "2"),
           "--steps", "8", "--warmup", "3", "--systems", "defaults,trl", "--output-dir", str(out)]
    cmd += ["--tiny", "--device", "cpu", "--rounds", "1", "--steps", "2", "--warmup", "1"] if ARGS.tiny else \
        ["--device", "cuda"]
    print("$ " + shlex.join(cmd))
    if not cuda_or_stop("peers"):
        return
    run(cmd)
    lines = results.peers_records(out / "compare_peers.json")
    results.append("peers", lines, shlex.join(cmd), ARGS.results_dir)


def stage_fp8(work: Path) -> None:
    from gpu_points import TINY, config_dir, write_random_weights
    model = config_dir(work / ("llama3-8b-tiny" if ARGS.tiny else "llama3-8b-8layers"),
                       {"num_hidden_layers": 8, "max_position_embeddings": 8192, **(TINY if ARGS.tiny else {})})
    seq = 512 if ARGS.tiny else 8192
    data = realistic_rows(work, seq)
    flags = ["--fp8", "off,tensorwise,rowwise", "--sac-ratios", "0", "--steps", "6", "--warmup", "2",
             f"data.max_seq_len={seq}", "train.micro_batch_size=1"]
    print(f"model {model} (Llama-3-8B's widths, 8 layers), data {data}; finetune bench {shlex.join(flags)}")
    if not cuda_or_stop("fp8"):
        return
    write_random_weights(model)
    bench("fp8", model, data, work / "fp8", flags, "8 layers of Llama-3-8B")


def stage_moe30b(work: Path) -> None:
    from load_and_export import make_model_dir
    layers = int(os.environ.get("MOE_LAYERS", "4"))
    fields = dict(QWEN3_30B_A3B, num_hidden_layers=layers)
    if ARGS.tiny:
        fields.update(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1024)
    seq = 512 if ARGS.tiny else 4096
    data = realistic_rows(work, seq)
    flags = ["--sac-ratios", "0", "--steps", "6", "--warmup", "2", f"data.max_seq_len={seq}",
             "train.micro_batch_size=2", "model.compile=true"]
    print(f"Qwen3-MoE at Qwen3-30B-A3B's widths, {layers} layers; finetune bench {shlex.join(flags)} "
          f"model.experts_implementation=grouped_mm / eager, TORCH_LOGS=recompiles")
    if not cuda_or_stop("moe30b"):
        return
    model = work / f"qwen3-30b-a3b-{layers}layers{'-tiny' if ARGS.tiny else ''}"
    if not model.exists():
        sizes = {k: fields.pop(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")}
        make_model_dir(model, sizes["num_hidden_layers"], sizes["hidden_size"], sizes["intermediate_size"],
                       sizes["vocab_size"], arch="qwen3_moe", **fields)
    for impl in ("grouped_mm", "eager"):
        bench("moe30b", model, data, work / f"moe30b-{impl}", [*flags, f"model.experts_implementation={impl}"],
              impl, env={"TORCH_LOGS": "recompiles"},
              recompiles=lambda out: len(re.findall(r"Recompiling function", out)))


KIND_RES = [(k, re.compile(p)) for k, p in KINDS]


def kind_of(name: str) -> str:
    return next((k for k, p in KIND_RES if p.search(name.lower())), "other")


def profile_worker(cfg, warmup: int) -> dict:
    """bench's run_point with its step number `warmup` (the first after warm-up) under torch.profiler: the device
    time of each kernel (CPU: each op's self time), summed by kind."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import finetune.train as train
    from finetune.tools.bench import run_point
    cuda = torch.cuda.is_available()
    step, calls, prof = train.train_step, [], {}

    def profiled_step(*args, **kwargs):
        calls.append(1)
        if len(calls) != warmup + 1:
            return step(*args, **kwargs)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as p:
            result = step(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        prof["events"] = p.key_averages()
        return result

    train.train_step = profiled_step
    try:
        point = run_point(cfg, 1, warmup)
    finally:
        train.train_step = step
    if cuda:  # the kernels themselves (an op's own entry holds the time of the kernels it launched too)
        from torch.autograd import DeviceType
        times = {e.key: e.self_device_time_total for e in prof["events"]
                 if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0}
    else:  # aten ops' own time; the ops that call others would count twice
        times = {e.key: e.self_cpu_time_total for e in prof["events"] if e.key.startswith("aten::")}
    kinds: dict[str, float] = {}
    for name, us in times.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0) + us / 1e3
    busy_ms, step_ms = sum(kinds.values()), point["step_times_s"][warmup] * 1e3
    top = sorted(times.items(), key=lambda kv: -kv[1])[:15]
    return {"profiled_step_ms": step_ms, "kernel_ms": busy_ms, "idle_share": max(0.0, 1 - busy_ms / step_ms),
            "ms_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "share_by_kind": {k: round(v / busy_ms, 4) for k, v in kinds.items()},
            "top_kernels": [[name[:90], kind_of(name), round(us / 1e3, 3)] for name, us in top],
            **{k: point[k] for k in ("step_times_s", "tokens_per_s", "real_tokens_per_step", "mfu", "mfu_ran",
                                     "peak_mem_mb", "peak_reserved_mb", "losses")}}


def stage_profile(work: Path) -> None:
    import results
    seq, rows = (256, 4) if ARGS.tiny else (2048, 8)
    data = realistic_rows(work, seq)
    overrides = [f"data.max_seq_len={seq}", f"train.micro_batch_size={rows}", "data.packing=true",
                 "data.pad_to_max=true", "train.mixed_precision=bf16", "ac.ratio=0"]
    command = f"gpu_figures.py profile: run_point(3 warm-up steps, step 4 profiled), {shlex.join(overrides)}"
    print(command)
    if not cuda_or_stop("profile"):
        return
    from finetune.args import build_config
    cfg = build_config(None, overrides, **{"model.path": str(m1b(work)), "data.path": str(data),
                                           "output_dir": str(work / "profile")})
    result = profile_worker(cfg, warmup=3)
    print(json.dumps({k: result[k] for k in ("profiled_step_ms", "kernel_ms", "idle_share", "ms_by_kind")}))
    results.append("profile", [result], command, ARGS.results_dir)


def stage_offload131k(work: Path) -> None:
    seq = 4096 if ARGS.tiny else 131072
    data = realistic_rows(work, 8192)
    flags = ["--sac-ratios", "1", "--steps", "4", "--warmup", "2", f"data.max_seq_len={seq}",
             "train.micro_batch_size=1", "model.compile=true"]
    print(f"886M Llama, finetune bench {shlex.join(flags)} ac.offload=false / true")
    if not cuda_or_stop("offload131k"):
        return
    model = m1b(work)
    for offload in ("false", "true"):
        bench("offload131k", model, data, work / f"offload-{offload}", [*flags, f"ac.offload={offload}"],
              f"ac.offload={offload}")


def stage_points(stage: str, work: Path) -> None:
    import results
    out = work / f"points-{stage}"
    cmd = [sys.executable, "benchmarks/gpu_points.py", stage, "--output-dir", str(out)] + (["--tiny"] if ARGS.tiny
                                                                                           else [])
    print("$ " + shlex.join(cmd))
    if not cuda_or_stop(stage):
        return
    run(cmd)
    points = json.loads((out / "gpu_points.json").read_text()) if (out / "gpu_points.json").exists() else {}
    entry = points.get(stage, {"error": "gpu_points.py wrote no result"})
    results.append(stage, [{"gpu_memory": points.get("gpu_memory"), **entry}], shlex.join(cmd), ARGS.results_dir)


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stages", nargs="+", choices=STAGES)
    p.add_argument("--dry-run", action="store_true", help="build the inputs, print the commands, stop before CUDA")
    p.add_argument("--tiny", action="store_true", help="toy widths, run to the end (peers, moe30b, profile on CPU)")
    p.add_argument("--rows", type=int, default=2000, help="realistic chat rows to generate (chat_data.py)")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-figures"), help="models, data and runs")
    p.add_argument("--results-dir", type=Path, help="the JSON lines (default: benchmarks/results; --tiny: "
                                                    "<work>/results)")
    ARGS = p.parse_args()
    import results
    ARGS.results_dir = ARGS.results_dir or (ARGS.work / "results" if ARGS.tiny else results.RESULTS_DIR)
    ARGS.work.mkdir(parents=True, exist_ok=True)
    for stage in ARGS.stages:
        print(f"== {stage}", flush=True)
        if stage in ("lora8b", "full"):
            stage_points(stage, ARGS.work)
        else:
            globals()[f"stage_{stage}"](ARGS.work)


if __name__ == "__main__":
    main()
