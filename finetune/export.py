"""export-hf: a DCP checkpoint (training output dir, step dir or prepared dir) -> a verified Hugging Face model dir.

Tensors stream from DCP one at a time into safetensors shards whose headers are known up front (from DCP's
metadata), so writing needs host RAM for about one fp32 tensor and its cast, whatever the model or shard size.
The check afterwards streams too (verify.py): one tensor, or one decoder block in fp32, at a time.
Everything is written to a sibling temp dir and moved into place only once verified.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
import warnings
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .checkpoint import MARKER, CheckpointError, arch_diffs, damage, latest_complete, read_marker, step_dirs
from .config import ConfigError, export_dtype_name, parse_shard_size
from .distributed import barrier, init_distributed, is_main, print0, world_size
from .hfio import DTYPES as ST_TORCH, INDEX
from .lock import hold_lock, release_lock, remove_stale_partials
from .metrics import peak_rss_mb
from .model import MANIFEST, ModelError, build_skeleton, clean_fqn, is_prepared, load_hf_config
from .outdir import check_output_dir, publish_dir
from .prepare import save_hf_files

EXPORT_MARKER = "finetune_export.json"  # marks a dir this command wrote (and may overwrite)
ST_DTYPES = {v: k for k, v in ST_TORCH.items()}  # torch dtype -> safetensors' name


@dataclass
class Source:
    """Where an export reads from: DCP weights, the HF config/tokenizer source, and a label for messages."""
    weights: Path  # DCP dir whose state dict holds {"model": <HF-named tensors>}
    model_path: str  # HF dir/id or prepared dir with config.json and tokenizer files
    trust_remote_code: bool
    label: str
    lora: dict | None = None  # a LoRA checkpoint's settings: weights hold the adapters, model_path the base
    live: torch.nn.Module | None = None  # the sharded model that just trained (weights: its final checkpoint)


def parse_dtype(name: str) -> torch.dtype:
    return getattr(torch, export_dtype_name(name))


def find_source(path: str) -> Source:
    """The newest complete checkpoint of a training output dir, a step-N dir, or a prepared dir."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"no checkpoint at {p}: not a directory")
    if is_prepared(p):
        if not (p / "weights" / ".metadata").is_file():
            raise CheckpointError(f"prepared checkpoint {p} has no weights/.metadata (incomplete copy?)")
        manifest = json.loads((p / MANIFEST).read_text())
        return Source(p / "weights", str(p), bool(manifest.get("trust_remote_code", False)), f"prepared {p}")
    if (p / ".metadata").exists() or (p / MARKER).exists() or p.name.startswith("step-"):
        if not (p / MARKER).exists():
            raise CheckpointError(f"{p} is an incomplete checkpoint (needs .metadata and {MARKER}; its save did not "
                                  f"finish)")
        problem = damage(p)
        if problem:
            raise CheckpointError(f"checkpoint {p} is damaged: {problem}")
        step = p
    elif (p / "checkpoints").is_dir():
        step = latest_complete(p / "checkpoints")  # says which newer step dirs it passes over
        if step is None:
            found = ", ".join(d.name for d in step_dirs(p / "checkpoints")) or "none"
            raise CheckpointError(f"no complete checkpoint under {p / 'checkpoints'} that is intact "
                                  f"(step dirs: {found})")
    else:
        raise CheckpointError(f"no checkpoint at {p}: expected a training output dir (with checkpoints/), a step-N "
                              f"dir or a prepared checkpoint (with {MANIFEST})")
    # the model (config, tokenizer) this checkpoint trained: its marker says, whatever config.toml says now
    marker = read_marker(step)
    model = marker.get("config", {}).get("model", {})
    if not model.get("path"):
        raise CheckpointError(f"{step / MARKER} does not name the model it trained (saved by an older finetune)")
    return Source(step, model["path"], bool(model.get("trust_remote_code")), str(step), marker.get("lora"))


def plan_tensors(source: Source, hf_config) -> tuple[torch.nn.Module, dict, dict]:
    """(the model on the meta device, {HF name: DCP metadata} for exactly the tensors save_pretrained would keep, and
    {on-disk name: (HF name, shape)}: where transformers stores weights in another layout on disk than in memory
    (renamings such as GPT-NeoX's embed_out, fused MoE experts), the names and shapes save_pretrained writes)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    stored, _ = open_tensors(source, hf_config)
    skeleton = build_skeleton(hf_config, None, source.trust_remote_code)
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
    return skeleton, {k: stored[k] for k in kept}, disk


def open_tensors(source: Source, hf_config) -> tuple[dict, Callable[[str], torch.Tensor]]:
    """{HF name: metadata} of the tensors `source` holds, and name -> full tensor (read one at a time). For a LoRA
    checkpoint, those of the merged model: W + alpha/r * B @ A in fp32 over the base weights (prepared or HF dir)."""
    stored, load_stored = open_live(source.live) if source.live else open_dcp(source.weights)
    if not source.lora:
        return stored, load_stored
    from .lora import merged, open_safetensors
    base = find_source(source.model_path) if is_prepared(source.model_path) else None
    metas, load_base = open_tensors(base, hf_config) if base else open_safetensors(source.model_path)
    on_disk = set(metas)
    embedding, head = embedding_names(build_skeleton(hf_config, None, source.trust_remote_code))
    if head and head not in on_disk:  # a tied base stores its embedding once; an untied export's head starts there
        metas[head] = metas[embedding]
    scale = source.lora["alpha"] / source.lora["rank"]

    def load(name: str) -> torch.Tensor:
        return merged(name, load_base(name if name in on_disk else embedding),
                      lambda k: load_stored(k) if k in stored else None, scale)
    return metas, load


def open_dcp(weights: Path) -> tuple[dict, Callable[[str], torch.Tensor]]:
    """{name: metadata} of the model tensors in a DCP dir, and name -> one full tensor in its saved dtype."""
    reader = dcp.FileSystemReader(str(weights))
    metadata = reader.read_metadata()
    # dcp.load re-reads .metadata on every call: loading tensor by tensor would be quadratic in the number of tensors
    reader.read_metadata = lambda *args, **kwargs: metadata
    stored = {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items()
              if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}

    def load(name: str) -> torch.Tensor:
        t = torch.empty(stored[name].size, dtype=stored[name].properties.dtype)
        with warnings.catch_warnings():  # torch warns on every single-process load; that is exactly what we mean
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({f"model.{name}": t}, storage_reader=reader, no_dist=True)
        return t
    return stored, load


def open_live(model) -> tuple[dict, Callable[[str], torch.Tensor]]:
    """open_dcp for the sharded model in memory: load(name) gathers the full tensor (a collective: every rank must
    ask for the same names in the same order, which save_weights and verify_export do)."""
    from torch.distributed.checkpoint.metadata import TensorProperties
    from torch.distributed.tensor import DTensor
    tensors = {clean_fqn(n): t for n, t in model.state_dict().items()}  # tied aliases included, as DCP saves them
    stored = {n: TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape, []) for n, t in tensors.items()}

    def load(name: str) -> torch.Tensor:
        t = tensors[name]
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
    return stored, load


def embedding_names(skeleton) -> tuple[str, str | None]:
    """The parameter names of the input embedding's weight and the output layer's (None: the model has none)."""
    names = {id(m): f"{n}.weight" for n, m in skeleton.named_modules()}
    return names[id(skeleton.get_input_embeddings())], names.get(id(skeleton.get_output_embeddings()))


def untie_trained_apart(source: Source, hf_config) -> None:
    """A tied embedding that LoRA changed apart from its twin (modules_to_save, or an adapter on it) is exported
    untied, and the export says so."""
    skeleton = build_skeleton(hf_config, None, source.trust_remote_code)
    head = skeleton.get_output_embeddings()
    if head is None or head.weight is not skeleton.get_input_embeddings().weight:
        return
    keys, _ = open_dcp(source.weights)
    apart = [n for n in embedding_names(skeleton) if f"{n[:-len('.weight')]}.modules_to_save.default.weight" in keys
             or f"{n[:-len('.weight')]}.lora_A.default.weight" in keys]
    if apart:
        hf_config.tie_word_embeddings = False
        print0(f"note: LoRA trained {', '.join(apart)} apart from its tied twin: the export unties them "
               f"(tie_word_embeddings=false)")


def to_disk(skeleton, tensors: dict) -> dict:
    """{on-disk name: tensor} that save_pretrained writes for these in-memory {name: tensor}."""
    from transformers.core_model_loading import revert_weight_conversion
    return dict(revert_weight_conversion(skeleton, dict(tensors)))


def out_dtype_of(meta: TensorStorageMetadata, dtype: torch.dtype) -> torch.dtype:
    return dtype if meta.properties.dtype.is_floating_point else meta.properties.dtype


def mine(filename: str, files: dict) -> bool:
    """Whether this process writes (and checks) `filename`: files are dealt out round-robin over the ranks."""
    import torch.distributed as dist
    return list(files).index(filename) % world_size() == (dist.get_rank() if dist.is_initialized() else 0)


def write_safetensors(path: Path, specs: dict, fetch) -> None:
    """A safetensors file (u64 header length, JSON header, raw little-endian data) written tensor by tensor:
    specs is {name: (shape, dtype)}, fetch(name) returns the tensor. safetensors' save_file needs the whole shard
    in memory; here only one tensor is."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in specs.items():
        num_bytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, (shape, dtype) in specs.items():
            t = fetch(name).to(dtype).contiguous()
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (name, t.shape, t.dtype)
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t


def save_weights(out: Path, source: Source, skeleton, plan: dict, disk: dict, dtype: torch.dtype,
                 max_shard_size: int) -> dict:
    """Shards named and split as save_pretrained does (model.safetensors, or model-0000i-of-0000N + index); with
    several processes each writes whole files (mine()), rank 0 the index. Returns {file: names} of all files."""
    from huggingface_hub import split_torch_state_dict_into_shards
    metas = {d: torch.empty(shape, dtype=out_dtype_of(plan[k], dtype), device="meta") for d, (k, shape) in disk.items()}
    split = split_torch_state_dict_into_shards(metas, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    _, load = open_tensors(source, skeleton.config)
    converted = any(d != k for d, (k, _) in disk.items())
    last: dict = {}  # the on-disk pieces of the last in-memory tensor read (one fused MoE tensor -> many on disk)

    def fetch(d: str) -> torch.Tensor:
        k = disk[d][0]
        if last.get("name") != k:
            last.clear()  # free the previous tensor before reading the next: one in RAM at a time
            t = load(k)
            last.update(name=k, pieces=to_disk(skeleton, {k: t}) if converted else {k: t})
        return last["pieces"].pop(d)  # each piece is written once: dropping it here frees it after its write

    for filename, names in split.filename_to_tensors.items():
        if mine(filename, split.filename_to_tensors):
            specs = {n: (tuple(metas[n].shape), metas[n].dtype) for n in names}
            write_safetensors(out / filename, specs, fetch)
        elif source.live:  # another rank writes this file: take part in its gathers
            for n in names:
                fetch(n)
    if split.is_sharded and is_main():
        num_params = sum(t.numel() for t in metas.values())
        index = {"metadata": {"total_parameters": num_params, **split.metadata}, "weight_map": split.tensor_to_filename}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return split.filename_to_tensors


def export_hf(checkpoint: str, output_dir: str, dtype_name: str = "bfloat16", max_shard_size: str = "5GB",
              verify: bool = True, adapter: bool = False, live: torch.nn.Module | None = None) -> Path:
    """Write the HF model dir `output_dir` from `checkpoint` (with adapter=True: the PEFT adapter dir of a LoRA
    checkpoint); returns it. Nothing lands there unless verified. `live`: the sharded model `checkpoint` was just
    saved from, whose tensors are then gathered instead of read back (full models stored tensor by tensor; LoRA
    merges and converted layouts read the checkpoint)."""
    dtype, shard_bytes = parse_dtype(dtype_name), parse_shard_size(max_shard_size)
    out = Path(output_dir)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and world_size() == 1:  # --nproc-per-node N: each rank writes
        init_distributed()  # and checks whole files (under sft the group is up already)
    source = find_source(checkpoint)
    if adapter and not source.lora:
        raise CheckpointError(f"--adapter needs a LoRA checkpoint; {source.label} is a full model")
    check_output_dir(out, EXPORT_MARKER, "an earlier export")
    hf_config = load_hf_config(source.model_path, source.trust_remote_code)
    # the base a LoRA checkpoint is merged onto must have the architecture it was trained on
    diffs = arch_diffs(source.weights, hf_config, "base") if source.lora else []
    if diffs:
        raise ModelError(f"the LoRA base model '{source.model_path}' is not the one {source.label} trained: "
                         f"{'; '.join(diffs)}")
    if adapter:
        from .lora import save_adapter
        if world_size() > 1:
            raise ConfigError("--adapter writes one small file: use one process (no --nproc-per-node)")
        return publish(out, lambda tmp: save_adapter(tmp, source, hf_config, dtype, verify))
    untie_trained_apart(source, hf_config)
    skeleton, plan, disk = plan_tensors(source, hf_config)
    if live is not None and not source.lora and len({k for k, _ in disk.values()}) == len(disk):
        source.live, source.label = live, f"{source.label} (gathered from the live model)"
    return publish(out, lambda tmp: write_model(tmp, out, checkpoint, source, hf_config, skeleton, plan, disk, dtype,
                                                dtype_name, shard_bytes, verify))


def publish(out: Path, write: Callable[[Path], dict]) -> Path:
    """Run write(tmp) in a sibling temp dir (every rank: rank 0's, under its lock), mark it as our export, then move
    it into place. A kill -9 leaves only the hidden temp dir, which the next export removes."""
    lock = out.parent / f".{out.name}.lock"  # beside `out`: the dir itself is replaced by a rename at the end
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if not is_main():
        tmp = broadcast(None)
        write(tmp)
        barrier()
        return out
    hold_lock(lock, f"--output-dir {out}")
    try:
        remove_stale_partials(out.parent, out.name)
        tmp.mkdir()
        broadcast(tmp)
        record = write(tmp)
        barrier()  # every rank's files are written and checked
        (tmp / EXPORT_MARKER).write_text(json.dumps({**record, "time": time.time()}, indent=2) + "\n")
        publish_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        release_lock(lock)
    return out


def broadcast(obj):
    """rank 0's `obj` on every rank (itself on one process)."""
    if world_size() == 1:
        return obj
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_model(tmp: Path, out: Path, checkpoint: str, source: Source, hf_config, skeleton, plan: dict, disk: dict,
                dtype: torch.dtype, dtype_name: str, shard_bytes: int, verify: bool) -> dict:
    """The merged/full HF model dir, written and verified; returns what the export marker records."""
    t0 = time.perf_counter()
    num_bytes = sum(math.prod(m.size) * out_dtype_of(m, dtype).itemsize for m in plan.values())
    largest_mb = max(math.prod(m.size) * m.properties.dtype.itemsize for m in plan.values()) / 2**20
    shards = save_weights(tmp, source, skeleton, plan, disk, dtype, shard_bytes)
    hf_config.dtype = str(dtype).split(".")[1]  # as save_pretrained sets them
    hf_config.architectures = [type(skeleton).__name__]
    if is_main():
        save_hf_files(tmp, source.model_path, hf_config, source.trust_remote_code)
    barrier()  # the check reads config.json
    print0(f"exported {source.label} -> {out}: {len(plan)} tensors, {num_bytes / 1e9:.3f} GB {dtype_name} in "
           f"{len(shards)} shard(s), {time.perf_counter() - t0:.1f}s; peak RSS so far {peak_rss_mb():.0f} MB "
           f"(largest stored tensor {largest_mb:.0f} MB)")
    diff = None
    if verify:
        from .verify import verify_export
        diff = verify_export(tmp, source, hf_config, plan, disk, dtype, shards)
        print0(f"verified: {len(plan)} tensors equal the checkpoint's; logits streamed from the files (fp32) max "
               f"abs diff {diff:.3g}; peak RSS {peak_rss_mb():.0f} MB")
    return {"source": str(Path(checkpoint).resolve()),
            "weights": "the live model" if source.live else str(source.weights.resolve()),
            "model_path": source.model_path, "dtype": str(dtype).split(".")[1], "num_shards": len(shards),
            "verified_max_abs_logit_diff": diff, "lora": source.lora}

