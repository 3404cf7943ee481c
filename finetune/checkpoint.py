"""Sharded DCP checkpoints (<output_dir>/checkpoints/step-<N>/): save, retention, resume, preemption signals, and
which checkpoint an export reads (`find_source`).

A step dir is a checkpoint once DCP's files (`.metadata` last) and then our marker are written, and while intact:
the marker (every file's size, the sha256 of `.metadata`, the run's config) still matches."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from . import outdir
from .errors import FinetuneError
from .distributed import barrier, is_main, print0, world_size
from .weights import arch_diffs, arch_of, clean_fqn, is_adapter

MARKER = "finetune_complete.json"


class CheckpointError(FinetuneError, ValueError):
    """A checkpoint cannot be used for this run; the message is one line saying why."""


@dataclass
class TrainState(Stateful):
    """Loop counters and RNG: what else a resumed run needs to continue exactly."""
    step: int = 0
    samples_seen: int = 0  # global samples consumed: the data position, independent of world size
    tokens_seen: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        sd = {**asdict(self), "rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            sd["rng_cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for f in fields(self):
            setattr(self, f.name, int(sd[f.name]))
        torch.set_rng_state(sd["rng_cpu"])
        if torch.cuda.is_available() and "rng_cuda" in sd:
            torch.cuda.set_rng_state(sd["rng_cuda"])


def is_complete(path: Path) -> bool:
    """The save finished (the marker is written last); see damage() for intact."""
    return (path / ".metadata").is_file() and (path / MARKER).is_file()


def check_intact(path: Path, key: str = "") -> None:
    """A CheckpointError (naming the setting `key`, if any) unless `path` is a complete, intact checkpoint."""
    where = f"{key}: {path}" if key else str(path)
    if not is_complete(path):
        raise CheckpointError(f"{where} is an incomplete checkpoint (needs .metadata and {MARKER}; its save did not "
                              f"finish)")
    if problem := damage(path):
        raise CheckpointError(f"{where} is damaged: {problem}")


def write_marker(path: Path, marker: dict) -> None:
    """Rank 0, once DCP's save has returned (every rank's files fsynced before .metadata: their sizes are final)."""
    names = {f.name for f in path.iterdir() if f.is_file() and not f.name.startswith(MARKER)}
    # the files .metadata points into, by name: a shared filesystem's cached listing may lag other nodes' writes
    names |= {s.relative_path for s in dcp.FileSystemReader(str(path)).read_metadata().storage_data.values()}
    files = {name: (path / name).stat().st_size for name in sorted(names)}
    digest = hashlib.sha256((path / ".metadata").read_bytes()).hexdigest()
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps({**marker, "files": files, "metadata_sha256": digest}))
    tmp.rename(path / MARKER)


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, in a few words (None: intact). Sizes catch what preemption,
    kill -9 and full disks leave; only .metadata is hashed (a 70B run's ~1 TB at every resume would take too long)."""
    try:
        marker = read_marker(path)
        files, digest = dict(marker["files"]), marker["metadata_sha256"]
        assert ".metadata" in files
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"{MARKER} is unreadable or not ours"
    for name, size in files.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if (path / name).stat().st_size != size:
            return f"{name} has {(path / name).stat().st_size} bytes, {size} when saved (truncated?)"
    if hashlib.sha256((path / ".metadata").read_bytes()).hexdigest() != digest:
        return ".metadata changed since it was saved"
    return None


def step_dirs(root: Path) -> list[Path]:
    """step-N directories under root, oldest first."""
    dirs = [p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def latest_complete(root: Path, report: bool = True) -> Path | None:
    """The newest intact checkpoint under root; `report` prints the step dirs passed over (one line each kind)."""
    dirs = step_dirs(root)
    incomplete = [p.name for p in dirs if not is_complete(p)]  # the save did not finish
    if incomplete and report:
        print0(f"ignoring incomplete checkpoint(s) in {root}: {', '.join(incomplete)}")
    for path in reversed([p for p in dirs if p.name not in incomplete]):
        if (problem := damage(path)) is None:
            return path
        if report:
            print0(f"skipping damaged checkpoint {path}: {problem}")
    return None


def find_resume(output_dir: Path, resume: bool, resume_from: str, report: bool = True) -> Path | None:
    """The checkpoint this run starts from: --resume-from, else the newest intact one (none with --no-resume)."""
    if resume_from:
        check_intact(Path(resume_from), "checkpoint.resume_from")
        if resume:
            check_apart(Path(output_dir), Path(resume_from))
        return Path(resume_from)
    if not resume:  # a fresh run: the checkpoints already there are kept beside once it starts (keep_earlier_run)
        return None
    return latest_complete(Path(output_dir) / "checkpoints", report=report)


def check_apart(output_dir: Path, resume_dir: Path) -> None:
    """A run resumed from another run's checkpoint (--resume-from; or one kept as checkpoints.N) would write its
    checkpoints and metrics.jsonl among those of the run that output_dir holds: a CheckpointError."""
    root = output_dir / "checkpoints"
    # this run's own checkpoint: it continues (or rewinds) the run output_dir holds
    if resume_dir.resolve().parent == root.resolve():
        return
    held = [str(p.relative_to(output_dir)) for p in step_dirs(root)[-1:] + [output_dir / "metrics.jsonl"]
            if p.exists()]
    if held:
        raise CheckpointError(f"output_dir {output_dir} holds another run ({', '.join(held)}) than the one of "
                              f"checkpoint.resume_from {resume_dir}; their checkpoints and metrics would mix: to "
                              f"continue the run in {output_dir}, leave out --resume-from; to keep it beside "
                              f"(checkpoints.N, metrics.jsonl.N), pass --no-resume; or pass another --output-dir")


def keep_earlier_run(root: Path, resume: bool) -> None:
    """A fresh run (or one resumed from another run's checkpoint): rank 0 moves an earlier run's checkpoints to
    `checkpoints.N`, kept from retention, and its metrics.jsonl to metrics.jsonl.N."""
    if not resume and is_main():
        if step_dirs(root):
            print0(f"checkpoint.resume=false: starting fresh; the checkpoints already in {root} were moved to "
                   f"{outdir.keep_beside(root)}")
        outdir.keep_beside(root.parent / "metrics.jsonl")


def asked_export(output_dir: Path, resume_dir: Path | None, resume_from: str) -> tuple[str, str]:
    """(the checkpoint a refusal names, how to export it) for check_run's and preflight's refusals."""
    return (f"checkpoint.resume_from: {resume_dir}" if resume_from else f"output_dir {output_dir}",
            f"export it (finetune export-hf --checkpoint {resume_dir if resume_from else output_dir} -o DIR)")


def check_run(output_dir: Path, resume_dir: Path | None, resume_from: str, task: str) -> None:
    """The run continues only a run of its own task ("sft", "dpo"); else a CheckpointError."""
    root = Path(output_dir) / "checkpoints"
    own = latest_complete(root, report=False) if resume_dir is None or resume_from else resume_dir
    asked, export = asked_export(output_dir, resume_dir, resume_from)
    for path in dict.fromkeys(p for p in (resume_dir, own) if p is not None):
        saved = read_marker(path).get("task")
        if saved and saved != task:
            where = (f"{asked} is a checkpoint of a `finetune {saved}` run" if resume_from and path == resume_dir
                     else f"output_dir {output_dir} holds a `finetune {saved}` run ({path.name})")
            raise CheckpointError(f"{where}; `finetune {task}` continues only {task} runs and keeps its own output "
                                  f"dir: to start {task} from that model, {export} and pass DIR as --model, with "
                                  f"another --output-dir")


def read_marker(path: Path) -> dict:
    return json.loads((path / MARKER).read_text())


def train_state_dict(model, optimizer, scheduler, state: TrainState) -> dict:
    """What a checkpoint holds: the model's state (LoRA: its trainable parameters), the optimizer's, the scheduler,
    TrainState."""
    # a LoRA checkpoint holds no frozen base weight (the export reads it from the base); a full one holds the
    # parameters the model class itself freezes too (ERNIE-4.5-MoE's moe_statics), which no other file may hold
    lora = any(is_adapter(clean_fqn(n)) for n, _ in model.named_parameters())
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=lora))
    frozen = {clean_fqn(n) for n, p in model.named_parameters(remove_duplicate=False) if lora and not p.requires_grad}
    return {"model": {k: v for k, v in model_sd.items() if k not in frozen}, "optim": optim_sd,
            "scheduler": scheduler.state_dict(), "train": state}


def check_arch(path: Path, hf_config) -> None:
    if diffs := arch_diffs(read_marker(path).get("arch", {}), hf_config, "checkpoint", "run"):
        raise CheckpointError(f"checkpoint {path} does not match the model: {'; '.join(diffs)}")


class Checkpointer:
    """Saves step-N checkpoints and prunes older ones (run/saving.py's: in the background, a failure in one line)."""

    def __init__(self, root: Path, keep: int, lora: dict | None = None, run: dict | None = None, locks=None):
        # lora: the run's LoRA settings; run: what else the marker records; locks: run/locks, for prune
        self.root, self.keep, self.lora, self.run, self.locks = Path(root), keep, lora, run or {}, locks

    def save(self, step: int, model, optimizer, scheduler, state: TrainState, hf_config) -> Path:
        self.wait()
        path = self.root / f"step-{step}"
        if is_main():
            if path.exists():  # left over from a run that died while saving this step
                shutil.rmtree(path)
            path.mkdir(parents=True)
        barrier()
        sd = train_state_dict(model, optimizer, scheduler, state)
        marker = {"step": step, "world_size": world_size(), "time": time.time(), "arch": arch_of(hf_config),
                  "samples_seen": state.samples_seen, "tokens_seen": state.tokens_seen, "lora": self.lora, **self.run}
        self.write(path, sd, marker)
        return path

    def write(self, path: Path, sd: dict, marker: dict) -> None:
        dcp.save(sd, checkpoint_id=str(path))
        self.finish(path, marker)

    def finish(self, path: Path, marker: dict) -> None:
        """After DCP wrote `path` (its .metadata last): rank 0 writes the marker, then prunes."""
        if is_main():
            write_marker(path, marker)
            prune(self.root, self.keep, self.locks)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written; raises its error."""
        barrier()

    def close(self) -> None:
        self.wait()


def prune(root: Path, keep: int, locks=None) -> None:
    """Keep the newest `keep` intact checkpoints (0: all; damaged ones are left) and those `locks` (run/locks) pin."""
    intact = [p for p in step_dirs(root) if damage(p) is None]
    for old in intact[:-keep] if keep > 0 else []:
        with locks.unpinned(old) if locks else nullcontext(True) as free:
            if free:
                shutil.rmtree(old, ignore_errors=True)


class SignalFlag:
    """Inside `with`: remembers SIGTERM/SIGUSR1 (SLURM's pre-timeout signal)/SIGINT so the loop can save at the next
    step boundary; a second Ctrl-C exits at once."""

    def __enter__(self) -> SignalFlag:
        self.name = None
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.name == "SIGINT":
            print("finetune: interrupted again: exiting now, nothing was saved", file=sys.stderr, flush=True)
            os._exit(130)
        self.name = signal.Signals(signum).name


