"""Sharded DCP checkpoints: save (sync or async), completeness marker, retention, resume, preemption signals.

Layout: <output_dir>/checkpoints/step-<N>/ holds DCP's files (`.metadata` is written last, by rank 0) and our
marker `finetune_complete.json` written after it: the size of every file, the sha256 of `.metadata`, and the config
(model, tokenizer) the run trained with. Only an intact directory (marker readable, every file there at its saved
size, `.metadata` unchanged) counts as a checkpoint; anything else is reported and passed over on resume. The state
dict is world-size independent: model and optimizer as DTensors (DCP reshards on load), the scheduler, and
TrainState (step, global samples seen, tokens, RNG).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from . import faults, outdir
from .errors import FinetuneError, one_line, os_error_line
from .distributed import barrier, is_main, print0, world_size
from .optim import reapply_settings, settings
from .weights import arch_diffs, arch_of, clean_fqn

MARKER = "finetune_complete.json"
TRAINABLE = StateDictOptions(ignore_frozen_params=True)  # a LoRA checkpoint holds no frozen base weight
# on load the frozen keys are absent by design (check_compatible has compared the trainable ones)
TRAINABLE_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)
FULL_BYTES = 2**26  # free space under which a failed save is reported as a full disk


class CheckpointError(FinetuneError, ValueError):
    """A checkpoint cannot be used for this run; the message is one line saying why."""


class SaveError(FinetuneError):
    """A checkpoint could not be written (disk full, quota, read-only): the run failed (exit 1). Rank 0 always
    raises it (DCP gathers every rank's failure; the marker is rank 0's)."""

    exit_code = 1
    on_rank0 = True


class TrainState(Stateful):
    """Loop counters and RNG: what besides model/optimizer/scheduler a resumed run needs to continue exactly."""

    def __init__(self):
        self.step = 0
        self.samples_seen = 0  # global samples consumed: the data position, independent of world size
        self.tokens_seen = 0
        self.skipped_steps = 0

    def state_dict(self) -> dict:
        sd = {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen,
              "skipped_steps": self.skipped_steps, "rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            sd["rng_cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.samples_seen = int(sd["step"]), int(sd["samples_seen"])
        self.tokens_seen, self.skipped_steps = int(sd["tokens_seen"]), int(sd["skipped_steps"])
        torch.set_rng_state(sd["rng_cpu"])
        if torch.cuda.is_available() and "rng_cuda" in sd:
            torch.cuda.set_rng_state(sd["rng_cuda"])


def is_complete(path: Path) -> bool:
    """The save finished (the marker is written last); whether the files are still intact is damage()'s question."""
    return (path / ".metadata").is_file() and (path / MARKER).is_file()


def check_intact(path: Path, key: str = "") -> None:
    """Raise a CheckpointError (prefixed with the setting `key`, if any) unless `path` is a complete, intact
    checkpoint."""
    where = f"{key}: {path}" if key else str(path)
    if not is_complete(path):
        raise CheckpointError(f"{where} is an incomplete checkpoint (needs .metadata and {MARKER}; its save did not "
                              f"finish)")
    problem = damage(path)
    if problem:
        raise CheckpointError(f"{where} is damaged: {problem}")


def write_marker(path: Path, marker: dict) -> None:
    """Rank 0, once DCP's save has returned: every rank's files are written and fsynced before rank 0 writes
    .metadata (state_dict_saver: all ranks' write_data, then finish on the coordinator), so their sizes are final."""
    names = {f.name for f in path.iterdir() if f.is_file() and not f.name.startswith(MARKER)}
    # the files .metadata points into, by name: a shared filesystem's cached listing may lag other nodes' writes
    names |= {s.relative_path for s in dcp.FileSystemReader(str(path)).read_metadata().storage_data.values()}
    files = {name: (path / name).stat().st_size for name in sorted(names)}
    digest = hashlib.sha256((path / ".metadata").read_bytes()).hexdigest()
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps({**marker, "files": files, "metadata_sha256": digest}))
    tmp.rename(path / MARKER)


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, in a few words (None: intact). Preemption, kill -9 and full
    disks leave missing or truncated files, which the sizes catch at one stat per file; the sha256 covers only the
    small .metadata. Bit rot inside a shard is not detected: hashing a 70B run's ~1 TB at every resume would take
    longer than the resume itself."""
    try:
        marker = json.loads((path / MARKER).read_text())
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
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def latest_complete(root: Path, report: bool = True) -> Path | None:
    """The newest intact checkpoint under root; `report` prints the step dirs passed over (one line each kind)."""
    dirs = step_dirs(root)
    incomplete = [p.name for p in dirs if not is_complete(p)]  # the save did not finish
    if incomplete and report:
        print0(f"ignoring incomplete checkpoint(s) in {root}: {', '.join(incomplete)}")
    for path in reversed([p for p in dirs if p.name not in incomplete]):
        problem = damage(path)
        if problem is None:
            return path
        if report:
            print0(f"skipping damaged checkpoint {path}: {problem}")
    return None


def find_resume(output_dir: Path, resume: bool, resume_from: str, report: bool = True) -> Path | None:
    """The checkpoint this run starts from: --resume-from, else the newest intact one (none with --no-resume).
    `report` prints the step dirs it skips (off for the launcher's pre-flight check: the ranks say it)."""
    if resume_from:
        check_intact(Path(resume_from), "checkpoint.resume_from")
        return Path(resume_from)
    if not resume:  # a fresh run: the checkpoints already there are kept beside once it starts (keep_earlier_run)
        return None
    return latest_complete(Path(output_dir) / "checkpoints", report=report)


def keep_earlier_run(root: Path, resume: bool) -> None:
    """A run that does not resume (checkpoint.resume=false, --no-resume) starts an empty checkpoints dir: rank 0
    moves the one already there, with an earlier run's checkpoints, to `checkpoints.N` beside it (as metrics.jsonl
    goes to metrics.jsonl.N), where retention never deletes them. Called once the run is accepted."""
    if not resume and is_main() and step_dirs(root):
        print0(f"checkpoint.resume=false: starting fresh; the checkpoints already in {root} were moved to "
               f"{outdir.keep_beside(root)}")


def resolve_checkpoint(path: Path) -> Path | None:
    """The checkpoint `path` names: itself when it is a step dir (checked intact), the newest intact one of a
    training output dir; None when it is neither."""
    if (path / ".metadata").exists() or (path / MARKER).exists() or path.name.startswith("step-"):
        check_intact(path)
        return path
    if not (path / "checkpoints").is_dir():
        return None
    step = latest_complete(path / "checkpoints")  # says which newer step dirs it passes over
    if step is None:
        found = ", ".join(d.name for d in step_dirs(path / "checkpoints")) or "none"
        raise CheckpointError(f"no complete checkpoint under {path / 'checkpoints'} that is intact "
                              f"(step dirs: {found})")
    return step


def read_marker(path: Path) -> dict:
    return json.loads((path / MARKER).read_text())


def train_state_dict(model, optimizer, scheduler, state: TrainState) -> dict:
    """What a checkpoint holds: model and optimizer state of the trainable parameters, the scheduler, TrainState.
    ignore_frozen_params keeps the second name of a tied frozen weight (lm_head.weight of a tied LoRA base): such
    names are dropped here."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINABLE)
    frozen = {clean_fqn(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {"model": {k: v for k, v in model_sd.items() if k not in frozen}, "optim": optim_sd,
            "scheduler": scheduler.state_dict(), "train": state}


def check_arch(path: Path, hf_config) -> None:
    """Same architecture as the checkpoint (from its marker: cheap enough for the launcher's pre-flight check)."""
    diffs = arch_diffs(read_marker(path).get("arch", {}), hf_config, "checkpoint", "run")
    if diffs:
        raise CheckpointError(f"checkpoint {path} does not match the model: {'; '.join(diffs)}")


def check_compatible(path: Path, model, want: set[str], hf_config) -> None:
    """Same architecture, LoRA settings and parameter names (`want`) as the checkpoint, or a one-line error saying
    what differs."""
    saved, run = read_marker(path).get("lora"), getattr(model, "lora", None)
    if saved and run:
        diffs = [f"lora.{k}: checkpoint {saved[k]!r}, run {run.get(k)!r}" for k in saved
                 if k != "base_fingerprint" and saved[k] != run.get(k)]
        if diffs:
            raise CheckpointError(f"checkpoint {path} has other LoRA settings than this run: {'; '.join(diffs)}")
        check_base(path, saved, run["base_fingerprint"], hf_config.name_or_path)
    elif saved or run:
        kinds = [f"LoRA (lora.rank={s['rank']})" if s else "full fine-tuning (lora.rank=0)" for s in (saved, run)]
        raise CheckpointError(f"checkpoint {path} is from {kinds[0]}, this run is {kinds[1]}: resume a run of the "
                              f"same kind, or start a new one (--no-resume / another --output-dir)")
    check_arch(path, hf_config)
    saved = {k[len("model."):] for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
             if k.startswith("model.")}
    if saved != want:
        missing, extra = sorted(want - saved), sorted(saved - want)
        raise CheckpointError(f"checkpoint {path} has other parameters than the model: {len(missing)} missing "
                              f"(e.g. {missing[:2]}), {len(extra)} unexpected (e.g. {extra[:2]})")


def check_base(path: Path, lora: dict, fingerprint: str, model_path: str) -> None:
    """The base at `model_path` (its weights' `fingerprint`) is the one the LoRA checkpoint `path` (its settings
    `lora`) trained on; a checkpoint from before finetune recorded one passes with a note."""
    trained = read_marker(path).get("config", {}).get("model", {}).get("path")
    if "base_fingerprint" not in lora:
        print0(f"note: checkpoint {path} records no fingerprint of its LoRA base (saved by an older finetune): not "
               f"checked that '{model_path}' holds the base weights it trained on")
    elif lora["base_fingerprint"] != fingerprint:
        raise CheckpointError(f"checkpoint {path} trained its LoRA adapters on the base '{trained}', and "
                              f"'{model_path}' holds other weights now (fingerprint {lora['base_fingerprint'][:19]} "
                              f"then, {fingerprint[:19]} now): the adapters fit only the base they trained on")


def load_checkpoint(path: Path, model, optimizer, scheduler, state: TrainState, hf_config) -> None:
    sd = train_state_dict(model, optimizer, scheduler, state)
    check_compatible(path, model, set(sd["model"]), hf_config)
    run_settings = settings(optimizer)  # the checkpoint gives the state; the run's config, its settings
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=TRAINABLE_LOAD)
    scheduler.load_state_dict(sd["scheduler"])
    reapply_settings(optimizer, scheduler, run_settings)


class Checkpointer:
    """Saves step-N checkpoints; with use_async, at most one save in flight (a new save first waits for it)."""

    def __init__(self, root: Path, keep: int, use_async: bool, run: dict | None = None):
        # run: what the marker records about the run besides the step (its config: model, tokenizer)
        self.root, self.keep, self.use_async, self.run = Path(root), keep, use_async, run or {}
        self.pending = None
        # async saves run collectives from a background thread: give them their own gloo group
        self.group = dist.new_group(backend="gloo") if use_async and dist.is_initialized() else None

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
                  "samples_seen": state.samples_seen, "tokens_seen": state.tokens_seen,
                  "lora": getattr(model, "lora", None), **self.run}
        if self.use_async:
            fut = dcp.async_save(sd, checkpoint_id=str(path), process_group=self.group)
            fut = getattr(fut, "upload_completion", fut)
            done = threading.Event()

            def on_done(f):  # rank 0's save ends after DCP's .metadata is written: the marker can follow
                try:
                    if f.exception() is None:
                        self._finish(path, marker)
                except Exception as e:  # noqa: BLE001 - raised by wait(), in the loop's thread
                    done.error = e
                finally:
                    done.set()
            fut.add_done_callback(on_done)
            self.pending = (fut, done, path)
        else:
            with removed_if_failed(path):
                dcp.save(sd, checkpoint_id=str(path))
                self._finish(path, marker)
        return path

    def _finish(self, path: Path, marker: dict) -> None:
        """Rank 0 marks the checkpoint complete, then prunes: the last intact one survives until then."""
        faults.kill_if("kill_in_save", marker["step"])
        if not is_main():
            return
        write_marker(path, marker)
        prune(self.root, self.keep)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written; raises its error."""
        if self.pending is not None:
            (fut, done, path), self.pending = self.pending, None
            with removed_if_failed(path):
                fut.result()
                done.wait()
                if getattr(done, "error", None):
                    raise done.error
        barrier()

    def close(self) -> None:
        """Wait for the save in flight, then free the async saves' process group."""
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


@contextmanager
def removed_if_failed(path: Path):
    """A save that fails (a full disk, a quota, a read-only mount) stops the run with one line naming the step dir
    and the cause, and leaves no half-written dir to fill the disk: rank 0 removes it; the older checkpoints stay.
    Every rank gets the failure of any rank (DCP gathers them into one CheckpointException), so all stop together."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        cause = save_failure(path, [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException)
                             else [e])
        if is_main():
            shutil.rmtree(path, ignore_errors=True)
        latest = latest_complete(path.parent, report=False)
        raise SaveError(f"cannot save checkpoint {path}: {cause}; removed it (the newest complete checkpoint: "
                        f"{latest.name if latest else 'none'})") from e


def save_failure(path: Path, causes: list[BaseException]) -> str:
    """The cause of a failed save in a few words: an OS error of any rank (also one chained inside another error),
    else the first error, with the free space where it is little: torch.save's zip writer reports a disk that
    fills up under it as "unexpected pos N vs M", without the OSError."""
    for cause in causes:
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno:
                return os_error_line(cause)
            cause = cause.__cause__ or cause.__context__
    free = shutil.disk_usage(path.parent).free
    return (f"no space left on the disk? ({free} bytes free; the error: {one_line(causes[0])})" if free < FULL_BYTES
            else one_line(causes[0]))


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` intact checkpoints (0: all). Only intact ones count and go: a damaged or incomplete
    newer dir never pushes out the last intact one (and is left to look at)."""
    intact = [p for p in step_dirs(root) if is_complete(p) and damage(p) is None]
    for old in intact[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


class SignalFlag:
    """Inside `with`: remembers SIGTERM/SIGUSR1 (SLURM's pre-timeout signal)/SIGINT (Ctrl-C) so the loop can save at
    the next step boundary; a second Ctrl-C exits at once. On exit the previous handlers are back. (With several
    local ranks, the `finetune` process owns Ctrl-C: launch.)"""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __enter__(self) -> SignalFlag:
        self.name = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.name == "SIGINT":
            print("finetune: interrupted again: exiting now, nothing was saved", file=sys.stderr, flush=True)
            os._exit(130)
        self.name = signal.Signals(signum).name
