"""`finetune sft`/`dpo` fail fast, before any rank starts: what the ranks would refuse only after loading (checked
holding the run's lock: `preflight_locked`)."""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch

from .attention import check_trainable
from .checkpoint import CheckpointError, asked_export, check_arch, check_run, find_resume, read_marker
from .config import Config, ConfigError
from .data import open_sources, require_chat_template
from .run.locks import hold_run_lock, release_lock
from .weights import is_prepared
from .model import load_hf_config
from .data.chat_template import run_tokenizer
from .build import samples


def preflight_locked(cfg: Config, task: str, lock: Path, nnodes: int) -> str | None:
    """preflight(cfg, task) with the run's lock (run/locks.py): taken at once if the output dir exists
    (another run may own it: exit 2; no new dir before the checks), else after them; released if they fail."""
    # the node launchers of a multi-node run share the output dir: there global rank 0 takes the lock
    takes = nnodes == 1 or "RANK" in os.environ
    if takes and lock.parent.is_dir():
        hold_run_lock(lock, f"output dir {cfg.output_dir}")
    try:
        nothing_to_do = preflight(cfg, task)
    except BaseException:
        release_lock(lock)
        raise
    if takes:
        hold_run_lock(lock, f"output dir {cfg.output_dir}")
    return nothing_to_do


def preflight(cfg: Config, task: str = "sft") -> str | None:
    """Model config, tokenizer with a chat template, the checkpoint to resume (intact, same architecture, a LoRA one
    on its base), readable data and eval set. Returns why there is nothing to do, if so."""
    check_trainable(cfg.model.attn_implementation, "cuda" if torch.cuda.is_available() else "cpu")  # ranks' device
    hf_config = load_hf_config(cfg.model.path, cfg.model.trust_remote_code)
    resume = find_resume(Path(cfg.output_dir), cfg.checkpoint.resume, cfg.checkpoint.resume_from, report=False)
    require_chat_template(run_tokenizer(cfg, resume)[0], f"model {cfg.model.path}")
    if resume is not None:
        check_arch(resume, hf_config)
        lora = read_marker(resume).get("lora")
        # the LoRA base now, not after loading it (a hub id: by the ranks, once downloaded)
        if lora and cfg.lora.rank and "base_fingerprint" in lora and Path(cfg.model.path).is_dir():
            from .adapters.lora import check_base
            from .hf.fingerprint import base_fingerprint
            check_base(resume, lora, base_fingerprint(cfg.model.path), cfg.model.path)
    # the same task and (of the same architecture) the same model, or a hint for what was asked
    check_run(Path(cfg.output_dir), resume, cfg.checkpoint.resume_from, task)
    check_model(Path(cfg.output_dir), resume, cfg.checkpoint.resume_from, cfg.model.path)
    dc, opened = cfg.data, samples(cfg, {})["stream"].open_sources  # as the run opens them: streamed or not
    sources = opened([asdict(s) for s in dc.sources] or dc.path, fmt=dc.format, split=dc.split, name=dc.name or None)
    sources += open_sources(cfg.eval.path) if cfg.eval.path else []  # checked now, not when training ends
    for src in sources:  # sft trains (and evaluates) conversations, dpo preference pairs
        if (src.fmt == "pairs") != (task == "dpo"):
            raise ConfigError(f"{src.spec['path']}: " + ("preference pairs (columns 'chosen' and 'rejected'): train "
                              "them with `finetune dpo`" if task == "sft" else "`finetune dpo` needs preference "
                              "pairs: columns 'chosen' and 'rejected' (and optionally 'prompt')"))
    if task == "dpo":
        from .tasks.dpo import reference_kind
        reference_kind(cfg)
    if cfg.lora.rank and Path(cfg.model.path).is_dir() and not is_prepared(cfg.model.path):
        note_converted_base(cfg.model.path, hf_config, cfg.model.trust_remote_code)
    step = read_marker(resume)["step"] if resume is not None else 0
    if step >= cfg.train.max_steps:
        return (f"nothing to do: checkpoint {resume} is at step {step} and train.max_steps is "
                f"{cfg.train.max_steps}; raise train.max_steps to train on")
    return None


def note_converted_base(path: str, hf_config, trust_remote_code: bool) -> None:
    """A LoRA run on a base whose stored layout transformers converts on load: its merged export cannot read it yet
    (adapters/lora_export.py refuses it then); said now, with the export that works."""
    from .distributed import print0
    from .model import build_skeleton
    from .weights import open_dir
    from .adapters.lora_export import CONVERTED, converted_names
    if converted := converted_names(build_skeleton(hf_config, None, trust_remote_code), open_dir(Path(path)) or {}):
        print0(f"note: {path} {CONVERTED.format(converted[0])}, which a merged export of LoRA cannot read yet: "
               f"export this run with `finetune export-hf --adapter`")


def check_model(output_dir: Path, resume_dir: Path | None, resume_from: str, model_path: str) -> None:
    """A run continues only a run of its own model (fingerprints of local dirs, else names), else CheckpointError."""
    asked, export = asked_export(output_dir, resume_dir, resume_from)
    if resume_dir is None or read_marker(resume_dir).get("lora"):
        return
    trained = read_marker(resume_dir).get("config", {}).get("model", {}).get("path", "")
    if not trained:
        return
    from .hf.fingerprint import base_fingerprint as fingerprint
    local = [Path(p).is_dir() for p in (trained, model_path)]
    differs = (trained != model_path and fingerprint(trained) != fingerprint(model_path) if all(local)
               else trained != model_path if not any(local) else False)
    if differs:
        restart = ("start a new run from its weights" if resume_from else
                   f"train '{model_path}' instead, pass --no-resume (its checkpoints are kept as checkpoints.N) or "
                   f"another --output-dir; to start from its weights")
        raise CheckpointError(f"{asked}: its run trained the model '{trained}', not '{model_path}' (model.path): to "
                              f"continue that run, pass --model {trained}; to {restart}, {export} and pass DIR as "
                              f"--model")
