"""prepare-checkpoint: load a HF model once through the training load path (fp32, sharded) and save it as DCP.

A prepared dir P holds P/weights/ (DCP, {"model": <HF-named fp32 tensors>}), config.json, generation_config.json,
tokenizer files and, written last, P/finetune_manifest.json, which marks it. It is published whole (outdir.staging);
hub.py loads it straight into the shards at any world size (DCP reshards).
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from .. import __version__
from ..distributed import init_distributed, is_main, print0, world_size
from ..args import build_config, check_flag
from ..config import ConfigError
from ..errors import ModelError
from ..launch import guarded, launch
from ..weights import MANIFEST
from ..hf.files import load_generation_config, save_hf_files
from ..model import Transform, build_model, load_hf_config, load_tokenizer
from ..outdir import check_output_dir, check_writable, staging
from ..weights import arch_of, tied_groups
from ..hf.fingerprint import fingerprint
from .. import hub
from ..run import checks, pins
from ..run.locks import hold_run_lock, release_lock
from ..run.rank_errors import rank_errors
from ..kernels.varlen import register


def check_prepare_target(out: Path, model_path: str) -> None:
    """Missing, empty, or an earlier prepared checkpoint (replaced at the end); never the source itself."""
    if Path(model_path).exists() and Path(model_path).resolve() == out.resolve():
        raise ModelError(f"--output-dir {out} is the model being prepared; pick another directory")
    check_output_dir(out, MANIFEST, "a prepared checkpoint")


def build_manifest(model, model_path: str, directory: Path, hf_config, keys: list[str],
                   trust_remote_code: bool) -> dict:
    """What a prepared dir records: its source (`directory`: the local copy of model_path), format and shapes."""
    return {
        "format": "finetune-prepared-checkpoint", "format_version": 1, "finetune_version": __version__,
        "source": {"model": model_path, "path": str(directory),
                   "revision": directory.name if directory.parent.name == "snapshots" else None,  # a hub cache
                   "fingerprint": fingerprint(directory)},
        "dtype": "float32", "source_dtype": str(getattr(hf_config, "dtype", None) or "").replace("torch.", ""),
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        "tied_parameters": [names for names in tied_groups(model) if len(names) > 1],
        "num_params": sum(p.numel() for p in model.parameters()),  # DTensor numel is the global count
        "num_tensors": len(keys), "key_set_sha256": hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest(),
        "saved_world_size": world_size(), "trust_remote_code": trust_remote_code, "time": time.time(),
        "config": arch_of(hf_config),  # what check_manifest compares with config.json
    }


def prepare_checkpoint(model_path: str, output_dir: str, trust_remote_code: bool = False,
                       attn_implementation: str = "auto") -> Path:
    """Run on every rank: build the sharded fp32 model as sft does, DCP-save it, then config/tokenizer/manifest."""
    device, dims = init_distributed()
    out = Path(output_dir)
    hf_config = load_hf_config(model_path, trust_remote_code)
    t0 = time.perf_counter()
    t = [Transform("attention", register)]
    model, _ = build_model(model_path, device, dims.mesh, t, mixed_precision="fp32",
                           attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    print0(f"loaded {model_path} into {world_size()} shard(s) in {time.perf_counter() - t0:.1f}s")
    directory = hub.local_dir(model_path).resolve()  # every rank: a hub id is resolved collectively
    with staging(out, MANIFEST, pins) as tmp:  # out: empty, or an earlier prepared checkpoint (checked before launch)
        sd = get_model_state_dict(model)
        dcp.save({"model": sd}, checkpoint_id=str(tmp / "weights"))
        if is_main():
            save_hf_files(tmp, model_path, hf_config, trust_remote_code)
            manifest = build_manifest(model, model_path, directory, hf_config, list(sd), trust_remote_code)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks the dir as prepared
    print0(f"prepared {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {len(sd)} tensors, fp32 "
           f"DCP; train with `finetune sft --model {out}` at any --nproc-per-node")
    return out


def command(overrides: list[str] | None, model: str | None, output_dir: str | None, nproc_per_node: int,
            debug: bool) -> None:
    """`finetune prepare-checkpoint` (tools/commands.py: its flags): checked, then run on the launched ranks under
    the output dir's lock."""
    def prepare():
        check_flag("--nproc-per-node", nproc_per_node >= 1, ">= 1", nproc_per_node)
        if not model or not output_dir:
            raise ConfigError("prepare-checkpoint needs --model ID|DIR and --output-dir DIR")
        cfg = build_config(None, overrides, checks=checks, **{"model.path": model, "output_dir": output_dir})
        out = Path(cfg.output_dir).resolve()
        check_writable(out.parent, f"--output-dir {out} (written beside it, then renamed)")
        check_prepare_target(Path(cfg.output_dir), cfg.model.path)
        hf_config = load_hf_config(cfg.model.path, cfg.model.trust_remote_code)  # bad input fails here, before
        load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)  # any rank starts
        load_generation_config(cfg.model.path, hf_config)
        lock = out.parent / f".{out.name}.lock"  # beside it: `out` is replaced
        hold_run_lock(lock, f"--output-dir {out}")
        return cfg, lock
    cfg, lock = guarded(prepare, debug)
    try:
        launch(prepare_checkpoint, (cfg.model.path, cfg.output_dir, cfg.model.trust_remote_code,
                                    cfg.model.attn_implementation), nproc_per_node, debug, errors=rank_errors)
    finally:
        release_lock(lock)
