"""Packed samples kept apart in the layers that mix tokens outside attention (linear attention, state space, sequence
convolutions): `apply_sample_boundaries` runs each such module once per packed sample, from a fresh state, and hands
it an unpacked batch without the boundaries (transformers' torch fallbacks refuse any, as if the rows were packed)."""
from __future__ import annotations

import inspect
from functools import partial

import torch
from torch import nn

from ..attention import ATTENTION_LAYER_TYPES

BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def find_mixers(layer: nn.Module, kind: str | None) -> list[nn.Module]:
    """The children of decoder block `layer` that carry a state along the sequence: a Conv1d inside, a `cache_params`
    argument (recurrent and conv states), or, in a layer of a non-attention `kind`, any child taking attention_mask."""
    mixers = []
    for child in layer.children():
        params = inspect.signature(child.forward).parameters
        if any(isinstance(m, nn.Conv1d) for m in child.modules()) or "cache_params" in params or (
                kind is not None and kind not in ATTENTION_LAYER_TYPES and "attention_mask" in params):
            mixers.append(child)
    return mixers


def apply_sample_boundaries(model: nn.Module, layers: nn.ModuleList) -> None:
    """Wrap each layer's mixers (find_mixers) to run per packed sample; sets `model.keeps_samples_apart` when every
    token-mixing part that check_packing would refuse (its layer type, a Conv1d, no attention heads) is wrapped."""
    config = model.config.get_text_config()
    kinds = list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])
    heads = bool(getattr(config, "num_attention_heads", None))
    lengths: dict = {}  # the packed micro-batch's sample lengths (None: unpacked, or no boundaries), set per forward
    covered, wrapped = len(kinds) in (0, len(layers)), 0
    for i, layer in enumerate(layers):
        kind = kinds[i] if kinds and len(kinds) == len(layers) else None
        mixers = find_mixers(layer, kind)
        for mixer in mixers:
            mixer.forward = partial(per_sample_forward, mixer.forward, lengths)
        inside = {id(m) for mixer in mixers for m in mixer.modules()}
        convs = [m for m in layer.modules() if isinstance(m, nn.Conv1d)]
        needed = (kind is not None and kind not in ATTENTION_LAYER_TYPES) or convs or not heads
        covered = covered and (not needed or (mixers and all(id(m) in inside for m in convs)))
        wrapped += len(mixers)
    if wrapped:
        model.register_forward_pre_hook(partial(record_lengths, lengths=lengths), with_kwargs=True)
    model.keeps_samples_apart = bool(wrapped and covered)


def record_lengths(module: nn.Module, args, kwargs: dict, *, lengths: dict) -> None:
    """Before the model's forward: the lengths of the flattened tokens' segments (each row's samples, then its
    padding) when the batch is packed (boundaries and no attention_mask: pad_collate), read to the host once."""
    cu = kwargs.get("cu_seq_lens_q")
    lengths["packed"] = cu.diff().tolist() if cu is not None and kwargs.get("attention_mask") is None else None


@torch.compiler.disable
def per_sample_forward(forward, lengths: dict, *args, **kwargs):
    """`forward` without the boundary kwargs: on the whole batch when it is not packed, else once per segment.
    Compiled blocks run it eagerly: reading the lengths, they would compile again for each micro-batch."""
    for key in BOUNDARY_KEYS:
        kwargs.pop(key, None)
    if "hidden_states" in kwargs:
        hidden = kwargs.pop("hidden_states")
    else:
        hidden, args = args[0], args[1:]
    if lengths.get("packed") is None or kwargs.get("cache_params") is not None:
        return forward(hidden, *args, **kwargs)
    return split_forward(forward, lengths["packed"], hidden, *args, **kwargs)


def split_forward(forward, segments: list[int], hidden: torch.Tensor, *args, **kwargs):
    """forward on each segment of the flattened (batch x seq) tokens as a batch of one, outputs concatenated back
    (arguments shaped like the tokens are split alike, a 4-D mask into its blocks)."""
    batch, seq = hidden.shape[:2]
    pieces = {k: split_tokens(v, batch, seq, segments) for k, v in kwargs.items()}
    if "attention_mask" in kwargs:
        pieces["attention_mask"] = split_mask(kwargs["attention_mask"], seq, segments)
    arg_pieces = [split_tokens(v, batch, seq, segments) for v in args]
    outs = []
    # split, not slices: its backward is one concatenation, a slice's a zero-filled tensor of all the tokens each
    for i, h in enumerate(hidden.flatten(0, 1).split(segments)):
        piece = {k: v if split is None else split[i] for (k, v), split in zip(kwargs.items(), pieces.values())}
        outs.append(forward(h[None], *(v if split is None else split[i] for v, split in zip(args, arg_pieces)),
                            **piece))
    first = outs[0]
    if isinstance(first, tuple):  # (output, attention weights or state): the weights are per piece, not kept
        joined = torch.cat([o[0] for o in outs], dim=1).view(batch, seq, *first[0].shape[2:])
        return (joined, *(None,) * (len(first) - 1))
    return torch.cat(outs, dim=1).view(batch, seq, *first.shape[2:])


def split_mask(mask, seq: int, segments: list[int]) -> list:
    """Each segment's own block of a (batch, 1, seq, seq) mask (the packed rows' block-diagonal one: per sample, the
    causal mask), else None for each (no mask, or a padding mask: packed rows have none)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return [None] * len(segments)
    starts = torch.tensor([0, *segments]).cumsum(0).tolist()
    return [mask[a // seq, None, :, a % seq:a % seq + n, a % seq:a % seq + n] for a, n in zip(starts, segments)]


def split_tokens(value, batch: int, seq: int, segments: list[int]):
    """`value` split into the segments' pieces (each with a batch dim of 1) when it is shaped (batch, seq, ...) or a
    tuple or dict of such (rotary cos/sin; DeepSeek-V4's per rope type), else None: passed whole."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, seq):
        return [p[None] for p in value.flatten(0, 1).split(segments)]
    if isinstance(value, tuple) and value and all(split_tokens(v, batch, seq, segments) for v in value):
        return list(zip(*(split_tokens(v, batch, seq, segments) for v in value)))
    if isinstance(value, dict) and value and all(split_tokens(v, batch, seq, segments) for v in value.values()):
        splits = {k: split_tokens(v, batch, seq, segments) for k, v in value.items()}
        return [{k: v[i] for k, v in splits.items()} for i in range(len(segments))]
    return None
