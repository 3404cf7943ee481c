"""Hugging Face safetensors read without holding the model: every rank reads just the slices its shards hold.

A safetensors file is a u64 header length, a JSON header ({name: dtype, shape, data_offsets}) and the raw
little-endian data, each tensor row-major, so a run of dim-0 rows is one contiguous byte range. `load_slices` reads,
for each sharded parameter, the byte range of its local rows with one pread (no mmap: pages read are not left
mapped into the process, so RSS holds the fp32 shard and one slice in flight, never a bf16 copy of the model), and
casts it into the local shard. The local shape and offset come from the DTensor itself (its mesh and placements),
so any FSDP/HSDP layout works, uneven sizes included. Names map from disk to memory exactly as from_pretrained does
(transformers' renamings: GPT-NeoX's embed_out, legacy names, the base-model prefix); a checkpoint whose layout
needs a real conversion (fused MoE experts) is left to the rank-0 path, and so is one without safetensors files.
"""
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

from .errors import one_line
from .model import ModelError, build_skeleton, clean_fqn

INDEX = "model.safetensors.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


@dataclass
class Entry:
    """Where one stored tensor's bytes are."""
    file: Path
    dtype: str  # safetensors' name, e.g. BF16
    shape: tuple[int, ...]
    start: int  # absolute byte offset of its data in the file


def read_header(file: Path) -> dict[str, Entry]:
    with open(file, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {name: Entry(file, h["dtype"], tuple(h["shape"]), 8 + size + h["data_offsets"][0])
            for name, h in header.items()}


def local_dir(path: str) -> Path:
    """The local directory of `path` (a dir, or a hub id downloaded once per node: local rank 0 fetches the
    safetensors and json files while the other ranks wait; everyone learns of a failed download)."""
    if Path(path).is_dir():
        return Path(path)
    import torch.distributed as dist
    from huggingface_hub import snapshot_download
    patterns = ["*.safetensors", "*.json"]
    error = None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        try:
            snapshot_download(path, allow_patterns=patterns)
        except Exception as e:  # noqa: BLE001 - any failure is reported by every rank below
            error = one_line(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise ModelError(f"cannot download '{path}': {error}")
    return Path(snapshot_download(path, allow_patterns=patterns, local_files_only=True))


def open_dir(root: Path) -> dict[str, Entry] | None:
    """{stored name: Entry} of a model dir's safetensors (None: it has none). Strict about the index: a file it
    names must exist and hold the tensors it lists, and no file may hold a tensor twice."""
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


def disk_to_memory(skeleton: nn.Module, names) -> dict[str, str | None]:
    """{stored name: in-memory name} as from_pretrained renames them; None where the stored layout needs a real
    conversion (a transformers WeightConverter, e.g. per-expert MoE weights fused on load)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key
    conversions = get_model_conversion_mapping(skeleton)
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    expected = skeleton.state_dict()
    mapping = {}
    for name in names:
        key, converter = rename_source_key(name, renamings, converters, skeleton.base_model_prefix, expected)
        mapping[name] = None if converter else key
    return mapping


def plan_slices(model: nn.Module, path: str, trust_remote_code: bool = False) -> dict[str, Entry] | str:
    """{in-memory name: Entry} for every parameter of the sharded `model` (names as clean_fqn/base_name give them),
    checked strictly; or a one-line reason to take the rank-0 path. Every rank reaches the same answer."""
    from .lora import base_name, is_adapter
    root = local_dir(path)
    entries = open_dir(root)
    if entries is None:
        return f"'{path}' has no safetensors files"
    skeleton = build_skeleton(model.config, None, trust_remote_code)
    mapping = disk_to_memory(skeleton, entries)
    converted = next((d for d, k in mapping.items() if k is None), None)
    if converted:
        return f"{type(skeleton).__name__} stores {converted} in a layout that transformers converts on load"
    expected = skeleton.state_dict()  # tied aliases and persistent buffers: may be stored, not needed
    ignore = list(getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or [])
    unexpected = [d for d, k in mapping.items() if k not in expected and not any(re.search(p, k) for p in ignore)]
    if unexpected:
        raise ModelError(f"'{path}' holds {len(unexpected)} tensor(s) the model of its config.json has no place "
                         f"for, e.g. {unexpected[0]}")
    stored = {k: entries[d] for d, k in mapping.items()}
    tied: dict[int, list[str]] = {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    for names in tied.values():  # a tied twin (lm_head) reads what its stored twin holds (a LoRA copy of it does)
        stored.update({n: stored[s] for s in names if s in stored for n in names if n not in stored})
    plan = {}
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        key = base_name(clean_fqn(name))
        entry = stored.get(key)
        if entry is None:
            raise ModelError(f"'{path}' lacks the parameter {key}")
        if entry.shape != tuple(param.shape):
            raise ModelError(f"'{path}': {key} has shape {list(entry.shape)}, the model of its config.json needs "
                             f"{list(param.shape)}")
        if entry.dtype not in DTYPES or DTYPES[entry.dtype].is_floating_point != param.dtype.is_floating_point:
            raise ModelError(f"'{path}': {key} is stored as {entry.dtype}, which does not load into a "
                             f"{str(param.dtype).replace('torch.', '')} parameter")
        plan[key] = entry
    return plan


def read_rows(entry: Entry, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of dim 0 of a stored tensor, in its stored dtype: one contiguous read."""
    dtype = DTYPES[entry.dtype]
    shape = entry.shape or (1,)
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    buf = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.start + start * row_bytes)
        if f.readinto(buf.numpy()) != buf.numel():
            raise ModelError(f"{entry.file} is shorter than its header says (truncated copy?)")
    return buf.view(dtype).reshape(stop - start, *shape[1:])


@torch.no_grad()
def load_slices(model: nn.Module, plan: dict[str, Entry]) -> None:
    """Fill each parameter's local shard from its stored slice, cast to the parameter's dtype."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from .lora import base_name, is_adapter
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        entry = plan[base_name(clean_fqn(name))]
        assert isinstance(param, DTensor), name  # fully_shard at the root makes every parameter a DTensor
        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        assert tuple(local.shape) == tuple(shape), (name, local.shape, shape)
        if local.numel() == 0:
            continue
        if not entry.shape:  # a scalar
            local.copy_(read_tensor(entry))
            continue
        rows = read_rows(entry, offset[0], offset[0] + shape[0])
        for dim in range(1, rows.dim()):  # a layout sharded on other dims too: read the rows, keep the block
            rows = rows.narrow(dim, offset[dim], shape[dim])
        local.copy_(rows)


def read_tensor(entry: Entry) -> torch.Tensor:
    return read_rows(entry, 0, (entry.shape or (1,))[0]).reshape(entry.shape)


@torch.no_grad()
def streamed_logits(hf_config, fetch, input_ids: torch.Tensor, trust_remote_code: bool = False) -> torch.Tensor:
    """fp32 logits of the model of `hf_config` on `input_ids`, its weights fetched by fetch(in-memory name) just
    before the module that owns them runs and dropped right after (a decoder block as a whole, every other module
    with parameters on its own): RAM holds one block's weights at a time, never the model."""
    from .model import find_layers
    model = build_skeleton(hf_config, None, trust_remote_code).eval()
    canonical: dict[int, str] = {}  # a tied weight is fetched under the name it is stored by
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
    layers = set(find_layers(model))
    inside = {id(m) for layer in layers for m in layer.modules()}
    units = [m for m in model.modules() if m in layers or (id(m) not in inside and m._parameters)]

    def owners(unit):  # (module, attribute, meta parameter) for each parameter the unit runs with
        mods = unit.modules() if unit in layers else [unit]
        return [(m, a, p) for m in mods for a, p in m._parameters.items() if p is not None]

    def hooks(params):
        def load(module, args):
            for m, a, p in params:
                m._parameters[a] = nn.Parameter(fetch(canonical[id(p)]).float(), requires_grad=False)

        def drop(module, args, output):
            for m, a, p in params:
                m._parameters[a] = p  # back to meta: the weights are freed
        return load, drop

    for unit in units:
        load, drop = hooks(owners(unit))
        unit.register_forward_pre_hook(load)
        unit.register_forward_hook(drop)
    return model(input_ids=input_ids).logits
