"""What an export takes from the source model's own files besides the checkpoint (export.export_hf plans with it):
the dtype each tensor is stored in (or kept in by transformers on load), and the tensors the model class does not own
(MTP layers, other heads), which it copies through byte for byte."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..weights import MANIFEST, is_prepared
from ..weights import (SAFETENSORS_DTYPES, STORED_DTYPES, Entry, ignored_on_load, open_dir, renamed_on_load)
from .files import Plan
from .fingerprint import fingerprint


def source_dir(model_path: str) -> Path | None:
    """The local dir of the source model's safetensors: `model_path`, the dir a prepared checkpoint was made from
    (while it holds what it held then), or a hub id's snapshot in the local cache; None where none is here (nothing
    is downloaded)."""
    path = Path(model_path)
    if is_prepared(path):
        made_from = json.loads((path / MANIFEST).read_text()).get("source", {})
        there = made_from.get("path") and Path(made_from["path"]).is_dir()
        return Path(made_from["path"]) if there and fingerprint(Path(made_from["path"])) == made_from.get(
            "fingerprint") else None
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(model_path, allow_patterns=["*.safetensors", "*.json"], local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache (or not a hub id): the export goes by the config
        return None


def open_source(model_path: str) -> tuple[dict[str, Entry], str]:
    """({stored name: Entry} of the source model's files ({} where none is at hand), where they are)."""
    where = source_dir(model_path)
    return (open_dir(where) or {}, str(where)) if where is not None else ({}, "")


def keeps_fp32(skeleton: nn.Module, dtype: torch.dtype) -> Callable[[str], bool]:
    """Whether transformers keeps a tensor (in-memory name) in fp32 when it loads the model in `dtype` (its dtype
    plan: _keep_in_fp32_modules_strict, and _keep_in_fp32_modules for fp16)."""
    plan = [p for p, d in skeleton._get_dtype_plan(dtype).items() if d == torch.float32]
    pattern = re.compile("|".join(p.replace("*", ".*") for p in plan)) if plan else None
    return lambda name: pattern is not None and pattern.search(name) is not None


def plan_dtypes(skeleton: nn.Module, disk: dict, kept: dict, source: dict[str, Entry], dtype: torch.dtype | None,
                default: torch.dtype) -> dict[str, torch.dtype]:
    """{on-disk name: the dtype it is written in}: auto (no `dtype`) the dtype the source stores it in (an lr=0
    export is the source, byte and dtype), else fp32 where transformers keeps it so on load (a router's bias), else
    `default` (the config's); with `dtype` (--dtype), that for every floating-point tensor but those transformers
    keeps in fp32. Non-floating tensors as stored."""
    fp32 = keeps_fp32(skeleton, dtype or default)
    dtypes = {}
    for d, (k, _) in disk.items():
        stored = kept[k].properties.dtype
        from_source = SAFETENSORS_DTYPES.get(source[d].dtype) if d in source else None
        if not stored.is_floating_point:
            dtypes[d] = stored
        elif dtype is None and from_source is not None and from_source.is_floating_point:
            dtypes[d] = from_source
        elif fp32(k):
            dtypes[d] = torch.float32
        else:
            dtypes[d] = dtype or default
    return dtypes


def not_owned(skeleton: nn.Module, source: dict[str, Entry]) -> dict[str, Entry]:
    """The source's tensors its model class leaves unread on load (MTP layers, other heads): {stored name: Entry}."""
    expected = skeleton.state_dict()
    renamed = renamed_on_load(skeleton, source)
    return {d: e for d, e in source.items() if renamed[d][0] not in expected and ignored_on_load(skeleton, d)
            and e.dtype in STORED_DTYPES}


def plan_export(skeleton: nn.Module, kept: dict, disk: dict, model_path: str, hf_config,
                dtype: torch.dtype | None) -> Plan:
    """The Plan of an export of `kept`/`disk` (export_layout) from the model at `model_path` (its files opened once)."""
    source, where = open_source(model_path)
    default = getattr(hf_config, "dtype", None)
    default = getattr(torch, str(default).replace("torch.", ""), None) if default else None
    default = default if isinstance(default, torch.dtype) and default.is_floating_point else torch.bfloat16
    dtypes = plan_dtypes(skeleton, disk, kept, source, dtype, default)
    return Plan(kept, disk, dtypes, not_owned(skeleton, source) if source else {}, source, where, dtype)
