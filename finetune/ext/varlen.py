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
    attention within each segment of cu_seq_lens_q (varlen_kernel). Without boundaries (evaluation, generate) it is
    sdpa's causal attention with the layer's sliding window (window_mask: transformers builds no mask for an attention
    name it does not know). The CUDA kernel takes fp16/bf16 only: fp32 q/k/v are cast to bf16 and the output back."""
    if cu_seq_lens_q is None:
        if attention_mask is None and sliding_window:
            attention_mask = window_mask(query.shape[2], key.shape[2], sliding_window, query.device)
        return _VARLEN["sdpa"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    for name, value_ in (("attention logit soft-capping", softcap), ("attention sinks", s_aux),
                         ("attention dropout", dropout or None)):
        if value_ is not None:
            raise ConfigError(f"model.attn_implementation=varlen: {type(module).__name__} uses {name}, which torch's "
                              f"varlen kernel lacks; set model.attn_implementation=sdpa")
    batch, heads, seq, dim = query.shape
    dtype = query.dtype
    q, k, v = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], dim) for x in (query, key, value))
    if _VARLEN["half_only"] and dtype not in (torch.float16, torch.bfloat16):
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    window = (sliding_window - 1 if sliding_window else -1, 0)
    extra = {"window_size": window} if _VARLEN["window"] else {"is_causal": True}
    if _VARLEN["gqa"]:
        extra["enable_gqa"] = True
    # else (torch 2.10/2.11: Flash only) K/V go with their own head count: Flash's varlen kernel takes GQA directly
    # self-attention: the same offsets for keys (one tensor: cuDNN's causal varlen wants q and k to share it)
    out = _VARLEN["kernel"](q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling, **extra)
    return out.view(batch, seq, heads, dim).to(dtype), None


def window_mask(q_len: int, kv_len: int, sliding_window: int, device) -> torch.Tensor:
    """(1, 1, q_len, kv_len) bool: query i (the last q_len of kv_len positions) sees key j <= i fewer than
    sliding_window positions back, as transformers' sliding_window_causal mask."""
    i = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)
    return ((j <= i) & (i - j < sliding_window))[None, None]


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                      cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                      window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False) -> torch.Tensor:
    """varlen_attn's contract (causal: window_size (left, 0)) with one sdpa call per segment: the CPU kernel (torch's
    is CUDA-only). No mask across samples, and the causal kernel skips the upper triangle."""
    lengths, outs = cu_seq_q.diff().tolist(), []
    # split, not slices: its backward is one concatenation, a slice's a zero-filled tensor of all the tokens each
    for q, k, v in zip(*(x.transpose(0, 1).split(lengths, dim=1) for x in (query, key, value))):
        mask = None
        if 0 <= window_size[0] < q.shape[1] - 1:  # sliding window: the last window_size[0] + 1 positions
            i = torch.arange(q.shape[1], device=query.device)
            mask = (i[:, None] >= i) & (i[:, None] - i <= window_size[0])
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


