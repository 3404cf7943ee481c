"""Fill a built, materialised sharded model: each rank preads its own slices of the HF safetensors (never a copy of
the model in RAM); hub ids, layouts converted on load and prepared DCP dirs: hub.py."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .compat import local_shape_and_offset
from .distributed import print0
from .errors import ModelError
from .weights import (MANIFEST, SAFETENSORS_DTYPES, Entry, arch_diffs, disk_to_memory, hf_buffers, hf_params,
                      ignored_on_load, is_prepared, lacks_buffer, missing_allowed, open_dir, read_rows, read_tensor,
                      tied_groups)

def check_manifest(path: str, hf_config) -> None:
    """A prepared checkpoint must hold the model the config describes."""
    recorded = json.loads((Path(path) / MANIFEST).read_text()).get("config", {})  # what prepare-checkpoint recorded
    diffs = arch_diffs(recorded, hf_config, "manifest", "config")
    if diffs:
        raise ModelError(f"prepared checkpoint '{path}' does not match its config.json: {'; '.join(diffs)}")


def locate_slices(model: nn.Module, skeleton: nn.Module, path: str, local_dir=Path) -> dict[str, Entry] | str:
    """{HF key: Entry} for each parameter of the sharded `model` (`skeleton`: the same model unwrapped, on meta),
    checked strictly; or why to take the rank-0 path. `local_dir`: hub.py's for a hub id."""
    if is_prepared(path):  # reaches here only with QLoRA's fill (and without a skeleton: build_model builds none)
        return f"'{path}' is a prepared checkpoint"
    entries = open_dir(local_dir(path))
    if entries is None:
        return f"'{path}' has no safetensors files"
    mapping = disk_to_memory(skeleton, entries)
    converted = next((d for d, k in mapping.items() if k is None), None)
    if converted:
        return f"{type(skeleton).__name__} stores {converted} in a layout that transformers converts on load"
    expected = skeleton.state_dict()  # tied aliases and persistent buffers: may be stored, not needed
    unexpected = [d for d, k in mapping.items() if k not in expected and not ignored_on_load(skeleton, d)
                  and not ignored_on_load(skeleton, k)]
    if unexpected:
        raise ModelError(f"'{path}' holds {len(unexpected)} tensor(s) the model of its config.json has no place "
                         f"for, e.g. {unexpected[0]}")
    stored = {k: entries[d] for d, k in mapping.items()}
    for names in tied_groups(skeleton):  # a tied twin (lm_head) reads what its stored twin holds (a LoRA copy does)
        stored.update({n: stored[s] for s in names if s in stored for n in names if n not in stored})
    located, buffers = {}, dict(hf_buffers(model))  # buffers too: a router's bias left at zero re-routes every token
    for key, t in [*hf_params(model), *buffers.items()]:
        entry = stored.get(key)
        if entry is None and key in buffers and missing_allowed(skeleton, key):
            continue
        if entry is None:
            raise ModelError(lacks_buffer(path, type(skeleton).__name__, key) if key in buffers else
                             f"'{path}' lacks the parameter {key}")
        if entry.shape != tuple(t.shape):
            raise ModelError(f"'{path}': {key} has shape {list(entry.shape)}, the model of its config.json needs "
                             f"{list(t.shape)}")
        if key not in buffers and (entry.dtype not in SAFETENSORS_DTYPES or
                                   SAFETENSORS_DTYPES[entry.dtype].is_floating_point != t.dtype.is_floating_point):
            raise ModelError(f"'{path}': {key} is stored as {entry.dtype}, which does not load into a "
                             f"{str(t.dtype).replace('torch.', '')} parameter")
        located[key] = entry
    return located


@torch.no_grad()
def load_slices(model: nn.Module, located: dict[str, Entry], fill=None) -> None:
    """Fill each parameter's local shard from its stored slice, cast to the parameter's dtype (`fill`: QLoRA's)."""
    from torch.distributed.tensor import DTensor
    for key, param in hf_params(model):
        entry = located[key]
        # fully_shard at the root makes every parameter a DTensor, but those it was told to leave alone (QLoRA's NF4
        # weights on one rank, which `fill` writes)
        plain = not isinstance(param, DTensor)
        assert not plain or fill is not None, key
        local = param if plain else param.to_local()
        shape, offset = (param.shape, [0] * param.dim()) if plain else local_shape_and_offset(param)
        assert tuple(local.shape) == tuple(shape), (key, local.shape, shape)
        if local.numel() == 0:
            continue
        if not entry.shape:  # a scalar
            local.copy_(read_tensor(entry))
            continue
        rows = read_rows(entry, offset[0], offset[0] + shape[0])
        for dim in range(1, rows.dim()):  # a layout sharded on other dims too: read the rows, keep the block
            rows = rows.narrow(dim, offset[dim], shape[dim])
        if fill is None or not fill(param, rows):
            local.copy_(rows)
    for key, buf in hf_buffers(model):
        if key in located:
            buf.copy_(read_tensor(located[key]))


def load_hf_weights(model: nn.Module, skeleton: nn.Module, path: str, trust_remote_code: bool = False,
                    fill=None) -> None:
    """Each rank reads its own slices (locate_slices), or hub.py loads a prepared dir, or on rank 0 what the slices
    cannot give; `fill` (QLoRA's) writes the slices of a base held quantized (not from a prepared dir)."""
    if is_prepared(path) and fill is None:
        from . import hub
        return hub.load_prepared_weights(model, path)
    if Path(path).is_dir():
        located = locate_slices(model, skeleton, path)
    else:
        from . import hub
        located = locate_slices(model, skeleton, path, hub.local_dir)
    if isinstance(located, str) and fill is not None and is_prepared(path):
        raise ModelError(f"{located}: lora.quantize_base quantizes the base as each rank reads its slices of the "
                         f"safetensors files, which this base cannot give; pass the HF model directory")
    if isinstance(located, str):
        from . import hub
        print0(f"loading on rank 0 and scattering: {located}")
        return hub.load_hf_weights_rank0(model, path, trust_remote_code, fill)
    load_slices(model, located, fill)

