"""prepare-checkpoint: load a HF model once through the training load path (fp32, sharded) and save it as DCP.

Layout of a prepared dir P: P/weights/ (DCP, state dict {"model": <HF-named fp32 tensors>}), config.json,
generation_config.json, tokenizer files, and P/finetune_manifest.json, written last: its presence marks P as
prepared. Everything is written into a sibling P.partial first and renamed to P at the end, so P is either the
old or the new prepared checkpoint, never half of one. `build_model(P, ...)` then loads straight into the shards at
any world size (DCP reshards).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from . import __version__, outdir
from .checkpoint import arch_of
from .distributed import barrier, init_distributed, is_main, print0, world_size
from .errors import one_line
from .model import MANIFEST, ModelError, build_model, load_hf_config, load_tokenizer

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")


def check_output_dir(out: Path, model_path: str) -> None:
    """Missing, empty, or an earlier prepared checkpoint (replaced at the end); never the source itself."""
    if Path(model_path).exists() and Path(model_path).resolve() == out.resolve():
        raise ModelError(f"--output-dir {out} is the model being prepared; pick another directory")
    outdir.check_output_dir(out, MANIFEST, "a prepared checkpoint")


def source_dir(model_path: str) -> tuple[Path, str | None]:
    """The local directory holding the model's files, and the hub revision (commit) when it came from the cache."""
    if Path(model_path).is_dir():
        return Path(model_path).resolve(), None
    from transformers.utils import cached_file
    snapshot = Path(cached_file(model_path, "config.json")).parent
    return snapshot, snapshot.name if snapshot.parent.name == "snapshots" else None


def fingerprint(directory: Path) -> str:
    """sha256 of config.json and the weight files' names and sizes (hashing the weights themselves takes minutes)."""
    h = hashlib.sha256()
    h.update((directory / "config.json").read_bytes())
    for f in sorted(directory.rglob("*")):
        if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name in (".metadata", "model.safetensors.index.json")):
            h.update(f"{f.relative_to(directory)}:{f.stat().st_size}\n".encode())
    return "sha256:" + h.hexdigest()


def build_manifest(model, model_path: str, hf_config, keys: list[str], trust_remote_code: bool) -> dict:
    directory, revision = source_dir(model_path)
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    return {
        "format": "finetune-prepared-checkpoint", "format_version": 1, "finetune_version": __version__,
        "source": {"model": model_path, "path": str(directory), "revision": revision,
                   "fingerprint": fingerprint(directory)},
        "dtype": "float32", "source_dtype": str(getattr(hf_config, "dtype", None) or "").replace("torch.", ""),
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        "tied_parameters": [names for names in shared.values() if len(names) > 1],
        "num_params": sum(p.numel() for p in model.parameters()),  # DTensor numel is the global count
        "num_tensors": len(keys), "key_set_sha256": hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest(),
        "saved_world_size": world_size(), "trust_remote_code": trust_remote_code, "time": time.time(),
        "config": arch_of(hf_config),  # what check_manifest compares with config.json
    }


def load_generation_config(model_path: str, hf_config):
    """The source's generation_config.json, or (it has none) one derived from the model config, as save_pretrained
    does; a file that is there but unreadable or invalid is an error, never replaced."""
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(model_path)
    except Exception as e:  # noqa: BLE001 - OSError (missing file, bad JSON), ValueError (bad values), ...
        if (source_dir(model_path)[0] / "generation_config.json").exists():
            raise ModelError(f"cannot load the generation config of '{model_path}': {one_line(e)}") from e
    return GenerationConfig.from_model_config(hf_config)


def save_hf_files(out: Path, model_path: str, hf_config, trust_remote_code: bool) -> None:
    """config.json, generation_config.json and the tokenizer files of `model_path`, saved as save_pretrained would."""
    hf_config.save_pretrained(out)
    load_generation_config(model_path, hf_config).save_pretrained(out)
    load_tokenizer(model_path, trust_remote_code, pad=False).save_pretrained(out)
    # transformers 5 also writes where *this* process loaded the tokenizer from (is_local, local_files_only) into
    # tokenizer_config.json; that describes our load, not the tokenizer, so it is dropped
    tok_config = out / "tokenizer_config.json"
    if tok_config.is_file():
        entries = json.loads(tok_config.read_text())
        if [entries.pop(k) for k in ("is_local", "local_files_only") if k in entries]:
            tok_config.write_text(json.dumps(entries, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def prepare_checkpoint(model_path: str, output_dir: str, trust_remote_code: bool = False,
                       attn_implementation: str = "sdpa") -> Path:
    """Run on every rank: build the sharded fp32 model as sft does, DCP-save it, then config/tokenizer/manifest."""
    device, dims = init_distributed()
    out = Path(output_dir)
    partial = out.parent / f".{out.name}.partial"  # one name all ranks (and nodes) agree on
    hf_config = load_hf_config(model_path, trust_remote_code)
    t0 = time.perf_counter()
    model = build_model(model_path, device, dims.mesh, mixed_precision="fp32", attn_implementation=attn_implementation,
                        trust_remote_code=trust_remote_code)
    print0(f"loaded {model_path} into {world_size()} shard(s) in {time.perf_counter() - t0:.1f}s")
    if is_main():
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    sd = get_model_state_dict(model)
    dcp.save({"model": sd}, checkpoint_id=str(partial / "weights"))
    barrier()
    if is_main():
        save_hf_files(partial, model_path, hf_config, trust_remote_code)
        manifest = build_manifest(model, model_path, hf_config, list(sd), trust_remote_code)
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks the dir as prepared
        outdir.publish_dir(partial, out)  # out: empty, or an earlier prepared checkpoint (checked before launch)
        print0(f"prepared {out}: {manifest['num_params'] / 1e6:.1f}M params, {len(sd)} tensors, fp32 DCP; train "
               f"with `finetune sft --model {out}` at any --nproc-per-node")
    barrier()
    return out
