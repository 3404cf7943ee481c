"""Per-sample attention for packed rows: which attention implementation runs, torch's varlen kernel registered in
transformers' attention interface, and the refusals for what cannot keep packed samples apart.

Contract. The collate (data.collate.pad_collate) hands every micro-batch its sample boundaries, computed once on the
host: `cu_seq_lens_q` = `cu_seq_lens_k` (int32, the cumulative lengths of the segments of the flattened
batch x seq tokens: each row's samples, then its padding as one segment) and `max_length_q` = `max_length_k` (the
longest segment, a Python int). The model is called with them as keyword arguments; transformers passes attention
kwargs through its decoder layers to the attention function (models with `_supports_attention_backend`). There:
  varlen             (ours) torch.nn.attention.varlen.varlen_attn over the flattened tokens, per segment (CUDA;
                     on CPU one sdpa call per segment);
  flash_attention_2/3  transformers' flash path: with these kwargs it runs flash-attn's varlen kernel per segment
                     at any micro-batch size (without them it infers boundaries only for ONE row);
  sdpa, eager, flex_attention  ignore the kwargs: transformers builds a block-diagonal mask from the position_ids
                     restarts (dense B x 1 x S x S for sdpa/eager; flex's block mask skips the blocks).
Nothing is inferred inside the model and nothing is read back to the host per layer. Context parallelism
(finetune.context) wraps varlen with these same kwargs.
"""
from __future__ import annotations

import importlib.util
import inspect

import torch
from torch import nn

from .config import ConfigError
from .distributed import print0

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "dense", "sparse",
                         "moe", "mlp"}  # layer types (config.layer_types) whose tokens mix only through attention
VARLEN = "varlen"


_VARLEN: dict = {}  # what register() found: the kernel, its keyword arguments, sdpa for calls without boundaries


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None, s_aux=None,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None, **kwargs):
    """transformers' attention-function signature ((batch, heads, seq, dim) in, (batch, seq, heads, dim) out): causal
    attention within each segment of cu_seq_lens_q through torch's varlen kernel on CUDA (Flash, or cuDNN where
    torch prefers it), segment_attention elsewhere. Without boundaries (evaluation, generate: one unpadded sample
    per row) it is sdpa's causal attention, with the layer's sliding window (transformers builds no mask for an
    attention name it does not know: window_mask). The CUDA kernel takes fp16/bf16 only: fp32 q/k/v (train.
    mixed_precision=fp32, or autocast) are cast to bf16 and the output back, as transformers' flash path does."""
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
    """(1, 1, q_len, kv_len) bool: query i (the last q_len of kv_len positions: a KV cache holds the keys before it)
    sees key j when j <= i's position and fewer than sliding_window positions back, as transformers'
    sliding_window_causal mask."""
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
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa))
    return torch.cat(outs, dim=1).transpose(0, 1)


def varlen_kernel():
    """torch's varlen attention on CUDA (torch >= 2.10; imported on first use: its module imports torch._dynamo;
    it runs Flash, or cuDNN where torch 2.12+ prefers it), segment_attention elsewhere."""
    if not torch.cuda.is_available():
        return segment_attention
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


def register() -> None:
    """Register `varlen` in transformers' attention interface, with what this torch's kernel takes (2.10: is_causal;
    later: a window, (-1, 0) being causal; 2.12+: enable_gqa; CUDA: fp16/bf16 only), found once, outside any
    compiled region."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    kernel = varlen_kernel()
    params = inspect.signature(kernel).parameters
    _VARLEN.update(kernel=kernel, window="window_size" in params, gqa="enable_gqa" in params,
                   half_only=kernel is not segment_attention, sdpa=sdpa_attention_forward)
    AttentionInterface.register(VARLEN, varlen_attention)


def resolve_attn_implementation(hf_config, requested: str | None) -> str:
    """The implementation to build: `auto` is varlen for a model class whose layers pass attention kwargs
    (transformers' _supports_attention_backend) and whose attention has no logit soft-capping, else sdpa; sdpa is
    eager for a model class without an sdpa path (Gemma2: transformers would refuse to build it); flash needs CUDA
    and flash-attn's package."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)  # None: remote code, not in the auto mapping
    if requested == "auto":
        varlen_ok = getattr(cls, "_supports_attention_backend", False) and not getattr(
            hf_config.get_text_config(), "attn_logit_softcapping", None)
        requested = VARLEN if varlen_ok else None
    package = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(requested)
    if package and (not torch.cuda.is_available() or importlib.util.find_spec(package) is None):
        raise ConfigError(f"model.attn_implementation={requested} needs a CUDA device and the {package} package "
                          f"(uv sync --extra gpu); use sdpa otherwise")
    if requested == VARLEN:
        register()
    if requested not in (None, "sdpa"):
        return requested
    if not getattr(cls, "_supports_sdpa", True):
        if requested is not None:
            print0(f"{cls.__name__} has no sdpa attention in transformers; using eager (set model.attn_implementation)")
        return "eager"
    return "sdpa"


def check_trainable(attn_implementation: str, device_type: str) -> None:
    """Refuse, in one line, an attention that cannot train on this device: flex_attention has no CPU backward
    (torch raises at the first backward, on every rank)."""
    if attn_implementation == "flex_attention" and device_type != "cuda":
        raise ConfigError(f"model.attn_implementation=flex_attention cannot train on {device_type}: torch's "
                          f"FlexAttention has no backward there; use sdpa (or auto) on {device_type}")


def mixing_problem(model: nn.Module, layers: nn.ModuleList) -> str | None:
    """Why tokens of `model` mix other than through attention (None when they do not): layers that are not attention
    (state-space, linear-attention, convolution), found from the config's layer types, a Conv1d in the decoder
    blocks, or a config without attention heads."""
    config = model.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])
    odd = sorted(kinds - ATTENTION_LAYER_TYPES)
    conv = next((f"{type(m).__name__} in {type(layer).__name__}" for layer in layers for m in layer.modules()
                 if isinstance(m, nn.Conv1d)), None)
    return (f"its {odd[0]} layers" if odd else f"its sequence convolutions ({conv})" if conv else
            "its layers (no attention heads)" if not getattr(config, "num_attention_heads", None) else None)


def check_packing(model: nn.Module, layers: nn.ModuleList, attn_implementation: str) -> None:
    """Refuse, in one line, a packed run whose attention cannot keep the samples of a row apart: layers that mix
    tokens other than through attention (mixing_problem: they ignore position_ids restarts); or a kernel that
    takes the boundaries as kwargs (flash, varlen) in a model class that does not pass attention kwargs on."""
    if why := mixing_problem(model, layers):
        raise ConfigError(f"{type(model).__name__} cannot keep packed samples apart: {why} ignore position_ids "
                          f"restarts; set data.packing=false")
    if attn_implementation.startswith("flash") or attn_implementation == VARLEN:
        if not getattr(type(model), "_supports_attention_backend", False):
            raise ConfigError(f"model.attn_implementation={attn_implementation} gets packed-sample boundaries as "
                              f"attention kwargs, which {type(model).__name__}'s layers do not pass on: use sdpa "
                              f"or set data.packing=false")
