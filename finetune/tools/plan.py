"""`finetune plan`: the memory of one GPU of a run, on a CPU and without weights: the model built on fake tensors,
sharded over a fake process group of the planned world size, runs fake forwards. Per GPU: the sharded parameters,
gradients and AdamW state; FSDP's unsharded units in flight; per micro-batch and AC ratio, the bytes saved for backward
(bench's counter), the recompute of one checkpointed block and the logits/loss peak.
"""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from ..config import Config, ConfigError
from ..errors import one_line
from ..compat import TorchDispatchMode, fake_world_parts, fsdp_param_group, storage_key, tree_leaves

SAFETY = 0.10  # of GPU memory kept free: CUDA context, NCCL buffers, allocator fragmentation
GIB = 2**30


def parse_gpu_memory(text: str) -> int:
    """'80GB' -> bytes. GB means GiB here, as GPUs are sized (an H100 80GB has 80 GiB); 80G, 1TB, 512MiB too."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([MGT])(?:i?B)?)?\s*", text, re.I)
    size = int(float(m[1]) * 2 ** {"M": 20, "G": 30, "T": 40}[(m[2] or "G").upper()]) if m else 0
    if size <= 0:  # also a size that rounds to no bytes (its percentages would divide by zero)
        raise ConfigError(f"--gpu-memory must be a size like 80GB or 24576MB, got {text!r}")
    return size


def load_arch(cfg: Config, model_dir: str | None):
    """The HF config to plan: --model DIR, else a local model.path, else model.arch (offline), else the hub's."""
    from transformers import AutoConfig

    from ..model import load_hf_config
    if model_dir or Path(cfg.model.path).expanduser().is_dir() or not cfg.model.arch:
        return load_hf_config(model_dir or cfg.model.path, cfg.model.trust_remote_code)
    try:
        fields = json.loads(Path(cfg.model.arch).read_text())
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except Exception as e:  # noqa: BLE001 - the file, its JSON, or transformers' validation of the values
        raise ConfigError(f"model.arch '{cfg.model.arch}' is not a readable HF config.json ({one_line(e)})") from e


@contextmanager
def fake_world(world_size: int, dp_replicate: int = 1, dp_shard: int = 0, cp: int = 1):
    """A fake process group of world_size (this process is rank 0), its ParallelDims and the fake tensor mode."""
    import torch.distributed as dist

    from ..distributed import build_parallel_dims
    store, fake_mode = fake_world_parts()
    dist.init_process_group("fake", store=store, rank=0, world_size=world_size)
    try:
        yield build_parallel_dims("cpu", dp_replicate, dp_shard, cp), fake_mode
    finally:
        dist.destroy_process_group()


def build_fake_models(hf_config, cfg: Config, mesh, fake_mode, ratios: set[float], liger: bool) -> dict:
    """{ac.ratio: model} for each of `ratios`: build_model's parallelize (the run's transforms but for the kernels,
    which cannot run on fake tensors, and compile; with Liger's FSDP layout) of a copy of one meta skeleton built once
    (fully_shard is slow on fake tensors), then fake storage."""
    import copy
    from dataclasses import replace

    from ..model import Transform, build_skeleton, parallelize
    from ..build import transforms
    # flash/flex attention need a GPU (flex on fake CPU tensors even crashes): sdpa (CPU's flash kernel) stands in,
    # saving the same O(seq) output and log-sum-exp for backward; eager (seq x seq probabilities) is planned as is
    attn = "eager" if cfg.model.attn_implementation == "eager" else "sdpa"
    skeleton, models = build_skeleton(hf_config, attn, cfg.model.trust_remote_code), {}
    # fp8: plan_float8_bytes; nf4: plan_nf4 (NF4 weights do not run on fake tensors)
    t = [x for x in transforms(replace(cfg, lora=replace(cfg.lora, quantize_base="none")), None, torch.device("cuda"))
         if x.stage not in ("attention", "kernels", "float8")]
    t.append(Transform("kernels", lambda model, layers: None, lm_head_in_root=liger))
    for ratio in sorted(ratios):
        models[ratio] = model = copy.deepcopy(skeleton)
        parallelize(model, mesh, t, mixed_precision=cfg.train.mixed_precision, ac_ratio=ratio)
        with fake_mode:
            model.to_empty(device="cpu")
    return models


class LivePeak(TorchDispatchMode):
    """Peak bytes alive in the storages that ops create while it is on (weakly held: freed ones stop counting)."""

    def __init__(self):
        super().__init__()
        self.refs, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.refs.setdefault(storage_key(s), (StorageWeakRef(s), s.nbytes()))
        self.peak = max(self.peak, sum(n for ref, n in self.refs.values() if not ref.expired()))
        return out


def measure_micro_batch(model, micro_batch_size: int, seq_len: int) -> dict:
    """One fake forward: bytes saved for backward up to the last decoder block's output, and the head's peak (final
    norm, lm_head, loss with a target at every position: an upper bound) through its backward to that output."""
    from ..loss import token_loss_sum
    from .bench import count_saved
    from ..model import find_layers
    ids = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
    index = torch.arange(ids.numel()).view_as(ids)[:, :-1].flatten()  # every position but a row's last
    batch = {"input_ids": ids, "label_index": index, "label_targets": torch.zeros_like(index)}
    head, marks = LivePeak(), {}

    def after_last_block(module, args, output):
        marks["activations"] = sum(s.nbytes() for s in saved.values())
        marks["hidden"] = output[0] if isinstance(output, tuple) else output
        head.__enter__()

    handle = find_layers(model)[-1].register_forward_hook(after_last_block)
    try:
        with count_saved(model) as saved:
            loss = token_loss_sum(model, batch)
        marks["saved"] = sum(s.nbytes() for s in saved.values())  # what bench reports: the head's part too
        saved.clear()
        torch.autograd.grad(loss, marks["hidden"])  # the head's backward only
    finally:
        handle.remove()
        head.__exit__(None, None, None)
    return {"activations": marks["activations"], "logits_loss": head.peak, "saved": marks["saved"]}


def measure_state(model, nf4: dict | None = None) -> dict:
    """Bytes per GPU of the sharded parameters, their gradients and AdamW state by dtype; each parameter's (rows,
    numel, bytes per element) to re-shard for another world size; the units in flight (after a forward). `nf4`:
    plan_nf4's bytes per element of the weights QLoRA holds as NF4."""
    state, params, nf4 = {}, [], nf4 or {}
    for p in model.parameters():
        local = p.to_local()
        tensors = [("params", local)] + [("grads", local), ("optimizer", local), ("optimizer", local)] * p.requires_grad
        for kind, t in tensors:
            key = f"{kind} {'nf4' if id(p) in nf4 else str(t.dtype).removeprefix('torch.')}"
            state[key] = state.get(key, 0) + t.numel() * nf4.get(id(p), t.element_size())
        params.append((tuple(p.shape), p.numel(), nf4.get(id(p), sum(t.element_size() for _, t in tensors))))
    held, units, unit_grads = 0, [], 0
    for m in model.modules():
        group = fsdp_param_group(m)
        if group is None:
            continue
        fps = [(math.prod(fp._orig_size), fp.param_dtype or fp.orig_dtype, fp.reduce_dtype, fp.sharded_param)
               for fp in group.fsdp_params]
        unit = sum(n * nf4.get(id(p), dt.itemsize) for n, dt, _, p in fps)
        unit_grads = max(unit_grads, sum(n * (dt.itemsize + (rd.itemsize if rd not in (None, dt) else 0))
                                         for n, dt, rd, p in fps if p.requires_grad))
        if group.post_forward_mesh_info is None:  # not resharded after forward: unsharded until its backward
            held += unit
        else:
            units.append(unit)
    in_flight = {"held": held, "current+next": sum(sorted(units)[-2:]), "grads+reduce": unit_grads,
                 **({"nf4 dequantized": nf4["dequantized"]} if nf4 else {})}
    return {"state": state, "params": params, "in_flight": in_flight}


def sharded_bytes(params: list, world_size: int) -> int:
    """Rank 0's bytes of `params` sharded over `world_size` (fully_shard's chunks: ceil(rows / world) rows each)."""
    from ..model import shard_dim

    def rows(shape):
        return shape[shard_dim(shape, world_size)] if shape else 1
    return sum(math.ceil(rows(s) / world_size) * (numel // rows(s)) * nbytes for s, numel, nbytes in params)


def measure_runs(hf_config, cfg: Config, dims, fake_mode, ratios: list[float], shapes: list[tuple[int, int]],
                 liger: bool) -> tuple[dict, dict]:
    """{(ratio, (micro-batch, tokens per rank)): measure_micro_batch} at every ratio and 0, and measure_state."""
    models = build_fake_models(hf_config, cfg, dims.mesh, fake_mode, {0.0, *ratios}, liger)
    from ..adapters.qlora import plan_nf4
    nf4 = plan_nf4(models[max(models)], cfg.lora.quantize_base, dims.mesh.shape[-1], LivePeak)
    with fake_mode:
        runs = {(r, (mbs, seq)): measure_micro_batch(m, mbs, seq) for r, m in models.items() for mbs, seq in shapes}
        measured = measure_state(model := models[max(models)], nf4)
    if cfg.model.fp8 != "off":  # fp8's weight copies in flight and scales (the fake model itself stays unconverted)
        from ..kernels.float8 import plan_float8_bytes
        measured["in_flight"]["fp8"] = plan_float8_bytes(model, cfg.model.fp8, all_gather=cfg.model.fp8_all_gather,
                                                         param_bytes=2 if cfg.train.mixed_precision == "bf16" else 4)
    return runs, measured


def point(runs: dict, ratio: float, shape: tuple[int, int], fixed: float, num_layers: int) -> dict:
    """One (ratio, shape)'s bytes per GPU; the recompute of one checkpointed block is 1/L of the ratio-0 activations."""
    run = runs[ratio, shape]
    recompute = runs[0.0, shape]["activations"] / num_layers if ratio > 0 else 0
    return {**run, "recompute": recompute, "total": fixed + run["activations"] + recompute + run["logits_loss"]}


def run_plan(cfg: Config, hf_config, nnodes: int, nproc: int, gpu_bytes: int, ratios: list[float],
             micro_batch_sizes: list[int]) -> dict:
    """Measure everything on fake tensors; which (ratio, micro-batch) points fit; the smallest world that would.
    With parallel.cp = N a rank holds ceil(S / N) tokens of each row (its heads' attention over the whole row after
    the all-to-all keeps as many bytes as all heads over its tokens) and FSDP shards over dp_shard x cp."""
    from ..kernels.liger import resolve_liger
    world, cp = nnodes * nproc, cfg.parallel.cp
    liger = resolve_liger(cfg.model.liger, cuda=True)  # as build_model does on the planned GPUs
    local_seq = -(-cfg.data.max_seq_len // cp)
    with fake_world(world, cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cp) as (dims, fake_mode):
        runs, measured = measure_runs(hf_config, cfg, dims, fake_mode, ratios,
                                      [(mbs, local_seq) for mbs in micro_batch_sizes], liger)
    in_flight = sum(measured["in_flight"].values())
    fixed = sum(measured["state"].values()) + in_flight
    usable = gpu_bytes * (1 - SAFETY)
    points = []
    for ratio, (mbs, seq) in runs:
        if ratio in ratios:
            p = point(runs, ratio, (mbs, seq), fixed, hf_config.num_hidden_layers)
            points.append({"ac_ratio": ratio, "micro_batch_size": mbs, **p, "free": gpu_bytes - p["total"],
                           "fits": p["total"] <= usable})
    fits = [p for p in points if p["fits"]]
    best = min(fits, key=lambda p: (p["ac_ratio"], -p["micro_batch_size"])) if fits else None
    smallest, replicas = None, cfg.parallel.dp_replicate
    if not fits:  # more GPUs shrink only the sharded state (a set dp_shard grows with them), to one row a GPU at most
        least = min(p["total"] - fixed for p in points) + in_flight
        floor = least + sum(numel // max(s, default=1) * nbytes for s, numel, nbytes in measured["params"])
        smallest = None if floor > usable else next((w for w in range(world + nproc, 2**16, nproc) if w % replicas == 0
                                                     and sharded_bytes(measured["params"], w // replicas) + least
                                                     <= usable), None)
    return {**describe(cfg, hf_config, nnodes, nproc, gpu_bytes, dims, liger, measured), "points": points,
            "best": best, "smallest_world_size": smallest}


def describe(cfg: Config, hf_config, nnodes: int, nproc: int, gpu_bytes: int, dims, liger: bool, measured) -> dict:
    """What a plan is of (the header of its table)."""
    return {"model": cfg.model.path, "num_params": sum(n for _, n, _ in measured["params"]), "nnodes": nnodes,
            "nproc_per_node": nproc, "world_size": nnodes * nproc, "parallel": str(dims),
            "parallel_config": asdict(cfg.parallel), "gpu_memory": gpu_bytes, "safety": SAFETY,
            "seq_len": cfg.data.max_seq_len, "mixed_precision": cfg.train.mixed_precision, "ac_mode": cfg.ac.mode,
            "ac_offload": cfg.ac.offload, "liger": liger, "state": measured["state"],
            "in_flight": measured["in_flight"]}


MAX_LOCAL_TOKENS = 2**22  # tokens per rank where the --max-seq-len search stops doubling (4M: beyond any model's)


def run_seq_search(cfg: Config, hf_config, nnodes: int, nproc: int, gpu_bytes: int, ratios: list[float]) -> dict:
    """`plan --max-seq-len`: the longest data.max_seq_len that fits at micro-batch 1, for each ac.ratio and cp degree
    (within a node, dividing the heads). A rank's bytes depend on its S / cp tokens only: measured, never extrapolated
    (fake forwards from 1024 tokens per rank, doubled while they fit, then bisected to a multiple of 1024)."""
    from ..kernels.liger import resolve_liger
    from ..adapters.qlora import plan_nf4
    world, unit = nnodes * nproc, 1024
    heads = hf_config.get_text_config().num_attention_heads
    cps = [c for c in (1, 2, 4, 8, 16, 32, 64) if nproc % c == 0 and heads % c == 0]
    liger = resolve_liger(cfg.model.liger, cuda=True)
    usable, num_layers = gpu_bytes * (1 - SAFETY), hf_config.num_hidden_layers
    with fake_world(world, cfg.parallel.dp_replicate) as (dims, fake_mode):
        models = build_fake_models(hf_config, cfg, dims.mesh, fake_mode, {0.0, *ratios}, liger)
        runs, sizes = {}, {r: {} for r in ratios}  # sizes: what each ratio measured, {tokens per rank: bytes}

        def total(ratio: float, tokens: int) -> float:  # measured bytes per GPU, `tokens` per rank
            for r in {0.0, ratio}:  # ratio 0's activations give the recompute of one checkpointed block
                if (r, (1, tokens)) not in runs:
                    with fake_mode:
                        runs[r, (1, tokens)] = measure_micro_batch(models[r], 1, tokens)
            sizes[ratio][tokens] = point(runs, ratio, (1, tokens), fixed, num_layers)["total"]
            return sizes[ratio][tokens]

        with fake_mode:  # the state and the units in flight (after a forward: FSDP's lazy init decides resharding)
            runs[0.0, (1, unit)] = measure_micro_batch(models[0.0], 1, unit)
            measured = measure_state(models[0.0], plan_nf4(models[0.0], cfg.lora.quantize_base, dims.mesh.shape[-1],
                                                            LivePeak))
        fixed = sum(measured["state"].values()) + sum(measured["in_flight"].values())
        longest, totals = {}, {}  # per ratio: the most tokens per rank measured to fit, and their bytes
        for ratio in ratios:
            fits, fails = 0, None
            while fails is None and (n := 2 * fits or unit) <= MAX_LOCAL_TOKENS:  # doubling: unit, 2 unit, ...
                if total(ratio, n) <= usable:
                    fits = n
                else:
                    fails = n
            while fails is not None and fails - fits > unit:  # bisection in units, between a fit and a failure
                n = (fits + fails) // 2 // unit * unit
                fits, fails = (n, fails) if total(ratio, n) <= usable else (fits, n)
            longest[ratio] = fits
            totals[ratio] = total(ratio, fits) if fits else None
        table = {ratio: {cp: longest[ratio] * cp for cp in cps} for ratio in ratios}
        ratio, cp = max(((r, c) for r in ratios for c in cps), key=lambda rc: (table[rc[0]][rc[1]], -rc[1], -rc[0]))
        seq = table[ratio][cp]
        best = {"ac_ratio": ratio, "cp": cp, "max_seq_len": seq, "total": totals[ratio]} if seq else None
    return {**describe(cfg, hf_config, nnodes, nproc, gpu_bytes, dims, liger, measured),
            "max_seq_len": {str(r): {str(c): n for c, n in row.items()} for r, row in table.items()}, "best": best,
            "measured": {str(r): {str(n): sizes[r][n] for n in sorted(sizes[r])} for r in ratios}}


def format_seq_search(r: dict) -> str:
    cps = list(next(iter(r["max_seq_len"].values())))
    lines = [f"longest data.max_seq_len (micro-batch 1) for {r['model']} ({r['num_params'] / 1e9:.3g}B parameters) "
             f"on {r['nnodes']} x {r['nproc_per_node']} GPUs of {r['gpu_memory'] / GIB:.0f} GiB, {r['mixed_precision']}"
             f", ac.mode={r['ac_mode']}, ac.offload={str(r['ac_offload']).lower()}; FSDP over all ranks, cp within "
             f"a node ({r['safety']:.0%} of each GPU kept free):", "",
             "| ac.ratio | " + " | ".join(f"cp={c}" for c in cps) + " |", "|---:" * (len(cps) + 1) + "|"]
    lines += [f"| {ratio} | " + " | ".join(f"{n:,}" for n in row.values()) + " |" for ratio, row in
              r["max_seq_len"].items()]
    b = r["best"]
    lines.append(f"\nlongest: data.max_seq_len={b['max_seq_len']} parallel.cp={b['cp']} ac.ratio={b['ac_ratio']:g} "
                 f"(measured: {b['total'] / GIB:.1f} of {r['gpu_memory'] / GIB:.0f} GiB)" if b else
                 "\nnothing fits 1024 tokens per rank: more GPUs, a higher ac.ratio or ac.offload")
    if r["liger"]:
        lines.append("(logits/loss measured without Liger's fused loss, at every position: an upper bound)")
    return "\n".join(lines)


def format_plan(r: dict) -> str:
    unit, name = (GIB, "GiB") if r["gpu_memory"] >= 4 * GIB else (2**20, "MiB")
    size = lambda b: f"{b / unit:,.1f}" if abs(b) >= 10 * unit else f"{b / unit:.3g}"  # noqa: E731
    cp = r["parallel_config"]["cp"]
    local = f" ({-(-r['seq_len'] // cp)} tokens per rank)" if cp > 1 else ""
    offload = ", ac.offload (checkpointed blocks' inputs in host memory, not counted)" if r["ac_offload"] else ""
    lines = [f"plan: {r['model']} ({r['num_params'] / 1e9:.3g}B parameters) on {r['nnodes']} x "
             f"{r['nproc_per_node']} GPUs ({r['parallel']}) of {size(r['gpu_memory'])} {name}; seq {r['seq_len']}"
             f"{local}, {r['mixed_precision']}, ac.mode={r['ac_mode']}{offload}",
             "", f"per GPU, every step ({name}):"]
    lines += [f"  {k:<24} {size(v):>8}" for k, v in r["state"].items()]
    lines += [f"  {'in flight: ' + k:<24} {size(v):>8}" for k, v in r["in_flight"].items()]
    lines += ["", f"per GPU and micro-batch ({name}):",
              "| ac.ratio | micro-batch | activations | recompute | logits/loss | total | free | fits |",
              "|---:|---:|---:|---:|---:|---:|---:|:--:|"]
    for p in r["points"]:
        lines.append(f"| {p['ac_ratio']:g} | {p['micro_batch_size']} | {size(p['activations'])} | "
                     f"{size(p['recompute'])} | {size(p['logits_loss'])} | {size(p['total'])} | "
                     f"{size(p['free'])} ({p['free'] / r['gpu_memory']:.0%}) | {'yes' if p['fits'] else 'no'} |")
    if r["liger"]:
        lines.append("(logits/loss measured without Liger, whose fused loss cannot run on fake tensors: an upper "
                     "bound)")
    b = r["best"]
    if b:
        lines.append(f"\nleast recompute that fits: ac.ratio={b['ac_ratio']:g} train.micro_batch_size="
                     f"{b['micro_batch_size']}: {size(b['total'])} of {size(r['gpu_memory'])} {name}, "
                     f"{size(b['free'])} {name} ({b['free'] / r['gpu_memory']:.0%}) free "
                     f"(>= {r['safety']:.0%} kept free)")
    else:
        world, pc = r["smallest_world_size"], r["parallel_config"]
        lines.append(f"\ndoes not fit: no point leaves {r['safety']:.0%} of {size(r['gpu_memory'])} {name} free; "
                     + (f"the smallest world size that would fit is {world} GPUs ({world // r['nproc_per_node']} "
                        f"nodes x {r['nproc_per_node']}" + (f"; parallel.dp_shard={world // pc['dp_replicate']}"
                                                            if pc["dp_shard"] else "") + ")" if world else
                        "no world size fits: a smaller micro-batch, a higher ac.ratio or a shorter sequence"))
    return "\n".join(lines)
