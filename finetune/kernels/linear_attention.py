"""Packed samples kept apart in the layers that mix tokens outside attention (linear attention, state space, sequence
convolutions): `apply_sample_boundaries` runs each such module once per packed sample, from a fresh state, and hands
it an unpacked batch without the boundaries (transformers' torch fallbacks refuse any, as if the rows were packed);
where flash-linear-attention and causal-conv1d are installed (CUDA), a module whose packed path gives its per-sample
outputs on the first packed batch gets the boundaries instead (`cu_seq_lens_q`, `seq_idx`: one flattened row)."""
from __future__ import annotations

import inspect
from functools import partial

import torch
from torch import nn

from ..attention import ATTENTION_LAYER_TYPES
from ..errors import one_line
from ..distributed import print0

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
    """Wrap each layer's mixers (find_mixers) to run per packed sample (or, with the kernels, on the packed row with
    its boundaries where that is exact: `routes`, check_route); sets `model.keeps_samples_apart` when every
    token-mixing part that check_packing would refuse (its layer type, a Conv1d, no attention heads) is wrapped."""
    config = model.config.get_text_config()
    kinds = list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])
    heads = bool(getattr(config, "num_attention_heads", None))
    lengths: dict = {}  # the packed micro-batch's sample lengths (None: unpacked, or no boundaries), set per forward
    fast = packed_kernels()
    covered, wrapped = len(kinds) in (0, len(layers)), 0
    for i, layer in enumerate(layers):
        kind = kinds[i] if kinds and len(kinds) == len(layers) else None
        mixers = find_mixers(layer, kind)
        for mixer in mixers:
            mixer.forward = partial(per_sample_forward, mixer.forward, lengths, {} if fast and routes(mixer) else None)
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
    packed = cu is not None and kwargs.get("attention_mask") is None
    lengths["packed"], lengths["cu"] = (cu.diff().tolist(), cu) if packed else (None, None)


def packed_kernels() -> bool:
    """Whether transformers runs linear attention and its convolutions with flash-linear-attention and causal-conv1d
    (both installed, CUDA), whose kernels take packed boundaries; its torch fallbacks take none."""
    from transformers.utils.import_utils import is_causal_conv1d_available, is_flash_linear_attention_available
    return is_flash_linear_attention_available() and is_causal_conv1d_available()


def routes(mixer: nn.Module) -> bool:
    """Whether `mixer` may hand packed boundaries to the kernels: it passes on keyword arguments it does not name (as
    transformers' linear-attention modules hand theirs to fla and causal-conv1d) and has a convolution (a
    causal-conv1d user, not an attention module)."""
    params = inspect.signature(mixer.forward).parameters.values()
    return any(p.kind is p.VAR_KEYWORD for p in params) and any(isinstance(m, nn.Conv1d) for m in mixer.modules())


@torch.compiler.disable
def per_sample_forward(forward, lengths: dict, route: dict | None, *args, **kwargs):
    """`forward` without the boundary kwargs: on the whole batch when it is not packed, else once per segment, or
    with the boundaries on one flattened row where `route` (None: no kernels) says that is exact (decided on the
    first packed batch). Compiled blocks run it eagerly: reading the lengths, they would compile again for each
    micro-batch."""
    for key in BOUNDARY_KEYS:
        kwargs.pop(key, None)
    if "hidden_states" in kwargs:
        hidden = kwargs.pop("hidden_states")
    else:
        hidden, args = args[0], args[1:]
    if lengths.get("packed") is None or kwargs.get("cache_params") is not None:
        return forward(hidden, *args, **kwargs)
    if route is not None and not isinstance(kwargs.get("attention_mask"), torch.Tensor):
        if "exact" not in route:
            route["exact"] = check_route(forward, lengths, hidden, *args, **kwargs)
        if route["exact"]:
            return flat_forward(forward, lengths["cu"], hidden, *args, **kwargs)
    return split_forward(forward, lengths["packed"], hidden, *args, **kwargs)


@torch.no_grad()
def check_route(forward, lengths: dict, hidden: torch.Tensor, *args, **kwargs) -> bool:
    """Whether `forward` given the boundaries gives its per-sample outputs (to the dtype's rounding) on this batch: a
    module that reads them but leaves one token-mixing step blind to them would mix samples in silence; a torch
    fallback refuses them (ValueError), a kernel may reject what it is given (RuntimeError, TypeError): then the exact
    per-sample path. Says which path the layers take, once for each."""
    why = "their packed path differs from it"
    try:
        fast = flat_forward(forward, lengths["cu"], hidden, *args, **kwargs)
    except (ValueError, RuntimeError, TypeError) as e:
        fast, why = None, f"their packed path raised {one_line(e)}"
    slow = split_forward(forward, lengths["packed"], hidden, *args, **kwargs)
    fast, slow = (o[0] if isinstance(o, tuple) else o for o in (fast, slow))
    tol = 1e-4 if slow.dtype == torch.float32 else 2e-2
    exact = fast is not None and bool(((fast - slow).abs() <= tol * (1 + slow.abs())).all())
    said = lengths.setdefault("said", set())
    if exact not in said:
        said.add(exact)
        how = "get the packed boundaries (fla/causal-conv1d)" if exact else f"run per packed sample ({why})"
        print0(f"kernels: linear-attention layers {how}")
    return exact


def flat_forward(forward, cu: torch.Tensor, hidden: torch.Tensor, *args, **kwargs):
    """forward on the (batch x seq) tokens as one row with the boundaries: `cu_seq_lens_q` (transformers hands it to
    flash-linear-attention as cu_seqlens) and `seq_idx`, each token's segment (causal-conv1d's)."""
    batch, seq = hidden.shape[:2]
    cu = cu.to(hidden.device)
    # output_size: no device-to-host sync for each layer
    seq_idx = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device, dtype=torch.int32), cu.diff(),
                                      output_size=batch * seq)
    flat = [flatten_tokens(v, batch, seq) for v in (hidden, *args)]
    out = forward(*flat, **{k: flatten_tokens(v, batch, seq) for k, v in kwargs.items()}, cu_seq_lens_q=cu,
                  seq_idx=seq_idx[None])
    if isinstance(out, tuple):
        return (out[0].view(batch, seq, *out[0].shape[2:]), *(None,) * (len(out) - 1))
    return out.view(batch, seq, *out.shape[2:])


def flatten_tokens(value, batch: int, seq: int):
    """`value` shaped (batch, seq, ...) as (1, batch * seq, ...), tuples and dicts of such alike; else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, seq):
        return value.reshape(1, batch * seq, *value.shape[2:])
    if isinstance(value, tuple):
        return tuple(flatten_tokens(v, batch, seq) for v in value)
    if isinstance(value, dict):
        return {k: flatten_tokens(v, batch, seq) for k, v in value.items()}
    return value


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
