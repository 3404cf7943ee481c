"""ac.mode=op: op-level selective activation checkpointing (keep the matmul and attention outputs, recompute the
pointwise ops): `op_level`, the "ac" transform's wrap that gives each checkpointed block these checkpoint()
arguments."""
from __future__ import annotations

import inspect
from functools import partial

import torch

from ..compat import CheckpointImpl, checkpoint_wrapper


def sac_hooks_kwargs() -> dict:
    """checkpoint()'s `respect_saved_tensors_hooks` (torch 2.15: op-level AC's kept outputs go through the caller's
    saved_tensors_hooks); {} where checkpoint() lacks it (torch 2.11: it would reach the block's forward)."""
    from torch.utils.checkpoint import checkpoint
    has = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
    return {"respect_saved_tensors_hooks": True} if has else {}


def sac_attention_ops() -> set:
    """The attention ops op-level AC keeps besides sdpa's: torch's varlen kernel's (torch 2.10+) and flex's."""
    ops = set()
    try:
        import torch.nn.attention.varlen  # noqa: F401 - registers torch_attn::_varlen_attn
        ops.add(torch.ops.torch_attn._varlen_attn.default)
    except (ImportError, AttributeError):
        pass
    try:
        ops.add(torch.ops.higher_order.flex_attention)
    except AttributeError:
        pass
    return ops


def op_sac_policy():
    """Op-level selective AC: keep matmul and attention outputs, recompute the pointwise ops."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
            aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_mm.default} | sac_attention_ops()  # + varlen's and flex's ops; fp8's matmuls (as torchtitan)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE
    return partial(create_selective_checkpoint_contexts, policy)


def checkpoint_kwargs() -> dict:
    """apply_ac's checkpoint() arguments for op-level AC: op_sac_policy's contexts and sac_hooks_kwargs()."""
    return {"context_fn": op_sac_policy(), **sac_hooks_kwargs()}


def op_level():
    """The "ac" wrap of ac.mode=op: each checkpointed block checkpointed with checkpoint_kwargs instead."""
    kwargs = checkpoint_kwargs()

    def wrap(block):
        return checkpoint_wrapper(block._checkpoint_wrapped_module, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                  **kwargs)
    return wrap
