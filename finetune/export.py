"""export-hf: a DCP checkpoint (training output dir, step dir or prepared dir) -> a Hugging Face model dir, streamed
one tensor at a time (host RAM for about one fp32 tensor) and published whole (outdir.staging)."""
from __future__ import annotations

import copy
import json
import math
import os
import re
import time
from collections import Counter
from pathlib import Path

import torch

from .checkpoint import CheckpointError
from .config import export_dtype_name, parse_shard_size
from .distributed import barrier, init_distributed, is_main, is_my_file, print0, world_size
from .errors import ModelError
from .hf.files import Plan, Source, open_dcp, save_hf_files, to_disk, write_safetensors
from .hf.live import open_live
from .hf.passthrough import plan_export
from .hf.template_defaults import template_kwargs_note, with_template_defaults
from .hf.verify import verify_export
from .metrics import peak_rss_mb
from .model import build_skeleton, load_hf_config
from .outdir import check_output_dir, staging
from .run import pins
from .weights import INDEX, STORED_DTYPES, read_tensor

EXPORT_MARKER = "finetune_export.json"  # marks a dir this command wrote (and may overwrite)


def name_groups(names) -> str:
    """'model.layers.2.* (17), mtp.* (3)': names grouped up to their first number (else their first part)."""
    groups = Counter(m[1] if (m := re.match(r"(.*?\.\d+)\.", n)) else n.split(".")[0] for n in names)
    return ", ".join(f"{g}.* ({c})" for g, c in groups.items())


def dtype_counts(dtypes) -> str:
    """'bfloat16, 2 in float32': the most common dtype, then how many tensors are in each other one."""
    (first, _), *others = Counter(str(d).replace("torch.", "") for d in dtypes).most_common()
    return ", ".join([first, *(f"{c} in {d}" for d, c in others)])


def parse_dtype(name: str) -> torch.dtype | None:
    """--dtype's torch dtype; None for auto (each tensor in the dtype the source stores it in)."""
    name = export_dtype_name(name)
    return None if name == "auto" else getattr(torch, name)


def export_layout(source: Source, skeleton, stored: dict) -> tuple[dict, dict]:
    """({HF name: metadata} of the tensors of `stored` that save_pretrained keeps, {on-disk name: (HF name, shape)}
    as save_pretrained writes them)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    expected = skeleton.state_dict()
    missing = [k for k in expected if k not in stored]
    extra = [k for k in stored if k not in expected]
    if missing or extra:
        raise ModelError(f"{source.label} does not hold the model of '{source.model_path}': {len(missing)} tensors "
                         f"missing (e.g. {missing[:2]}), {len(extra)} unexpected (e.g. {extra[:2]})")
    for k, t in expected.items():
        if tuple(stored[k].size) != tuple(t.shape):
            raise ModelError(f"{source.label}: {k} has shape {tuple(stored[k].size)}, the config of "
                             f"'{source.model_path}' says {tuple(t.shape)}")
    kept = remove_tied_weights_from_state_dict(dict(expected), skeleton)
    metas = {k: torch.empty(stored[k].size, device="meta") for k in kept}  # names and shapes only
    # each in-memory tensor converts on its own
    disk = {d: (k, tuple(t.shape)) for k, meta in metas.items() for d, t in to_disk(skeleton, {k: meta}).items()}
    whole = to_disk(skeleton, metas)
    if {d: tuple(t.shape) for d, t in whole.items()} != {d: shape for d, (_, shape) in disk.items()}:
        raise ModelError(f"{type(skeleton).__name__} stores weights in another layout on disk than in memory that "
                         f"does not convert tensor by tensor (transformers weight conversions); export-hf cannot "
                         f"write it yet")
    return {k: stored[k] for k in kept}, disk


def save_weights(out: Path, skeleton, disk: dict, load, dtypes: dict, untouched: dict, max_shard_size: int,
                 live: bool) -> dict:
    """Shards named and split as save_pretrained does, each process writing whole files, rank 0 the index (`live`:
    load() is a collective); `untouched` ({name: Entry} of the source) copied as stored. Returns {file: names}."""
    from huggingface_hub import split_torch_state_dict_into_shards
    metas = {d: torch.empty(shape, dtype=dtypes[d], device="meta") for d, (k, shape) in disk.items()}
    metas.update({d: torch.empty(e.shape, dtype=STORED_DTYPES[e.dtype], device="meta") for d, e in untouched.items()})
    split = split_torch_state_dict_into_shards(metas, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    converted = any(d != k for d, (k, _) in disk.items())
    last: dict = {}  # the on-disk pieces of the last in-memory tensor read (one fused MoE tensor -> many on disk)

    def fetch(d: str) -> torch.Tensor:
        if d in untouched:
            return read_tensor(untouched[d])
        k = disk[d][0]
        if last.get("name") != k:
            last.clear()  # free the previous tensor before reading the next: one in RAM at a time
            t = load(k)
            last.update(name=k, pieces=to_disk(skeleton, {k: t}) if converted else {k: t})
        return last["pieces"].pop(d)  # each piece is written once: dropping it here frees it after its write

    for filename, names in split.filename_to_tensors.items():
        if is_my_file(filename, split.filename_to_tensors):
            specs = {n: (tuple(metas[n].shape), metas[n].dtype) for n in names}
            write_safetensors(out / filename, specs, fetch)
        elif live:  # another rank writes this file: take part in its gathers
            for n in names:
                fetch(n)
    if split.is_sharded and is_main():
        num_params = sum(t.numel() for t in metas.values())
        index = {"metadata": {"total_parameters": num_params, **split.metadata}, "weight_map": split.tensor_to_filename}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return split.filename_to_tensors


def write_model(tmp: Path, checkpoint: str, label: str, source: Source, hf_config, skeleton, plan: Plan, load,
                shard_bytes: int, verify: bool, live: bool) -> dict:
    """The merged/full HF model dir, written and checked (`verify`); returns what the export marker records."""
    t0, kept, disk = time.perf_counter(), plan.kept, plan.disk
    num_bytes = sum(math.prod(shape) * plan.dtypes[d].itemsize for d, (_, shape) in disk.items())
    largest_mb = max(math.prod(m.size) * m.properties.dtype.itemsize for m in kept.values()) / 2**20
    shards = save_weights(tmp, skeleton, disk, load, plan.dtypes, plan.untouched, shard_bytes, live)
    written = copy.deepcopy(hf_config)  # with dtype and architectures, as save_pretrained sets them
    # the dtype most tensors are in: what from_pretrained(dtype="auto") loads them in
    written.dtype = str(plan.dtype or Counter(plan.dtypes.values()).most_common(1)[0][0]).split(".")[1]
    written.architectures = [type(skeleton).__name__]
    kwargs = source.chat_template_kwargs
    if is_main():
        save_hf_files(tmp, source.model_path, written, source.trust_remote_code, source.chat_template, kwargs,
                      with_template_defaults)
    if kwargs:  # what a request that passes none now gets
        print0(template_kwargs_note(kwargs))
    barrier()  # the check reads config.json
    print0(f"exported {label}: {len(kept)} tensors, {num_bytes / 1e9:.3f} GB {dtype_counts(plan.dtypes.values())} "
           f"in {len(shards)} shard(s), {time.perf_counter() - t0:.1f}s; peak RSS so far {peak_rss_mb():.0f} MB "
           f"(largest stored tensor {largest_mb:.0f} MB)")
    if plan.untouched:
        print0(f"copied through untouched from {plan.where}: {len(plan.untouched)} tensors the model class does not "
               f"own: {name_groups(plan.untouched)}")
    diff = None if not verify else verify_export(tmp, skeleton, load, written, plan, shards, live=live,
                                                 trust_remote_code=source.trust_remote_code, source=source.model_path)
    return {"source": str(Path(checkpoint).resolve()),
            "weights": "the live model" if live else str(source.weights.resolve()),
            "model_path": source.model_path, "dtype": written.dtype, "num_shards": len(shards),
            "untouched": sorted(plan.untouched), "verified_max_abs_logit_diff": diff, "lora": source.lora}


def export_hf(checkpoint: str, output_dir: str, dtype_name: str = "auto", max_shard_size: str = "5GB",
              verify: bool = True, adapter: bool = False, live: torch.nn.Module | None = None) -> Path:
    """Write the HF model dir (adapter=True: a LoRA checkpoint's PEFT adapter dir) `output_dir` from `checkpoint`;
    returns it. `live`: the sharded model just saved there, gathered (hf/live) where the layout allows. Each tensor
    in the source's dtype (hf/passthrough), what the model class does not own copied through, checked (hf/verify)."""
    dtype, shard_bytes, out = parse_dtype(dtype_name), parse_shard_size(max_shard_size), Path(output_dir)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and world_size() == 1:  # --nproc-per-node N: each rank writes
        init_distributed()  # and checks whole files (under sft the group is up already)
    with pins.pinned_source(checkpoint) as source:
        if adapter and not source.lora:
            raise CheckpointError(f"--adapter needs a LoRA checkpoint; {source.label} is a full model")
        if source.lora:
            from .adapters import lora_export
        check_output_dir(out, EXPORT_MARKER, "an earlier export")
        hf_config = load_hf_config(source.model_path, source.trust_remote_code)
        if source.lora:  # the base it is merged onto must have the architecture and weights it trained on
            lora_export.check_base(source, hf_config, adapter)
        stored, load = open_dcp(source.weights)  # the checkpoint's tensors, opened once
        if not adapter:
            if source.lora:  # merged onto its base (embeddings that LoRA trained apart from their tied twin: untied)
                skeleton, stored, load = lora_export.open_merged(source, hf_config, stored, load)
            else:
                skeleton = build_skeleton(hf_config, None, source.trust_remote_code)  # built once
            kept, disk = export_layout(source, skeleton, stored)
            plan = plan_export(skeleton, kept, disk, source.model_path, hf_config, dtype)
            gathered = live is not None and not source.lora and len({k for k, _ in disk.values()}) == len(disk)
            if gathered:
                load = open_live(live)[1]
            label = f"{source.label}{' (gathered from the live model)' if gathered else ''} -> {out}"
        with staging(out, EXPORT_MARKER, pins) as tmp:
            if adapter:
                record = lora_export.save_adapter(tmp, source, stored, load, hf_config, dtype or torch.bfloat16,
                                                  verify)
            else:
                record = write_model(tmp, checkpoint, label, source, hf_config, skeleton, plan, load, shard_bytes,
                                     verify, gathered)
            if is_main():  # marks the dir as our export
                (tmp / EXPORT_MARKER).write_text(json.dumps({**record, "time": time.time()}, indent=2) + "\n")
    return out
