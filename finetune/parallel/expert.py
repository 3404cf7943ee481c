"""Expert parallelism (parallel.ep): the experts of each MoE layer split over the "ep" ranks along the expert dim.

Every rank keeps its own batch; a layer sends each (token, chosen expert) row to the rank that holds the expert and
the expert's output back (all-to-all both ways, gradients carried), then weighs and sums them in order as the
model's own experts forward does. torchtitan's ExpertParallel pattern: each expert tensor is a DTensor sharded on the
expert dim over "ep" (Shard(0)), which FSDP shards further over "efsdp" (the ranks holding the same experts), so the
tensors' global view is the HF one: the loader reads each rank's slice, DCP and export-hf see whole tensors.
transformers' own EP (`ep_plan`) sends every token of an EP group's one shared batch to every rank (its outputs are
all-reduced), which per-rank batches are not.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError
from ..distributed import print0
from ..kernels.moe import ExpertsView, expert_tensors, find_experts, router_recorder


class _AllToAll(torch.autograd.Function):
    """Rows `x` split by `in_splits` to the group's ranks, `out_splits` received; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def ep_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, *, forward, group, ep: int) -> torch.Tensor:
    """The experts of `module` (this rank's num_experts / ep of them) over the ep group's tokens routed to them."""
    num_tokens, top_k = top_k_index.shape
    num_local = module.num_experts // ep
    flat = top_k_index.reshape(-1)
    # sorted by expert, the rows are in the order of the ranks holding them (rank j: experts j*num_local onwards)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=module.num_experts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    sent_splits = counts.view(ep, num_local).sum(1).tolist()
    received_splits = received.view(ep, num_local).sum(1).tolist()
    rows = _AllToAll.apply(hidden_states[order // top_k], received_splits, sent_splits, group)
    # the rows come by source rank, then by local expert
    local_ids = torch.arange(num_local, device=flat.device).repeat(ep).repeat_interleave(received)
    # LoRA on the experts (adapters/expert_lora.py): its deltas on these local tensors
    tensors = expert_tensors(module)
    out = forward(ExpertsView(module, tensors, num_local), rows, local_ids[:, None],
                  torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device))
    if rows.shape[0] == 0:
        # no row came (an eager loop then uses neither the rows nor the experts): every rank's backward must still
        # run the rows' all-to-all, and the experts' gradients be zeros, not absent (FSDP reduce-scatters them)
        out = out + (rows.sum() + sum(t.sum() for t in tensors.values())) * 0
    back = _AllToAll.apply(out, sent_splits, received_splits, group)
    pairs = back[torch.argsort(order)].view(num_tokens, top_k, -1)
    return (pairs * top_k_weights[..., None]).sum(dim=1).to(hidden_states.dtype)


def apply_ep(model: nn.Module, layers, *, mesh) -> None:
    """The expert-parallel slot: each experts module's tensors become this rank's share of experts (a DTensor
    sharded over mesh["ep"] on the meta skeleton), its forward ep_forward; FSDP shards it over mesh["efsdp"]."""
    from torch.distributed.tensor import DTensor, Shard
    ep = mesh["ep"].size()
    experts = find_experts(model)
    if not experts:
        what = "is a dense model" if router_recorder(model) is None else \
            "keeps its experts as per-expert layers (only fused 3-D experts are split)"
        raise ConfigError(f"parallel.ep={ep}: {type(model).__name__} {what}; set parallel.ep=1")
    for module in experts:
        if module.num_experts % ep:
            raise ConfigError(f"parallel.ep={ep} does not divide the {module.num_experts} experts of "
                              f"{type(model).__name__}'s MoE layers")
        for name, p in list(module.named_parameters(recurse=False)):
            if p.shape[0] != module.num_experts:
                raise ConfigError(f"parallel.ep={ep}: {type(module).__name__}.{name} is not laid out by expert")
            local = torch.empty((p.shape[0] // ep, *p.shape[1:]), dtype=p.dtype, device=p.device)
            sharded = DTensor.from_local(local, mesh["ep"], [Shard(0)], run_check=False, shape=p.shape,
                                         stride=p.stride())
            setattr(module, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        module.forward = partial(ep_forward, module, forward=type(module).forward, group=mesh["ep"].get_group(),
                                 ep=ep)
        # model.apply_fsdp makes a module with `fsdp_mesh` an FSDP unit over that mesh
        module.fsdp_mesh = mesh["efsdp"]
    print0(f"moe: expert parallel over {ep} ranks ({experts[0].num_experts // ep} of {experts[0].num_experts} "
           f"experts a rank, FSDP-sharded over {mesh['efsdp'].size()})")
