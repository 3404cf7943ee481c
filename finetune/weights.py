"""The bottom of the weights path: parameter names, safetensors bytes (a u64 header length, a JSON header, raw
row-major data), tensor sources ({name: metadata}, name -> full tensor), architecture fingerprints."""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import ModelError, one_line

INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
# what a tensor copied through byte for byte may be stored as (a released checkpoint's fp8 MTP layer)
STORED_DTYPES = {**SAFETENSORS_DTYPES, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                 "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}
SAFETENSORS_CODES = {v: k for k, v in STORED_DTYPES.items()}  # torch dtype -> safetensors' name
ARCH_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "tie_word_embeddings")
# peft wraps a target Linear as <name>.base_layer + <name>.lora_A/B.default, and a module to save as
# <name>.original_module (frozen) + <name>.modules_to_save.default (the trained copy)
_WRAPPERS = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.)")

MANIFEST = "finetune_manifest.json"  # marks a prepared checkpoint directory


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


# ------------------------------------------------------------------------------------------------------ names

def clean_fqn(name: str) -> str:
    """Parameter name as the HF model has it (without AC / compile wrapper prefixes)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def base_name(fqn: str) -> str:
    """The HF name a (wrapped) parameter is loaded from: q_proj.base_layer.weight -> q_proj.weight."""
    return _WRAPPERS.sub("", fqn)


def is_adapter(fqn: str) -> bool:
    return ".lora_A." in fqn or ".lora_B." in fqn


def hf_key(fqn: str) -> str | None:
    """The HF tensor a parameter of the (wrapped, sharded) model loads from; None for a LoRA adapter, which has none."""
    return None if is_adapter(fqn) else base_name(clean_fqn(fqn))


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of each buffer the model's state dict holds."""
    return [(f"{prefix}.{name}" if prefix else name, b) for prefix, m in model.named_modules()
            for name, b in m._buffers.items() if b is not None and name not in m._non_persistent_buffers_set]


def hf_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(HF key, parameter) for each parameter loaded from the base weights: all but the LoRA adapters."""
    return [(hf_key(n), p) for n, p in model.named_parameters() if hf_key(n) is not None]


def hf_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(HF key, buffer) for each persistent buffer (a router's bias): loaded whole on every rank."""
    return [(hf_key(n), b) for n, b in persistent_buffers(model) if hf_key(n) is not None]


def lacks_buffer(path: str, arch: str, key: str) -> str:
    return (f"'{path}' lacks {key}, a persistent buffer of {arch} that transformers does not "
            f"compute on load (left at its initial value it would change what the model computes)")


def missing_allowed(model: nn.Module, key: str) -> bool:
    """A tensor the model's class computes on load when a checkpoint lacks it (_keys_to_ignore_on_load_missing)."""
    return any(re.search(p, key) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or [])


def ignored_on_load(model: nn.Module, key: str) -> bool:
    """A stored tensor the model's class does not read (_keys_to_ignore_on_load_unexpected: MTP layers, other heads).
    A pattern naming a layer past the last (DeepSeek-V3's model.layers.61, the MTP layer of a 61-layer model) stands
    for the config's MTP layers after its last (num_mtp_layers, else one), not for more: a config that undercounts
    the layers is still refused."""
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    if any(re.search(p, key) for p in patterns):
        return True
    config = model.config.get_text_config()
    first, layer = config.num_hidden_layers, re.search(r"(?:^|\.)layers\.(\d+)\.", key)
    mtp = getattr(config, "num_mtp_layers", None) or getattr(config, "num_nextn_predict_layers", None) or 1
    past_last = layer is not None and first <= int(layer[1]) < first + mtp
    return past_last and any(re.search(r"layers\\?\.\d", p) for p in patterns)


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter, tied ones in one list (the first is the name it is stored by)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def renamed_on_load(skeleton: nn.Module, names) -> dict[str, tuple[str, bool]]:
    """{stored name: (the in-memory name from_pretrained gives it, whether it converts it: fused MoE experts)}."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    conversions = get_model_conversion_mapping(skeleton)
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    expected, prefix, renamed = skeleton.state_dict(), skeleton.base_model_prefix, {}
    # in from_pretrained's order (a renaming may wait for a key it guards on), and as it does: a name the model has
    # is kept when a renaming would take it elsewhere (DeepSeek-V4's `.norm.` -> `.kv_norm.` and model.norm.weight)
    for name in sorted(names, key=dot_natural_key):
        key, converter = rename_source_key(name, renamings, converters, prefix, expected)
        if key not in expected and name in expected:
            key, converter = rename_source_key(name, [], [], prefix, expected)
        renamed[name] = (key, converter is not None)
    return renamed


def disk_to_memory(skeleton: nn.Module, names) -> dict[str, str | None]:
    """{stored name: in-memory name} as from_pretrained renames them; None where it converts (fused MoE experts)."""
    return {name: None if converted else key for name, (key, converted) in renamed_on_load(skeleton, names).items()}


# ------------------------------------------------------------------------------------------------ safetensors

@dataclass
class Entry:
    """Where one stored tensor's bytes are."""
    file: Path
    dtype: str  # safetensors' name, e.g. BF16
    shape: tuple[int, ...]
    start: int  # absolute byte offset of its data in the file


def read_header(file: Path) -> dict[str, Entry]:
    """{name: Entry} of a safetensors file; a file shorter than its header describes is refused here, at once."""
    with open(file, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        length = os.fstat(f.fileno()).st_size
    header.pop("__metadata__", None)
    end = 8 + size + max((h["data_offsets"][1] for h in header.values()), default=0)
    if length < end:
        raise ModelError(f"{file} has {length} bytes, its header describes {end} (a truncated copy?)")
    return {name: Entry(file, h["dtype"], tuple(h["shape"]), 8 + size + h["data_offsets"][0])
            for name, h in header.items()}


def open_dir(root: Path) -> dict[str, Entry] | None:
    """{stored name: Entry} of a model dir's safetensors (None: it has none), checked against its index."""
    index = root / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise ModelError(f"{index} names {len(missing)} file(s) that do not exist, e.g. {missing[0]}")
        paths = [root / f for f in files]
    else:  # as from_pretrained: without an index only model.safetensors (not e.g. Mistral's consolidated.*)
        paths = [root / "model.safetensors"] if (root / "model.safetensors").is_file() else []
        weight_map = None
    if not paths:
        return None
    entries: dict[str, Entry] = {}
    for file in paths:
        try:
            header = read_header(file)
        except (OSError, ValueError, KeyError, struct.error) as e:
            raise ModelError(f"cannot read the safetensors header of {file}: {one_line(e)}") from e
        twice = next((n for n in header if n in entries), None)
        if twice:
            raise ModelError(f"{twice} is stored twice, in {entries[twice].file.name} and {file.name}")
        entries.update(header)
    if weight_map is not None:
        wrong = [n for n, f in weight_map.items() if n not in entries or entries[n].file.name != Path(f).name]
        if wrong:
            raise ModelError(f"{index} says {wrong[0]} is in {weight_map[wrong[0]]}, but that file does not hold it")
    return entries


def read_rows(entry: Entry, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of dim 0 of a stored tensor, in its stored dtype: one contiguous read."""
    dtype = STORED_DTYPES[entry.dtype]
    shape = entry.shape or (1,)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    buf = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.start + start * row_bytes)
        if f.readinto(buf.numpy()) != buf.numel():
            raise ModelError(f"{entry.file} is shorter than its header says (truncated copy?)")
    return buf.view(dtype).reshape(stop - start, *shape[1:])


def read_tensor(entry: Entry) -> torch.Tensor:
    return read_rows(entry, 0, (entry.shape or (1,))[0]).reshape(entry.shape)


# -------------------------------------------------------------------------------------------------- sources
# each returns ({name: TensorStorageMetadata}, name -> one full tensor)

# -------------------------------------------------------------------------------------------- architecture

def arch_of(hf_config) -> dict:
    """The architecture fingerprint a checkpoint (and a prepared dir) records."""
    return {k: getattr(hf_config, k, None) for k in ARCH_KEYS}


def arch_diffs(recorded: dict, hf_config, recorded_in: str, other: str) -> list[str]:
    """How hf_config (`other`) differs from the architecture `recorded` (in `recorded_in`), one phrase per key."""
    return [f"{k} is {v} in the {recorded_in} but {getattr(hf_config, k, None)} in the {other}"
            for k, v in recorded.items() if v != getattr(hf_config, k, None)]
