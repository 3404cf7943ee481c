"""plan's model of a GPU's memory, measured on fake tensors: the run's model built and sharded over a fake process
group (fake_world, build_fake_models), the state and FSDP units it holds (measure_state), what one micro-batch keeps
for backward and the head's peak (measure_micro_batch), and a point's total (point)."""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..config import Config
from ..compat import TorchDispatchMode, fake_world_parts, fsdp_param_group, storage_key, tree_leaves


@contextmanager
def fake_world(world_size: int, dp_replicate: int = 1, dp_shard: int = 0, cp: int = 1, ep: int = 1):
    """A fake process group of world_size (this process is rank 0), its ParallelDims and the fake tensor mode."""
    import torch.distributed as dist

    from ..distributed import build_parallel_dims
    store, fake_mode = fake_world_parts()
    dist.init_process_group("fake", store=store, rank=0, world_size=world_size)
    try:
        yield build_parallel_dims("cpu", dp_replicate, dp_shard, cp, ep), fake_mode
    finally:
        dist.destroy_process_group()


def build_fake_models(hf_config, cfg: Config, mesh, fake_mode, ratios: set[float], liger: bool,
                      expert_mesh=None) -> dict:
    """{ac.ratio: model} for each of `ratios`: build_model's parallelize (the run's transforms but for the kernels,
    which cannot run on fake tensors, and compile; with Liger's FSDP layout; with `expert_mesh` expert parallel) of a
    copy of one meta skeleton built once (fully_shard is slow on fake tensors), then fake storage."""
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
    if expert_mesh is not None:
        from functools import partial

        from ..parallel.expert import apply_ep
        t.append(Transform("expert_parallel", partial(apply_ep, mesh=expert_mesh)))
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


def measure_state(model, nf4: dict | None = None, nf4_gathered: bool = True) -> dict:
    """Bytes per GPU of the sharded parameters, their gradients and AdamW state by dtype; each parameter's (rows,
    numel, bytes per element) to re-shard for another world size; the units in flight (after a forward). `nf4`:
    plan_nf4's bytes per element of the weights QLoRA holds as NF4 (on one rank FSDP leaves them alone: not
    `nf4_gathered`)."""
    state, params, nf4 = {}, [], nf4 or {}
    for p in model.parameters():
        local = p.to_local()
        tensors = [("params", local)] + [("grads", local), ("optimizer", local), ("optimizer", local)] * p.requires_grad
        for kind, t in tensors:
            key = f"{kind} {'nf4' if id(p) in nf4 else str(t.dtype).removeprefix('torch.')}"
            state[key] = state.get(key, 0) + t.numel() * nf4.get(id(p), t.element_size())
        params.append((tuple(p.shape), p.numel(), nf4.get(id(p), sum(t.element_size() for _, t in tensors))))
    from ..model import find_layers
    block_of = {id(m): i for i, layer in enumerate(find_layers(model)) for m in layer.modules()}
    held, blocks, others, unit_grads, unit_shards, unit_grad_shards = 0, {}, [0], 0, 0, 0
    for m in model.modules():
        group = fsdp_param_group(m)
        if group is None:
            continue
        for fp in group.fsdp_params:  # the dtypes FSDP's lazy init sets (the EP model runs no forward)
            if not hasattr(fp, "param_dtype"):
                fp.init_dtype_attrs(fp.mp_policy)
        fps = [(math.prod(fp._orig_size), fp.param_dtype or fp.orig_dtype, fp.reduce_dtype, fp.sharded_param)
               for fp in group.fsdp_params if nf4_gathered or id(fp.sharded_param) not in nf4]
        unit = sum(n * nf4.get(id(p), dt.itemsize) for n, dt, _, p in fps)
        unit_grads = max(unit_grads, sum(n * (dt.itemsize + (rd.itemsize if rd not in (None, dt) else 0))
                                         for n, dt, rd, p in fps if p.requires_grad))
        # this rank's shards of the unit and of its gradients (what host offload copies over for a unit)
        unit_shards = max(unit_shards, sum(p.to_local().numel() * nf4.get(id(p), p.element_size()) for *_, p in fps))
        unit_grad_shards = max(unit_grad_shards, sum(p.to_local().numel() * p.element_size()
                                                     for *_, p in fps if p.requires_grad))
        # not resharded after forward: unsharded until its backward (the root too, before its lazy init)
        if group.post_forward_mesh_info is None or m is model:
            held += unit
        elif id(m) in block_of:  # a block's units (with EP its experts' too) are in flight together
            blocks[block_of[id(m)]] = blocks.get(block_of[id(m)], 0) + unit
        else:
            others.append(unit)
    largest = sorted(blocks.values())[-2:]
    # backward gathers a block while the one before it is prefetched; the embedding's unit is gathered only at the
    # forward's start, beside the first block and before any activation: `forward_start`, not summed with those
    in_flight = {"held": held, "current+next": sum(largest), "grads+reduce": unit_grads,
                 **({"nf4 dequantized": nf4["dequantized"]} if nf4 else {})}
    return {"state": state, "params": params, "in_flight": in_flight,
            "forward_start": max(others) + max(largest, default=0),
            "unit_shards": unit_shards, "unit_grad_shards": unit_grad_shards}


def offload_state(measured: dict, on_device: tuple = ()) -> dict:
    """`measured` with parallel.cpu_offload: its state in host memory ("host") but the keys `on_device` (QLoRA's NF4
    weights on one rank, which FSDP leaves alone); in flight, the shards of the unit gathered and of the one
    prefetched, copied to the GPU for their all-gathers, and a unit's gradient shards before they go back."""
    state = measured["state"]
    copies = 2 * measured["unit_shards"] + measured["unit_grad_shards"]
    return {**measured, "state": {k: v for k, v in state.items() if k in on_device},
            "host": {k: v for k, v in state.items() if k not in on_device},
            "in_flight": {**measured["in_flight"], "offload copies": copies}}


def sharded_bytes(params: list, world_size: int) -> int:
    """Rank 0's bytes of `params` sharded over `world_size` (fully_shard's chunks: ceil(rows / world) rows each)."""
    from ..model import shard_dim

    def rows(shape):
        return shape[shard_dim(shape, world_size)] if shape else 1
    return sum(math.ceil(rows(s) / world_size) * (numel // rows(s)) * nbytes for s, numel, nbytes in params)


def measure_runs(hf_config, cfg: Config, dims, fake_mode, ratios: list[float], shapes: list[tuple[int, int]],
                 liger: bool) -> tuple[dict, dict]:
    """{(ratio, (micro-batch, tokens per rank)): measure_micro_batch} at every ratio and 0, and measure_fixed."""
    models = build_fake_models(hf_config, cfg, dims.mesh, fake_mode, {0.0, *ratios}, liger)
    with fake_mode:
        runs = {(r, (mbs, seq)): measure_micro_batch(m, mbs, seq) for r, m in models.items() for mbs, seq in shapes}
    measured = measure_fixed(hf_config, cfg, dims, fake_mode, model := models[max(models)], liger)
    if cfg.model.fp8 != "off":  # fp8's weight copies in flight and scales (the fake model itself stays unconverted)
        from ..kernels.float8 import plan_float8_bytes
        measured["in_flight"]["fp8"] = plan_float8_bytes(model, cfg.model.fp8, all_gather=cfg.model.fp8_all_gather,
                                                         param_bytes=2 if cfg.train.mixed_precision == "bf16" else 4)
    return runs, measured


def measure_fixed(hf_config, cfg: Config, dims, fake_mode, model, liger: bool) -> dict:
    """measure_state of `model` (after a forward); with parallel.ep that of the model built with EP (whose dispatch,
    data-dependent, cannot run on fake tensors: the forwards run without it), under "without_ep" the former, and the
    all-to-all buffers a token adds (its top-k rows of the hidden size sent and received); with parallel.cpu_offload
    the state in host memory (offload_state)."""
    from ..adapters.qlora import plan_nf4
    shards = dims.mesh.shape[-1]

    def state(m) -> dict:  # parallel.cpu_offload: on one rank FSDP leaves the NF4 weights on the device
        nf4 = plan_nf4(m, cfg.lora.quantize_base, shards, LivePeak)  # real tensors: outside the fake mode
        with fake_mode:
            measured = measure_state(m, nf4, nf4_gathered=shards > 1)
        return offload_state(measured, ("params nf4",) * (shards == 1)) if cfg.parallel.cpu_offload else measured
    measured = state(model)
    if dims.ep == 1:
        return measured
    ep_model = build_fake_models(hf_config, cfg, dims.mesh, fake_mode, {0.0}, liger, dims.expert_mesh)[0.0]
    text = hf_config.get_text_config()
    row_bytes = text.hidden_size * (2 if cfg.train.mixed_precision == "bf16" else 4)
    return {**state(ep_model), "without_ep": measured,
            "ep_dispatch_per_token": 2 * text.num_experts_per_tok * row_bytes}


def point(runs: dict, ratio: float, shape: tuple[int, int], measured: dict, num_layers: int) -> dict:
    """One (ratio, shape)'s bytes per GPU at its peak: backward's (the state, the units in flight, the activations,
    one checkpointed block's recompute: 1/L of the ratio-0 activations, the head's peak, EP's all-to-all buffers), or
    the forward's start."""
    run, state = runs[ratio, shape], sum(measured["state"].values())
    recompute = runs[0.0, shape]["activations"] / num_layers if ratio > 0 else 0
    dispatch = measured.get("ep_dispatch_per_token", 0) * math.prod(shape)
    backward = sum(measured["in_flight"].values()) + run["activations"] + recompute + run["logits_loss"] + dispatch
    start = measured["in_flight"]["held"] + measured["forward_start"] + measured["in_flight"].get("offload copies", 0)
    return {**run, "recompute": recompute, **({"ep_dispatch": dispatch} if dispatch else {}),
            "total": state + max(backward, start)}
