"""What the slice reader (load.py) cannot load alone, imported by it when needed: a hub id, downloaded once per node,
layouts transformers converts on load (fused MoE experts) or without safetensors, which rank 0 loads and scatters, and
prepared checkpoint dirs (tools/prepare.py writes them)."""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .distributed import broadcast, is_main, world_size
from .errors import ModelError, one_line
from .weights import hf_buffers, hf_params, ignored_on_load, lacks_buffer


def local_dir(path: str) -> Path:
    """The local directory of `path`: a dir, or a hub id downloaded once per node (safetensors and json files)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download
    patterns = ["*.safetensors", "*.json"]
    error = None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        try:
            snapshot_download(path, allow_patterns=patterns)
        except Exception as e:  # noqa: BLE001 - any failure is reported by every rank below
            error = one_line(e)
    if world_size() > 1:
        errors = [None] * world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise ModelError(f"cannot download '{path}': {error}")
    return Path(snapshot_download(path, allow_patterns=patterns, local_files_only=True))


@torch.no_grad()
def load_hf_weights_rank0(model: nn.Module, path: str, trust_remote_code: bool = False, fill=None) -> None:
    """Rank 0 reads the HF checkpoint; each tensor is cast to its parameter's dtype and scattered to its shards
    (`fill`: QLoRA's, which quantizes each rank's rows of a base weight held as NF4)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    full, problem = None, None
    params, buffers = hf_params(model), hf_buffers(model)
    uses = Counter(key for key, _ in params)  # a module to save and its trained copy load the same tensor
    if is_main():
        from transformers import AutoModelForCausalLM
        src, info = AutoModelForCausalLM.from_pretrained(path, dtype="auto", trust_remote_code=trust_remote_code,
                                                         output_loading_info=True)
        full, arch = src.state_dict(), type(src).__name__
        # from_pretrained initialises what the checkpoint lacks (less what the class says it computes on load) and
        # drops what the model has no place for (less what the class says to ignore): both would train another model
        absent = set(info["missing_keys"])
        missing = [key for key in uses if key not in full or key in absent]
        lost = [key for key, _ in buffers if key in absent]
        unexpected = sorted(k for k in info["unexpected_keys"] if not ignored_on_load(src, k))
        if missing:
            problem = f"checkpoint '{path}' lacks {len(missing)} parameters, e.g. {missing[0]}"
        elif lost:
            problem = lacks_buffer(path, arch, lost[0])
        elif unexpected:
            problem = (f"'{path}' holds {len(unexpected)} tensor(s) the model of its config.json has no place for, "
                       f"e.g. {unexpected[0]}")
        del src
    if problem := broadcast(problem):  # every rank stops, not rank 0 alone
        raise ModelError(problem)
    for key, param in params:
        uses[key] -= 1
        if is_main():
            src_t = (full.pop(key) if uses[key] == 0 else full[key]).to(param.device, param.dtype)
        else:
            src_t = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        # fully_shard at the root makes every parameter a DTensor, but those it leaves alone (QLoRA's NF4 weights on
        # one shard): whole on every rank
        if not isinstance(param, DTensor):
            assert fill is not None, key
            if world_size() > 1:
                dist.broadcast(src_t, src=0)
            fill(param, src_t)
            continue
        shard = distribute_tensor(src_t, param.device_mesh, param.placements, src_data_rank=0)
        if fill is None or not fill(param, shard.to_local()):
            param.to_local().copy_(shard.to_local())
        del src_t
    for key, buf in buffers:  # whole on every rank
        if is_main():
            buf.copy_(full.pop(key))
        if world_size() > 1:
            dist.broadcast(buf, src=0)


def load_prepared_weights(model: nn.Module, path: str) -> None:
    """DCP-load a prepared checkpoint straight into the shards (DCP reshards and casts)."""
    import torch.distributed.checkpoint as dcp
    targets, copies = {}, []
    for key, param in hf_params(model):
        if key in targets:
            copies.append((param, key))
        else:
            targets[key] = param
    targets.update(hf_buffers(model))  # persistent buffers (a router's bias): prepare-checkpoint saved them
    dcp.load({"model": targets}, checkpoint_id=str(Path(path) / "weights"))
    with torch.no_grad():
        for param, key in copies:
            param.copy_(targets[key])
