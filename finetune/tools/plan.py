"""`finetune plan`: the memory of one GPU of a run, on a CPU and without weights: the model built on fake tensors,
sharded over a fake process group of the planned world size, runs fake forwards. Per GPU: the sharded parameters,
gradients and AdamW state; FSDP's unsharded units in flight; per micro-batch and AC ratio, the bytes saved for backward
(bench's counter), the recompute of one checkpointed block and the logits/loss peak.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

from ..config import Config, ConfigError
from ..errors import one_line
from .memory_model import build_fake_models, fake_world, measure_fixed, measure_micro_batch, measure_runs, point, \
    sharded_bytes

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


def run_plan(cfg: Config, hf_config, nnodes: int, nproc: int, gpu_bytes: int, ratios: list[float],
             micro_batch_sizes: list[int]) -> dict:
    """Measure everything on fake tensors; which (ratio, micro-batch) points fit; the smallest world that would.
    With parallel.cp = N a rank holds ceil(S / N) tokens of each row (its heads' attention over the whole row after
    the all-to-all keeps as many bytes as all heads over its tokens) and FSDP shards over dp_shard x cp."""
    from ..kernels.liger import resolve_liger
    world, cp = nnodes * nproc, cfg.parallel.cp
    liger = resolve_liger(cfg.model.liger, cuda=True)  # as build_model does on the planned GPUs
    local_seq = -(-cfg.data.max_seq_len // cp)
    with fake_world(world, cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cp, cfg.parallel.ep) as (dims, fake_mode):
        runs, measured = measure_runs(hf_config, cfg, dims, fake_mode, ratios,
                                      [(mbs, local_seq) for mbs in micro_batch_sizes], liger)
    usable = gpu_bytes * (1 - SAFETY)
    points = []
    for ratio, (mbs, seq) in runs:
        if ratio in ratios:
            p = point(runs, ratio, (mbs, seq), measured, hf_config.num_hidden_layers)
            if "without_ep" in measured:  # the same point with FSDP alone: every expert of a block all-gathered
                p["total_without_ep"] = point(runs, ratio, (mbs, seq), measured["without_ep"],
                                              hf_config.num_hidden_layers)["total"]
            points.append({"ac_ratio": ratio, "micro_batch_size": mbs, **p, "free": gpu_bytes - p["total"],
                           "fits": p["total"] <= usable})
    fits = [p for p in points if p["fits"]]
    best = min(fits, key=lambda p: (p["ac_ratio"], -p["micro_batch_size"])) if fits else None
    smallest, replicas = None, cfg.parallel.dp_replicate
    # more GPUs shrink only the sharded state (a set dp_shard grows with them), to one row a GPU at most; offloaded,
    # that state is in host memory
    if not fits and "host" not in measured:
        least = min(p["total"] for p in points) - sum(measured["state"].values())
        floor = least + sum(numel // max(s, default=1) * nbytes for s, numel, nbytes in measured["params"])
        smallest = None if floor > usable else next((w for w in range(world + nproc, 2**16, nproc) if w % replicas == 0
                                                     and sharded_bytes(measured["params"], w // replicas) + least
                                                     <= usable), None)
    return {**describe(cfg, hf_config, nnodes, nproc, gpu_bytes, dims, liger, measured), "points": points,
            "best": best, "smallest_world_size": smallest}


def describe(cfg: Config, hf_config, nnodes: int, nproc: int, gpu_bytes: int, dims, liger: bool, measured) -> dict:
    """What a plan is of (the header of its table)."""
    return {"model": cfg.model.path, "num_params": sum(n for _, n, _ in measured["params"]), "nnodes": nnodes,
            "nproc_per_node": nproc, "world_size": nnodes * nproc, "parallel": str(dims), "ep": dims.ep,
            "parallel_config": asdict(cfg.parallel), "gpu_memory": gpu_bytes, "safety": SAFETY,
            "seq_len": cfg.data.max_seq_len, "mixed_precision": cfg.train.mixed_precision, "ac_mode": cfg.ac.mode,
            "ac_offload": cfg.ac.offload, "liger": liger, "state": measured["state"],
            "in_flight": measured["in_flight"], "forward_start": measured["forward_start"],
            **({"host": measured["host"]} if "host" in measured else {})}


MAX_LOCAL_TOKENS = 2**22  # tokens per rank where the --max-seq-len search stops doubling (4M: beyond any model's)


def run_seq_search(cfg: Config, hf_config, nnodes: int, nproc: int, gpu_bytes: int, ratios: list[float]) -> dict:
    """`plan --max-seq-len`: the longest data.max_seq_len that fits at micro-batch 1, for each ac.ratio and cp degree
    (within a node, dividing the heads). A rank's bytes depend on its S / cp tokens only: measured, never extrapolated
    (fake forwards from 1024 tokens per rank, doubled while they fit, then bisected to a multiple of 1024)."""
    from ..kernels.liger import resolve_liger
    world, unit = nnodes * nproc, 1024
    heads = hf_config.get_text_config().num_attention_heads
    cps = [c for c in (1, 2, 4, 8, 16, 32, 64) if nproc % c == 0 and heads % c == 0]
    liger = resolve_liger(cfg.model.liger, cuda=True)
    usable, num_layers = gpu_bytes * (1 - SAFETY), hf_config.num_hidden_layers
    with fake_world(world, cfg.parallel.dp_replicate, ep=cfg.parallel.ep) as (dims, fake_mode):
        models = build_fake_models(hf_config, cfg, dims.mesh, fake_mode, {0.0, *ratios}, liger)
        runs, sizes = {}, {r: {} for r in ratios}  # sizes: what each ratio measured, {tokens per rank: bytes}

        def total(ratio: float, tokens: int) -> float:  # measured bytes per GPU, `tokens` per rank
            for r in {0.0, ratio}:  # ratio 0's activations give the recompute of one checkpointed block
                if (r, (1, tokens)) not in runs:
                    with fake_mode:
                        runs[r, (1, tokens)] = measure_micro_batch(models[r], 1, tokens)
            sizes[ratio][tokens] = point(runs, ratio, (1, tokens), measured, num_layers)["total"]
            return sizes[ratio][tokens]

        with fake_mode:  # the state and the units in flight (after a forward: FSDP's lazy init decides resharding)
            runs[0.0, (1, unit)] = measure_micro_batch(models[0.0], 1, unit)
        measured = measure_fixed(hf_config, cfg, dims, fake_mode, models[0.0], liger)
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
    if "host" in r:
        lines.append(f"(parallel.cpu_offload: {sum(r['host'].values()) / GIB:.1f} GiB of pinned host memory a GPU, "
                     f"not counted)")
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
    lines.append(f"  {'or at the forward start':<24} {size(r['forward_start']):>8}  (embedding and first block "
                 f"gathered, no activation yet: in place of the above and what follows, where larger)")
    if "host" in r:  # parallel.cpu_offload
        host = sum(r["host"].values())
        lines += ["", f"in pinned host memory, per GPU ({name}; parallel.cpu_offload, not in the totals: "
                      f"{size(host * r['nproc_per_node'])} {name} a node):"]
        lines += [f"  {k:<24} {size(v):>8}" for k, v in r["host"].items()]
    lines += ["", f"per GPU and micro-batch ({name}):",
              "| ac.ratio | micro-batch | activations | recompute | logits/loss | total | free | fits |",
              "|---:|---:|---:|---:|---:|---:|---:|:--:|"]
    for p in r["points"]:
        lines.append(f"| {p['ac_ratio']:g} | {p['micro_batch_size']} | {size(p['activations'])} | "
                     f"{size(p['recompute'])} | {size(p['logits_loss'])} | {size(p['total'])} | "
                     f"{size(p['free'])} ({p['free'] / r['gpu_memory']:.0%}) | {'yes' if p['fits'] else 'no'} |")
    if dispatch := [p for p in r["points"] if "ep_dispatch" in p]:
        lines.append(f"(totals include EP's all-to-all buffers: {size(dispatch[0]['ep_dispatch'])} {name} at "
                     f"micro-batch {dispatch[0]['micro_batch_size']}, each token's top-k rows sent and received)")
    if r["liger"]:
        lines.append("(logits/loss measured without Liger, whose fused loss cannot run on fake tensors: an upper "
                     "bound)")
    b = r["best"]
    if b:
        lines.append(f"\nleast recompute that fits: ac.ratio={b['ac_ratio']:g} train.micro_batch_size="
                     f"{b['micro_batch_size']}: {size(b['total'])} of {size(r['gpu_memory'])} {name}, "
                     f"{size(b['free'])} {name} ({b['free'] / r['gpu_memory']:.0%}) free "
                     f"(>= {r['safety']:.0%} kept free)")
        if r["ep"] > 1:  # the same point with FSDP alone: does EP decide the fit?
            alone, usable = b["total_without_ep"], r["gpu_memory"] * (1 - r["safety"])
            lines.append(f"parallel.ep={r['ep']} is what makes it fit: FSDP alone (a block's experts all-gathered "
                         f"whole) needs {size(alone)} {name} there" if alone > usable else
                         f"FSDP alone (parallel.ep=1) fits this point too: {size(alone)} {name}")
    else:
        world, pc = r["smallest_world_size"], r["parallel_config"]
        lines.append(f"\ndoes not fit: no point leaves {r['safety']:.0%} of {size(r['gpu_memory'])} {name} free; "
                     + (f"the smallest world size that would fit is {world} GPUs ({world // r['nproc_per_node']} "
                        f"nodes x {r['nproc_per_node']}" + (f"; parallel.dp_shard={world // pc['dp_replicate']}"
                                                            if pc["dp_shard"] else "") + ")" if world else
                        "no world size fits: a smaller micro-batch, a higher ac.ratio or a shorter sequence"
                        + ("" if "host" in r else ", or parallel.cpu_offload=true")))
    return "\n".join(lines)
