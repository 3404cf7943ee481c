"""Which attention implementation runs, and the refusals for what cannot keep packed samples apart (varlen and flash
take the sample boundaries as kwargs; the others get a block-diagonal mask from the position_ids restarts)."""
from __future__ import annotations

import importlib.util
from typing import Callable

import torch
from torch import nn

from .config import ConfigError
from .distributed import print0

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "dense", "sparse",
                         "moe", "mlp"}  # layer types (config.layer_types) whose tokens mix only through attention
VARLEN = "varlen"
# layer types whose attention picks its keys (DeepSeek's indexer, compressed KV) against a materialized causal mask
SPARSE_LAYER_TYPES = {"indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention"}


def resolve_attn_implementation(hf_config, requested: str | None, varlen: Callable | None = None) -> str:
    """The implementation to build: `auto` is varlen (given `varlen`, which registers it) for a model class that
    passes attention kwargs and has no logit soft-capping, else sdpa; sdpa is eager for a class without it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)  # None: remote code, not in the auto mapping
    # varlen and flash build no mask, sdpa none for a row without padding or packing: only eager always builds it
    if SPARSE_LAYER_TYPES & set(getattr(hf_config.get_text_config(), "layer_types", None) or ()):
        if requested not in (None, "auto", "eager"):
            raise ConfigError(f"model.attn_implementation={requested}: {getattr(cls, '__name__', 'the model')}'s "
                              f"sparse attention needs the causal mask only eager always builds; use eager (or auto)")
        return "eager"
    if requested == "auto":
        varlen_ok = varlen and getattr(cls, "_supports_attention_backend", False) and not getattr(
            hf_config.get_text_config(), "attn_logit_softcapping", None)
        requested = VARLEN if varlen_ok else None
    package = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(requested)
    if package and (not torch.cuda.is_available() or importlib.util.find_spec(package) is None):
        raise ConfigError(f"model.attn_implementation={requested} needs a CUDA device and the {package} package "
                          f"(uv sync --extra gpu); use sdpa otherwise")
    if requested == VARLEN:
        if varlen is None:
            raise ConfigError(f"model.attn_implementation={VARLEN} needs the extension finetune/ext/varlen.py, which "
                              f"this installation lacks")
        varlen()
    if requested not in (None, "sdpa"):
        return requested
    if not getattr(cls, "_supports_sdpa", True):
        if requested is not None:
            print0(f"{cls.__name__} has no sdpa attention in transformers; using eager (set model.attn_implementation)")
        return "eager"
    return "sdpa"


def check_trainable(attn_implementation: str, device_type: str) -> None:
    """Refuse, in one line, flex_attention off CUDA: it has no CPU backward."""
    if attn_implementation == "flex_attention" and device_type != "cuda":
        raise ConfigError(f"model.attn_implementation=flex_attention cannot train on {device_type}: torch's "
                          f"FlexAttention has no backward there; use sdpa (or auto) on {device_type}")


def mixing_problem(model: nn.Module, layers: nn.ModuleList) -> str | None:
    """Why tokens of `model` mix other than through attention (odd layer types, a Conv1d, no heads), or None."""
    config = model.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])
    odd = sorted(kinds - ATTENTION_LAYER_TYPES)
    conv = next((f"{type(m).__name__} in {type(layer).__name__}" for layer in layers for m in layer.modules()
                 if isinstance(m, nn.Conv1d)), None)
    return (f"its {odd[0]} layers" if odd else f"its sequence convolutions ({conv})" if conv else
            "its layers (no attention heads)" if not getattr(config, "num_attention_heads", None) else None)


def check_packing(model: nn.Module, layers: nn.ModuleList, attn_implementation: str) -> None:
    """Refuse (one line) a packed run whose samples would mix: mixing_problem, or flash/varlen kwargs a class drops."""
    # keeps_samples_apart: its mixing layers run per packed sample (ext/linear_attention.py)
    if (why := mixing_problem(model, layers)) and not getattr(model, "keeps_samples_apart", False):
        raise ConfigError(f"{type(model).__name__} cannot keep packed samples apart: {why} ignore position_ids "
                          f"restarts; set data.packing=false")
    if attn_implementation.startswith("flash") or attn_implementation == VARLEN:
        if not getattr(type(model), "_supports_attention_backend", False):
            raise ConfigError(f"model.attn_implementation={attn_implementation} gets packed-sample boundaries as "
                              f"attention kwargs, which {type(model).__name__}'s layers do not pass on: use sdpa "
                              f"or set data.packing=false")
