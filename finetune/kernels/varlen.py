"""torch's varlen attention as transformers' `varlen` attention function: causal attention within each packed
sample, from the boundaries the collate computes (attention module docstring), on CUDA through torch's kernel, on CPU
one sdpa call per sample. Registered by `register`, which the model transforms' varlen slot calls when
model.attn_implementation resolves to varlen."""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ..attention import VARLEN
from ..config import ConfigError

_VARLEN: dict = {}  # what register() found: the kernel, its keyword arguments, sdpa for calls without boundaries


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None, s_aux=None,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None, **kwargs):
    """transformers' attention-function signature ((batch, heads, seq, dim) in, (batch, seq, heads, dim) out): causal
    attention within each segment of cu_seq_lens_q (varlen_kernel); a chunked layer's segments are cut into its
    chunks. Without boundaries (evaluation, generate) it is sdpa's causal attention with the layer's sliding window
    or chunks (window_mask: transformers builds no mask for an attention name it does not know). The CUDA kernel
    takes fp16/bf16 only: fp32 q/k/v are cast to bf16 and the output back. Attention sinks (s_aux) run one sdpa call
    per segment with a sink key (sink_attention), on every device: torch's kernel has none. A value head dim other
    than the query/key one (MLA) reaches the CUDA kernel zero-padded to it."""
    chunk = chunk_size(module)
    if cu_seq_lens_q is None and (s_aux is not None or chunk):
        mask = window_mask(query.shape[2], key.shape[2], sliding_window or key.shape[2], query.device, chunk)
        if attention_mask is not None:
            mask = mask & (attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0)
        if s_aux is not None:
            return sink_attention(query, key, value, s_aux, scaling, mask).transpose(1, 2), None
        attention_mask = mask
    if cu_seq_lens_q is None:
        if attention_mask is None and sliding_window:
            attention_mask = window_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        return _VARLEN["sdpa"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    for name, value_ in (("attention logit soft-capping", softcap), ("attention dropout", dropout or None)):
        if value_ is not None:
            raise ConfigError(f"model.attn_implementation=varlen: {type(module).__name__} uses {name}, which torch's "
                              f"varlen kernel lacks; set model.attn_implementation=sdpa")
    if chunk:
        cu_seq_lens_q, max_length_q = chunked(cu_seq_lens_q, chunk), min(max_length_q, chunk)
    batch, heads, seq, dim = query.shape
    dtype, v_dim = query.dtype, value.shape[-1]
    q, k, v = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[-1]) for x in (query, key, value))
    window = (sliding_window - 1 if sliding_window else -1, 0)
    if s_aux is not None:
        out = segment_attention(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                                window_size=window, enable_gqa=True, sinks=s_aux)
        return out.view(batch, seq, heads, v_dim), None
    if _VARLEN["half_only"] and dtype not in (torch.float16, torch.bfloat16):
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    if _VARLEN["half_only"] and v_dim != dim:
        scaling = dim ** -0.5 if scaling is None else scaling
        q, k, v = (torch.nn.functional.pad(x, (0, max(dim, v_dim) - x.shape[-1])) for x in (q, k, v))
    extra = {"window_size": window} if _VARLEN["window"] else {"is_causal": True}
    if _VARLEN["gqa"]:
        extra["enable_gqa"] = True
    # else (torch 2.10/2.11: Flash only) K/V go with their own head count: Flash's varlen kernel takes GQA directly
    # self-attention: the same offsets for keys (one tensor: cuDNN's causal varlen wants q and k to share it)
    out = _VARLEN["kernel"](q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **extra)
    return out[..., :v_dim].reshape(batch, seq, heads, v_dim).to(dtype), None


def chunk_size(module: nn.Module) -> int | None:
    """The chunk of a chunked-attention layer (config.layer_types, Llama 4: queries see keys of their own chunk of
    attention_chunk_size positions), else None."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    kinds = getattr(config, "layer_types", None)
    if kinds and index is not None and kinds[index] == "chunked_attention":
        return getattr(config, "attention_chunk_size", None)
    return None


def chunked(cu_seq: torch.Tensor, chunk: int) -> torch.Tensor:
    """The segments of cu_seq cut every `chunk` positions from each one's start (a chunked layer's causal attention
    within a sample is causal attention within each of its chunks)."""
    bounds = cu_seq.tolist()
    cuts = sorted({*bounds, *(p for a, b in zip(bounds, bounds[1:]) for p in range(a + chunk, b, chunk))})
    return torch.tensor(cuts, dtype=cu_seq.dtype, device=cu_seq.device)


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor,
                   scale: float | None, mask: torch.Tensor) -> torch.Tensor:
    """sdpa with attention sinks, (batch, heads, q, dim) -> (batch, heads, q, v_dim): each head's softmax also counts
    exp(sink), as one more key that every query sees (a first key column in `mask`) whose score is the sink (an extra
    query coordinate of 1 against a key coordinate sink / scale) and whose value is zero. Its gradient reaches
    `sinks` through that key."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    batch, heads = query.shape[:2]
    key, value = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (key, value))
    ones = query.new_ones(*query.shape[:-1], 1)
    sink_key = torch.cat([key.new_zeros(batch, heads, 1, key.shape[-1]),
                          (sinks.to(key.dtype) / scale).view(1, heads, 1, 1).expand(batch, -1, -1, -1)], dim=-1)
    keys = torch.cat([sink_key, torch.cat([key, key.new_zeros(*key.shape[:-1], 1)], dim=-1)], dim=2)
    values = torch.cat([value.new_zeros(batch, heads, 1, value.shape[-1]), value], dim=2)
    mask = torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(torch.cat([query, ones], dim=-1), keys, values,
                                                            attn_mask=mask, scale=scale)


def window_mask(q_len: int, kv_len: int, sliding_window: int, device, chunk: int | None = None) -> torch.Tensor:
    """(1, 1, q_len, kv_len) bool: query i (the last q_len of kv_len positions) sees key j <= i fewer than
    sliding_window positions back (and in its `chunk`), as transformers' sliding_window (chunked) causal mask."""
    i = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)
    keep = (j <= i) & (i - j < sliding_window)
    return (keep & (i // chunk == j // chunk) if chunk else keep)[None, None]


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                      cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                      window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """varlen_attn's contract (causal: window_size (left, 0)) with one sdpa call per segment: the CPU kernel (torch's
    is CUDA-only), and with `sinks` (per query head) sink_attention's on every device. No mask across samples, and
    the causal kernel skips the upper triangle."""
    lengths, outs = cu_seq_q.diff().tolist(), []
    # split, not slices: its backward is one concatenation, a slice's a zero-filled tensor of all the tokens each
    for q, k, v in zip(*(x.transpose(0, 1).split(lengths, dim=1) for x in (query, key, value))):
        mask = None
        if 0 <= window_size[0] < q.shape[1] - 1:  # sliding window: the last window_size[0] + 1 positions
            i = torch.arange(q.shape[1], device=query.device)
            mask = (i[:, None] >= i) & (i[:, None] - i <= window_size[0])
        if sinks is not None:
            span = window_size[0] + 1 if window_size[0] >= 0 else q.shape[1]
            band = window_mask(q.shape[1], q.shape[1], span, query.device)
            outs.append(sink_attention(q[None], k[None], v[None], sinks, scale, band)[0])
            continue
        outs.append(torch.nn.functional.scaled_dot_product_attention(  # 4-D: torch < 2.15 runs 3-D in its math path
            q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa)[0])
    return torch.cat(outs, dim=1).transpose(0, 1)


def varlen_kernel():
    """torch's varlen attention on CUDA (torch >= 2.10; imported on first use: its module imports torch._dynamo;
    it runs Flash, or cuDNN where torch 2.12+ prefers it), segment_attention elsewhere."""
    if not torch.cuda.is_available():
        return segment_attention
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


def register() -> None:
    """Register `varlen` in transformers' attention interface with what this torch's kernel takes (2.10: is_causal;
    later: a window, (-1, 0) being causal; 2.12+: enable_gqa; CUDA: fp16/bf16 only), found once, outside compile."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    kernel = varlen_kernel()
    params = inspect.signature(kernel).parameters
    _VARLEN.update(kernel=kernel, window="window_size" in params, gqa="enable_gqa" in params,
                   half_only=kernel is not segment_attention, sdpa=sdpa_attention_forward)
    AttentionInterface.register(VARLEN, varlen_attention)


