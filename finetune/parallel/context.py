"""Context parallelism (parallel.cp = N), Ulysses-style: the N ranks of a cp group each hold S/N consecutive tokens
of every row; around attention an all-to-all trades that split for a split of the heads (each rank attends over the
whole row for H/N heads, with the row's packed-sample boundaries), and a second one trades back.

Why Ulysses, not ring attention: it wraps any per-sample kernel unchanged, packed rows need no per-shard masks, and
all_to_all runs on gloo (tested on CPU). N divides the attention heads; KV heads that N does not divide are repeated
up to lcm(KV heads, N) before the exchange (more bytes moved, same result).

Contract: a data rank's batch is collated and labelled on its FULL rows, padded to a multiple of N, then split
(split_batch); position_ids (RoPE) are split with the tokens, the sample boundaries (cu_seq_lens_*) stay the full rows'.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..attention import VARLEN, mixing_problem
from ..config import ConfigError
from ..data import IGNORE_INDEX
from ..loss import collate_labelled
from ..kernels.varlen import varlen_attention

CP_ATTENTION = "varlen_cp"  # its name in transformers' attention interface
SPLIT_KEYS = ("input_ids", "position_ids", "attention_mask")  # (rows, seq) entries each cp rank takes a slice of
_CP: dict = {}  # the cp process group of this process (apply_cp)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single in equal chunks of dim 0 (chunk j to rank j); the exchange is its own transpose, so its
    backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # (of a contiguous x: empty_like keeps a transposed tensor's strides)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, heads, seq/N, dim) of this rank's tokens -> (batch, heads/N, seq, dim) of this rank's heads."""
    n, (b, h, s, d) = group.size(), x.shape
    x = _AllToAll.apply(x.reshape(b, n, h // n, s, d).transpose(0, 1), group)  # [j]: rank j's tokens, my heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, seq, heads/N, dim) of this rank's heads -> (batch, seq/N, heads, dim) of this rank's tokens."""
    n, (b, s, h, d) = group.size(), x.shape
    x = _AllToAll.apply(x.reshape(b, n, s // n, h, d).transpose(0, 1), group)  # [j]: my tokens, rank j's heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


@torch.compiler.disable  # a compiled block runs the exchange eagerly (collectives in an autograd.Function)
def cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function signature: varlen_attention over the whole row for this rank's heads.
    Without boundaries (evaluation, generate: whole rows on every rank) it is varlen_attention as is."""
    if cu_seq_lens_q is None:
        return varlen_attention(module, query, key, value, attention_mask, **kwargs)
    group = _CP["group"]
    n, kv_heads = group.size(), key.shape[1]
    if kv_heads % n:  # lcm(kv_heads, n) divides the heads: each rank's query heads keep their KV heads
        key, value = (x.repeat_interleave(n // math.gcd(kv_heads, n), dim=1) for x in (key, value))
    q, k, v = (seq_to_heads(x, group) for x in (query, key, value))
    if kwargs.get("s_aux") is not None:  # attention sinks, one per head: this rank's heads'
        kwargs["s_aux"] = kwargs["s_aux"].chunk(n)[group.rank()]
    out, _ = varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu_seq_lens_q, **kwargs)
    return heads_to_seq(out, group), None


def apply_cp(model: nn.Module, layers: nn.ModuleList, group) -> None:
    """Refuse (one line) a model whose attention cannot be split, then route its attention through cp_attention
    over `group` (a plain HF module still: before kernels, AC, compile and FSDP)."""
    from transformers import AttentionInterface
    n, name = group.size(), type(model).__name__
    heads = getattr(model.config.get_text_config(), "num_attention_heads", None)
    attn = model.config._attn_implementation
    if why := mixing_problem(model, layers):
        raise ConfigError(f"parallel.cp={n}: {name} cannot be split over ranks: {why} mix tokens outside attention")
    if attn != VARLEN or not getattr(type(model), "_supports_attention_backend", False):
        raise ConfigError(f"parallel.cp={n} wraps per-sample attention (model.attn_implementation=auto or varlen, in "
                          f"a model class that passes attention kwargs); {name} has {attn}")
    if heads % n:
        raise ConfigError(f"parallel.cp={n} must divide the attention heads of {name} ({heads})")
    _CP["group"] = group
    AttentionInterface.register(CP_ATTENTION, cp_attention)
    model.config._attn_implementation = CP_ATTENTION


def cp_group(dims, device_type: str):
    """The process group of this data rank's cp ranks: "cp" of a ("dp", "cp") mesh over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    world = dims.mesh.size()
    return init_device_mesh(device_type, (world // dims.cp, dims.cp), mesh_dim_names=("dp", "cp")).get_group("cp")


def cp_rank(dims) -> int:
    """This rank's place among its data rank's cp ranks (distributed.ParallelDims: consecutive ranks)."""
    return dims.mesh.get_rank() % dims.cp


def split_batch(batch: dict, rank: int, n: int) -> dict:
    """(host) cp rank `rank`'s part of a micro-batch collated (to a width N divides) and labelled on its full rows:
    a slice of the tokens of each row, the label targets of those tokens (re-indexed into the slice; one ignored
    position when it has none, so every rank runs forward and backward), the full rows' boundaries."""
    width = batch["input_ids"].shape[1]
    s = width // n
    out = {k: v[:, rank * s:(rank + 1) * s] if k in SPLIT_KEYS else v for k, v in batch.items()}
    index, targets = batch["label_index"], batch["label_targets"]
    col = index % width - rank * s
    mine = (col >= 0) & (col < s) & (targets != IGNORE_INDEX)
    out["label_index"] = ((index // width) * s + col)[mine] if mine.any() else torch.zeros(1, dtype=torch.long)
    out["label_targets"] = targets[mine] if mine.any() else torch.full((1,), IGNORE_INDEX, dtype=targets.dtype)
    return out


def cp_width(width: int, n: int) -> int:
    """The row width a micro-batch is padded to so that N cp ranks split it evenly."""
    return -(-width // n) * n


def collate_split(items: list[dict], pad_id: int, width: int, *, rank: int, n: int) -> dict:
    """(host) cp rank `rank`'s part (split_batch) of sft's micro-batch, collated and labelled on its full rows."""
    return split_batch(collate_labelled(items, pad_id, cp_width(width, n)), rank, n)
