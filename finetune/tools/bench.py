"""`finetune bench`: sweep the activation-checkpointing ratio (and optionally the micro-batch / accumulation split and
model.fp8), a fresh process (or N launched ranks) per point; writes bench.json, bench.md and bench.png.

Each point builds the real model, times optimizer steps on fixed-shape batches (data.pad_to_max) and reports the
median step time, real (non-pad) tokens/s, MFU (both counts of run/mfu), peak memory and the bytes one forward
keeps for backward.
"""
from __future__ import annotations

import json
import statistics
import time
import traceback
from collections import defaultdict
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from ..config import Config, ConfigError, load_config, to_toml
from ..errors import one_line
from ..compat import storage_key
from ..run.mfu import MFU_CONVENTION, MFU_RAN, device_name
from ..memory.offload import Offloaded


def default_budget_mb() -> float:
    """The device's memory: CUDA total memory, or host RAM on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**20
    import psutil
    return psutil.virtual_memory().total / 2**20


# ----------------------------------------------------------------------------------------------- one point

@contextmanager
def count_saved(model):
    """Inside: the storages the forward keeps for backward, in the yielded dict: what autograd saves outside
    checkpointed regions plus the inputs a checkpointed block holds for its recompute; parameters and what ac.offload
    sends to host memory are not counted."""
    storages = {}

    @torch.compiler.disable  # traced into a compiled block's graph, a view's base is None there
    def keep(t):
        if isinstance(t, torch.Tensor) and not ((b := t if t._base is None else t._base).is_leaf and b.requires_grad):
            s = t.untyped_storage()
            storages[storage_key(s)] = s
        return t

    def hold_inputs(module, args, kwargs):
        for v in (*args, *kwargs.values()):
            for t in (v if isinstance(v, tuple) else (v,)):
                keep(t)

    offloaded = {id(m._checkpoint_wrapped_module) for m in model.modules() if isinstance(m, Offloaded)}
    ckpt = [m for m in model.modules() if hasattr(m, "_checkpoint_wrapped_module")  # not what is in host memory:
            and not isinstance(m, Offloaded) and id(m) not in offloaded]
    handles = [m.register_forward_pre_hook(hold_inputs, with_kwargs=True) for m in ckpt]
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            yield storages
    finally:
        for h in handles:
            h.remove()


def saved_for_backward_mb(model, batch: dict, loss_fn=None) -> float:
    """MB that one forward keeps for backward (count_saved), through `loss_fn` (default: sft's loss)."""
    from ..task import sft_loss
    with count_saved(model) as storages:
        loss = (loss_fn or sft_loss)(model, batch)[0]
    num_bytes = sum(s.nbytes() for s in storages.values())  # FSDP frees resharded storages (nbytes 0)
    storages.clear()
    loss.backward()  # completes FSDP's backward state before the process ends
    return num_bytes / 2**20


def run_point(cfg: Config, steps: int, warmup: int) -> dict:
    """Build, warm up, time `steps` optimizer steps, measure memory; one sweep point (a fresh process)."""
    from ..distributed import init_distributed
    from ..metrics import peak_mem_mb
    from ..model import ac_layer_ids, resolve_compile
    from ..task import Run, Task, build_run_samples
    from ..train import build_model_and_optimizer, next_micro_batches, train_step
    from ..tasks import dpo
    from ..data.chat_template import run_tokenizer
    from ..run.mfu import peak_flops, step_flops_per_token
    from ..build import samples, task as build_task, transforms
    from ..run.checks import validate
    device, dims = init_distributed(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cp=cfg.parallel.cp,
                                    ep=cfg.parallel.ep)
    tc, dc = cfg.train, cfg.data
    torch.manual_seed(tc.seed)
    tok, _ = run_tokenizer(cfg)
    stream = build_run_samples(cfg, tok, rank=dims.dp_rank, world_size=dims.dp_size, **samples(cfg, dpo.LABELLERS))
    pairs = stream.sources[0].fmt == "pairs"
    validate(cfg, "dpo" if pairs else "sft")
    model, optimizer, _ = build_model_and_optimizer(cfg, device, dims, transforms(cfg, dims, device))
    if pairs:  # dpo's step (a precomputed reference is read, not timed: zeros here)
        task = Task(dpo.make_loss(cfg.dpo, dpo.reference_kind(cfg)),
                    partial(dpo.collate_pairs, table=defaultdict(lambda: [0.0, 0.0])), dpo.MEANS)
    else:
        task = build_task(cfg, Run(model, optimizer, tok, dims, device, Path(cfg.output_dir), None))
    samples = iter(stream)
    steps_data = [next_micro_batches(samples, tc.micro_batch_size, tc.grad_accum_steps, tok.pad_token_id,
                                     dc.max_seq_len, task.collate, dims.cp) for _ in range(warmup + steps)]
    steps_data = [([{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in mbs], n)
                  for mbs, n in steps_data]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, results = [], []
    for micro_batches, num_input_tokens in steps_data:
        sync()
        t0 = time.perf_counter()
        results.append(train_step(model, optimizer, micro_batches, num_input_tokens=num_input_tokens,
                                  max_grad_norm=tc.max_grad_norm, task=task)[0])
        sync()
        times.append(time.perf_counter() - t0)
    step_time = statistics.median(times[warmup:])
    # per device: the real tokens of a timed step (next_micro_batches: this rank's, split by cp), not the padding
    real_tokens_per_step = statistics.mean(n for _, n in steps_data[warmup:])
    tokens_per_s = real_tokens_per_step / step_time
    num_layers = model.config.num_hidden_layers  # (find_layers cannot tell mixed FSDP/AC blocks apart yet)
    num_params = sum(p.numel() for p in model.parameters())
    peak = peak_flops(device)
    flops_tok = step_flops_per_token(model, [b for mbs, _ in steps_data[warmup:] for b in mbs])
    result = {"ac_ratio": cfg.ac.ratio, "ac_mode": cfg.ac.mode, "ac_blocks": ac_layer_ids(num_layers, cfg.ac.ratio),
              "num_layers": num_layers, "num_params": num_params, "micro_batch_size": tc.micro_batch_size,
              "grad_accum_steps": tc.grad_accum_steps, "seq_len": dc.max_seq_len, "step_time_s": step_time,
              "step_times_s": times, "real_tokens_per_step": real_tokens_per_step, "tokens_per_s": tokens_per_s,
              "num_ranks": dims.mesh.size(), "cp": dims.cp,
              **{k: tokens_per_s * f / peak if peak else None for k, f in flops_tok.items()},
              "peak_mem_mb": peak_mem_mb(device),
              "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20 if device.type == "cuda" else None,
              "device": device_name(), "device_memory_mb": default_budget_mb(),
              "losses": [float(r["loss"]) for r in results]}
    # torch's compiler (2.11 seen on an H100) cannot trace these counting hooks inside a compiled checkpointed
    # block: there the forward is counted uncompiled, an upper bound (compiled blocks save less), marked "(eager)"
    result["saved_eager"] = resolve_compile(cfg.model.compile, device.type == "cuda") and bool(result["ac_blocks"])
    with torch.compiler.set_stance("force_eager" if result["saved_eager"] else "default"):
        result["saved_mb"] = saved_for_backward_mb(model, steps_data[0][0][0], task.loss)
    return result


def run_worker(job: dict) -> None:
    """One sweep point in a child process (each rank's); rank 0's result (or a one-line error) to job["result"]."""
    import os
    from ..distributed import teardown
    try:
        result = run_point(load_config(job["config"], job["overrides"]), job["steps"], job["warmup"])
    except torch.OutOfMemoryError:
        result = {"error": "out of memory"}
    except Exception as e:  # one line in the table (traceback on stderr); the other points still run
        traceback.print_exc()
        result = {"error": one_line(e)}
    finally:
        teardown()
    if os.environ.get("RANK", "0") == "0":
        Path(job["result"]).write_text(json.dumps(result))


def start_workers(model_type: str):
    """Every point is a fresh child process (clean peak memory, no CUDA state): on CPU a child of a fork server that
    has imported torch/transformers once; on CUDA a spawned one (the preloads can initialise CUDA, and a fork server's
    children then fail "Cannot re-initialize CUDA in forked subprocess": seen on an H200 with torch 2.11)."""
    import multiprocessing as mp
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["finetune.tools.bench", "finetune.train", "finetune.model", "datasets", "accelerate",
                                "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                                f"transformers.models.{model_type}.modeling_{model_type}"])
    return ctx


def run_process(ctx, job: dict, tag: str) -> int | None:
    """One point in a child of the fork server; its exit code."""
    proc = ctx.Process(target=run_worker, args=(job,), name=f"bench {tag}")
    proc.start()
    proc.join()
    return proc.exitcode


def launch_point(job: dict, nproc: int) -> int:
    """One point on `nproc` fresh ranks through torch's elastic launcher; the first failed rank's exit code, or 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from ..launch import local_launch_config
    try:
        elastic_launch(local_launch_config(nproc), run_worker)(job)
    except ChildFailedError as e:
        return next(iter(e.failures.values())).exitcode
    return 0


# ----------------------------------------------------------------------------------------------- the sweep

def run_bench(cfg: Config, ratios: list[float], accums: list[int] | None, steps: int, warmup: int,
              out_dir: Path, budget_mb: float | None, nproc: int = 1, fp8s: list[str] | None = None) -> list[dict]:
    """Run every (model.fp8 of `fp8s`, accumulation, ratio) point (`nproc` ranks each); write bench.json/md/png."""
    from dataclasses import replace

    from ..config import check_parallel
    from ..run.checks import check_fp8
    # what sft refuses (fp8 with LoRA, ...), refused before any point runs
    for fp8 in fp8s or []:
        check_fp8(replace(cfg, model=replace(cfg.model, fp8=fp8)))
    p = cfg.parallel
    data_ranks = p.dp_replicate * check_parallel(p.dp_replicate, p.dp_shard, nproc, p.cp)
    if cfg.train.tokens_per_step:  # the rows of a step as sft takes them on these ranks, as accumulation
        from ..run.tokens_per_step import accum_steps
        cfg.train.grad_accum_steps = accum_steps(cfg.train.micro_batch_size, 1, cfg.train.tokens_per_step,
                                                 cfg.data.max_seq_len, data_ranks)
        cfg.train.tokens_per_step = 0
    rank_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps  # rows per data rank and step
    accums = accums or [cfg.train.grad_accum_steps]
    for a in accums:  # the global batch stays fixed; only its split into micro-batches changes
        if rank_batch % a:
            raise ConfigError(f"--grad-accum {a} does not divide the {rank_batch} rows a data rank takes a step "
                              f"(train.micro_batch_size * train.grad_accum_steps)")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.toml").write_text(to_toml(cfg))
    from ..model import load_hf_config
    ctx = start_workers(load_hf_config(cfg.model.path, cfg.model.trust_remote_code).model_type) if nproc == 1 else None
    rows = []
    for fp8, accum, ratio in [(f, a, r) for f in fp8s or [cfg.model.fp8] for a in accums for r in ratios]:
        tag = f"ac.ratio={ratio:g} grad_accum={accum}" + (f" model.fp8={fp8}" if fp8s else "")
        overrides = {"ac.ratio": ratio, "ac.offload": cfg.ac.offload and ratio > 0, "train.grad_accum_steps": accum,
                     "data.pad_to_max": True, "train.micro_batch_size": rank_batch // accum,
                     "output_dir": str(out_dir), "model.fp8": fp8}
        result_file = out_dir / f"point_r{ratio:g}_a{accum}_{fp8}.json"
        result_file.unlink(missing_ok=True)
        job = {"config": str(out_dir / "config.toml"), "overrides": overrides, "steps": steps,
               "warmup": warmup, "result": str(result_file)}
        exit_code = launch_point(job, nproc) if ctx is None else run_process(ctx, job, tag)
        row = json.loads(result_file.read_text()) if result_file.exists() else \
            {"error": f"the worker died (exit code {exit_code})"}
        result_file.unlink(missing_ok=True)
        row.update(ac_ratio=ratio, grad_accum_steps=accum, fp8=fp8)
        rows.append(row)
        print(f"{tag}: " + (f"{row['step_time_s']:.3f} s/step, peak {row['peak_mem_mb']:.0f} MB, "
                            f"saved for backward {row['saved_mb']:.1f} MB" if "error" not in row
                            else f"failed: {row['error']}"), flush=True)
    ok = [r for r in rows if "error" not in r]
    if not ok:
        raise SystemExit("error: every bench point failed; see the messages above")
    for r in ok:  # overhead vs the smallest ratio (ratio 0 when swept) with the same split and model.fp8
        base = min((b for b in ok if (b["grad_accum_steps"], b["fp8"]) == (r["grad_accum_steps"], r["fp8"])),
                   key=lambda b: b["ac_ratio"])
        r["overhead"] = r["step_time_s"] / base["step_time_s"] - 1
    budget_mb = budget_mb or ok[0]["device_memory_mb"]
    meta = {"model": cfg.model.path, "device": ok[0]["device"], "ac_mode": cfg.ac.mode, "seq_len": cfg.data.max_seq_len,
            "global_batch": rank_batch * data_ranks, "ranks": nproc, "cp": p.cp, "steps": steps, "warmup": warmup,
            "mixed_precision": cfg.train.mixed_precision, "memory_budget_mb": budget_mb,
            "cuda": torch.cuda.is_available()}
    meta["recommendation"] = recommend(rows, budget_mb, meta["cuda"])
    (out_dir / "bench.json").write_text(json.dumps({**meta, "points": rows}, indent=2))
    table = format_table(rows, meta)
    (out_dir / "bench.md").write_text(table + "\n\n" + meta["recommendation"] + "\n")
    plot(rows, meta, out_dir / "bench.png")
    print("\n" + table + "\n\n" + meta["recommendation"])
    print(f"wrote {out_dir / 'bench.json'}, bench.md, bench.png")
    return rows


def fit_mb(row: dict, cuda: bool) -> float:
    """The memory that must fit: CUDA max reserved (what the allocator holds), CPU peak RSS."""
    return row["peak_reserved_mb"] if cuda else row["peak_mem_mb"]


def recommend(rows: list[dict], budget_mb: float, cuda: bool) -> str:
    ok = [r for r in rows if "error" not in r]
    fits = [r for r in ok if fit_mb(r, cuda) <= budget_mb]
    if not fits:
        low = min(ok, key=lambda r: fit_mb(r, cuda))
        return (f"No point fits the memory budget of {budget_mb:,.0f} MB; the lowest peak is ac.ratio="
                f"{low['ac_ratio']:g} (grad accum {low['grad_accum_steps']}) at {fit_mb(low, cuda):,.0f} MB.")
    best = max(fits, key=lambda r: r["tokens_per_s"])
    split = f" train.micro_batch_size={best['micro_batch_size']} train.grad_accum_steps={best['grad_accum_steps']}" \
        + (f" model.fp8={best['fp8']}" if best.get("fp8", "off") != "off" else "")
    return (f"Recommendation: ac.ratio={best['ac_ratio']:g}{split}: the fastest point within the memory budget of "
            f"{budget_mb:,.0f} MB ({best['tokens_per_s']:,.0f} tokens/s, peak {fit_mb(best, cuda):,.0f} MB).")


def format_table(rows: list[dict], meta: dict) -> str:
    mem = "peak alloc / reserved (MB)" if meta["cuda"] else "peak RSS (MB)"
    base = min(r["ac_ratio"] for r in rows)
    ranks = "one device" if meta["ranks"] == 1 else f"{meta['ranks']} ranks (cp {meta['cp']}), rank 0's memory"
    lines = [f"AC sweep: {meta['model']} on {meta['device']}; seq {meta['seq_len']}, global batch "
             f"{meta['global_batch']}, {meta['mixed_precision']}, ac.mode={meta['ac_mode']}, median of "
             f"{meta['steps']} steps after {meta['warmup']} warm-up; {ranks}; tokens/s: real (non-pad) tokens; "
             f"{MFU_CONVENTION}; {MFU_RAN}", "",
             f"| ac.ratio | fp8 | blocks | micro x accum | step time (s) | tokens/s per device | MFU / MFU ran | {mem} "
             f"| saved for backward (MB) | overhead vs ratio {base:g} |", "|---:" * 10 + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['ac_ratio']:g} | {r['fp8']} | | x{r['grad_accum_steps']} | failed: {r['error']} "
                         f"| | | | | |")
            continue
        peak = f"{r['peak_mem_mb']:,.0f}" + (f" / {r['peak_reserved_mb']:,.0f}" if meta["cuda"] else "")
        mfu = f"{r['mfu']:.1%} / {r['mfu_ran']:.1%}" if r.get("mfu") is not None else "n/a"
        lines.append(f"| {r['ac_ratio']:g} | {r['fp8']} | {len(r['ac_blocks'])}/{r['num_layers']} | "
                     f"{r['micro_batch_size']} x {r['grad_accum_steps']} | {r['step_time_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {mfu} | {peak} | {r['saved_mb']:,.1f}"
                     f"{' (eager)' if r.get('saved_eager') else ''} | {r.get('overhead', 0):+.1%} |")
    return "\n".join(lines)


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    mem_label = "peak reserved (MB)" if meta["cuda"] else "peak RSS (MB)"
    panels = [("step_time_s", "median step time (s)"), ("mem", mem_label), ("saved_mb", "saved for backward (MB)")]
    for accum, fp8 in sorted({(r["grad_accum_steps"], r["fp8"]) for r in rows}):
        pts = sorted((r for r in rows if (r["grad_accum_steps"], r["fp8"]) == (accum, fp8) and "error" not in r),
                     key=lambda r: r["ac_ratio"])
        label = f"micro {pts[0]['micro_batch_size']} x accum {accum}, fp8 {fp8}" if pts else None
        for ax, (key, _) in zip(axes, panels):
            ys = [fit_mb(r, meta["cuda"]) if key == "mem" else r[key] for r in pts]
            ax.plot([r["ac_ratio"] for r in pts], ys, marker="o", label=label)
    for ax, (_, ylabel) in zip(axes, panels):
        ax.set_xlabel("ac.ratio (fraction of decoder blocks checkpointed)")
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel.split(" (")[0])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Activation checkpointing sweep (ac.mode={meta['ac_mode']}): {Path(meta['model']).name} on "
                 f"{meta['device']}\nseq {meta['seq_len']}, global batch {meta['global_batch']}, "
                 f"{meta['mixed_precision']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
