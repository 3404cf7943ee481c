"""Which attention implementation runs, and the refusals for what cannot keep packed samples apart (varlen and flash
take the sample boundaries as kwargs; the others get a block-diagonal mask from the position_ids restarts)."""
from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
from torch import nn

from .config import ConfigError
from .distributed import print0

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "dense", "sparse",
                         "moe", "mlp"}  # layer types (config.layer_types) whose tokens mix only through attention
VARLEN = "varlen"
MASKED = ("sdpa", "eager", "flex_attention")  # the attentions that see packed samples only through a mask
_SAMPLE_IDS: ContextVar = ContextVar("sample_ids", default=None)  # (batch, seq) ids of the packed rows being run
# layer types whose attention picks its keys (DeepSeek's indexer, compressed KV) against a materialized causal mask
SPARSE_LAYER_TYPES = {"indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention"}


def resolve_attn_implementation(hf_config, requested: str | None, varlen: Callable | None = None) -> str:
    """The implementation to build: `auto` is varlen (given `varlen`, which registers it) for a model class that
    passes attention kwargs and uses nothing varlen lacks (varlen_lacks), else sdpa; sdpa is eager for a class
    without it. varlen asked for a model that uses what it lacks is refused here, before loading anything."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)  # None: remote code, not in the auto mapping
    lacks = varlen_lacks(hf_config)
    # varlen and flash build no mask, sdpa none for a row without padding or packing: only eager always builds it
    if SPARSE_LAYER_TYPES & set(getattr(hf_config.get_text_config(), "layer_types", None) or ()):
        if requested not in (None, "auto", "eager"):
            raise ConfigError(f"model.attn_implementation={requested}: {getattr(cls, '__name__', 'the model')}'s "
                              f"sparse attention needs the causal mask only eager always builds; use eager (or auto)")
        return "eager"
    if requested == "auto":
        varlen_ok = varlen and getattr(cls, "_supports_attention_backend", False) and not lacks
        requested = VARLEN if varlen_ok else None
    if requested == VARLEN and lacks:
        raise ConfigError(f"model.attn_implementation={VARLEN}: the model uses {lacks}, which varlen lacks; set "
                          f"model.attn_implementation=auto (or sdpa)")
    package = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(requested)
    if package and (not torch.cuda.is_available() or importlib.util.find_spec(package) is None):
        raise ConfigError(f"model.attn_implementation={requested} needs a CUDA device and the {package} package "
                          f"(uv sync --extra gpu); use sdpa otherwise")
    if requested == VARLEN:
        if varlen is None:
            raise ConfigError(f"model.attn_implementation={VARLEN} needs kernels/varlen.py's register "
                              f"(an attention-stage model.Transform), which this model build was not given")
        varlen()
    if requested not in (None, "sdpa"):
        return requested
    if not getattr(cls, "_supports_sdpa", True):
        if requested is not None:
            print0(f"{cls.__name__} has no sdpa attention in transformers; using eager (set model.attn_implementation)")
        return "eager"
    return "sdpa"


def varlen_lacks(hf_config) -> str | None:
    """What the attention of `hf_config`'s model uses that varlen cannot run (attention sinks, MLA's value head dim
    and chunked layers it runs), or None."""
    config = hf_config.get_text_config()
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    dropout = max(float(getattr(config, name, 0) or 0) for name in ("attention_dropout", "attn_pdrop"))
    return f"attention dropout ({dropout:g})" if dropout > 0 else None


def attention_notes(model: nn.Module, attn_implementation: str) -> str:
    """What the start-up line adds to the attention's name: how varlen runs what torch's kernel lacks."""
    if attn_implementation != VARLEN:
        return ""
    notes = ["attention sinks: one sdpa call per sample"] * any(
        isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())
    if "chunked_attention" in (getattr(model.config.get_text_config(), "layer_types", None) or []):
        notes.append("chunked layers: per chunk")
    return f" ({'; '.join(notes)})" if notes else ""


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
    # keeps_samples_apart: its mixing layers run per packed sample (kernels/linear_attention.py)
    if (why := mixing_problem(model, layers)) and not getattr(model, "keeps_samples_apart", False):
        raise ConfigError(f"{type(model).__name__} cannot keep packed samples apart: {why} ignore position_ids "
                          f"restarts; set data.packing=false")
    if attn_implementation.startswith("flash") or attn_implementation == VARLEN:
        if not getattr(type(model), "_supports_attention_backend", False):
            raise ConfigError(f"model.attn_implementation={attn_implementation} gets packed-sample boundaries as "
                              f"attention kwargs, which {type(model).__name__}'s layers do not pass on: use sdpa "
                              f"or set data.packing=false")


@contextmanager
def packed_samples(position_ids) -> Iterator[None]:
    """Within: every mask transformers builds for sdpa, eager or flex attention also keeps the samples of the packed
    rows `position_ids` (restarting at 0 per sample) apart, also in model classes that build their masks without
    the position_ids (Falcon, OPT, GPT-OSS), where transformers' own packed-row detection never runs."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    for name in MASKED:
        build = ALL_MASK_ATTENTION_FUNCTIONS[name]
        if not getattr(build, "keeps_samples_apart", False):
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, _keeping_samples_apart(build))
    token = _SAMPLE_IDS.set(None if position_ids is None else (position_ids == 0).cumsum(-1))
    try:
        yield
    finally:
        _SAMPLE_IDS.reset(token)


def _keeping_samples_apart(build: Callable) -> Callable:
    """transformers' mask builder `build`, its mask function and-ed with "same sample" inside packed_samples (a
    padding token is a sample of its own). Anding is idempotent: a mask that already separates them is unchanged."""
    from transformers.masking_utils import and_masks

    def build_apart(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, **kwargs):
        ids = _SAMPLE_IDS.get()
        if ids is not None and mask_function is not None and (batch_size, q_length, kv_length) == (
                ids.shape[0], ids.shape[1], ids.shape[1]) and q_offset == kv_offset == 0:
            mask_function = and_masks(mask_function, lambda b, h, q, kv: ids[b, q] == ids[b, kv])
            kwargs["allow_is_causal_skip"] = False
        return build(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function=mask_function, **kwargs)
    build_apart.keeps_samples_apart = True
    return build_apart
