"""An export's side of the output-dir locks (run/locks.py): its source step pinned against the retention of a run
still saving into it; its own dir guarded while written (outdir.staging), what interrupted exports left behind
removed, and what the user added to an output dir kept when it is written again (publish_dir)."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from .locks import _held, hold_lock, pin_file, release_lock, same_file


def hold_pin(step: Path) -> bool:
    """Pin checkpoint dir `step` until release_pin(step) or the end of this process: retention (prune,
    through unpinned) leaves it alone. A shared flock: several readers pin at once. False, with no pin, when the step
    is gone (retention deleted it first). Where no pin can be written (a read-only copy), it reads unpinned."""
    path = pin_file(step).resolve()
    if str(path) in _held:
        return True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # its checkpoints dir is gone
        return False
    except OSError:  # read-only, no permission: no run saves into it either
        return Path(step).is_dir()
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits while retention deletes the step (it holds the pin exclusively)
    except OSError:  # a filesystem without locks: read unprotected, as hold_lock does
        pass
    if not Path(step).is_dir() or not same_file(fd, path):
        os.close(fd)
        return False
    _held[str(path)] = fd
    return True


def release_pin(step: Path) -> None:
    """Unpin `step` (hold_pin). Its file stays: another reader may hold a pin on it (it goes with the step)."""
    fd = _held.pop(str(pin_file(step).resolve()), None)
    if fd is not None:
        os.close(fd)


def is_free(path: Path) -> bool:
    """Nobody holds the lock at `path` (this process's own locks count as held)."""
    if str(Path(path).resolve()) in _held:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # also one its holder removed just now, on release
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases the lock we may just have taken


def remove_stale_partials(parent: Path, own: str) -> None:
    """Remove the `.<name>.partial-<pid>` dirs in `parent` that no running export writes (`own`'s, whose lock we
    hold, and those whose `.<name>.lock` is free): a kill -9 leaves one holding a full copy of the weights."""
    removed, num_bytes = [], 0
    for partial in sorted(parent.glob(".*.partial-*")):
        name = partial.name[1:].rsplit(".partial-", 1)[0]
        if partial.is_dir() and (name == own or is_free(parent / f".{name}.lock")):
            num_bytes += sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
            shutil.rmtree(partial, ignore_errors=True)
            removed.append(partial.name)
    if removed:
        print(f"removed {len(removed)} partial export(s) left by interrupted runs in {parent} "
              f"({', '.join(removed)}): {num_bytes / 1e9:.3f} GB freed", flush=True)


def publish_dir(new: Path, out: Path, marker: str) -> None:
    """Move the finished `new` to `out`, its `marker` (JSON) listing the names in it ("files"), replacing an earlier
    `out` but keeping what the user added there (names its marker does not list)."""
    ours = sorted(p.name for p in new.iterdir())
    (new / marker).write_text(json.dumps({**json.loads((new / marker).read_text()), "files": ours}, indent=2) + "\n")
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        before = json.loads((old / marker).read_text()).get("files")
        theirs = [p.name for p in sorted(old.iterdir()) if before is not None and p.name not in before]
        kept, replaced = [n for n in theirs if n not in ours], [n for n in theirs if n in ours]
        for name in kept:
            (old / name).rename(new / name)
        if theirs:
            print(f"{out}: kept what was added there since it was written ({', '.join(kept) or 'nothing'})"
                  + (f"; replaced by this one's own: {', '.join(replaced)}" if replaced else ""), flush=True)
    elif out.is_dir():
        out.rmdir()
    new.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def guard(out: Path):
    """Rank 0's part of outdir.staging: the lock `.<name>.lock` beside `out` (unless the launcher holds it) while it
    writes and publishes, the temp dirs of runs killed -9 removed first."""
    lock = out.parent / f".{out.name}.lock"
    own_lock = os.environ.get("FINETUNE_LOCK") != str(lock.resolve())  # else the launcher holds it for us
    if own_lock:
        hold_lock(lock, f"--output-dir {out}")
    try:
        remove_stale_partials(out.parent, out.name)
        yield
    finally:
        if own_lock:
            release_lock(lock)


def pin_source(checkpoint: str):
    """hf/files.find_source, its step dir pinned (hold_pin) so that the retention of a run still saving into it
    (checkpoint.keep) leaves it until the export ends. When retention deleted it first: the newest again (for an
    output dir), else one line naming the step."""
    from ..checkpoint import CheckpointError, damage, is_complete
    from ..hf.files import find_source
    from ..weights import is_prepared
    if is_prepared(Path(checkpoint)):  # no run deletes a prepared checkpoint
        return find_source(checkpoint)
    step = Path(checkpoint)
    for _ in range(3):
        try:
            source = find_source(checkpoint)
        except FileNotFoundError:  # deleted between being found and being read
            continue
        step = source.weights
        if hold_pin(step):
            if is_complete(step) and damage(step) is None:  # intact while pinned (not deleted meanwhile)
                return source
            release_pin(step)
        if step.resolve() == Path(checkpoint).resolve():  # the step itself was asked for: no newer one to take
            break
    raise CheckpointError(f"checkpoint {step} was deleted by the retention of the run saving into {step.parent} "
                          f"(checkpoint.keep) before export-hf could pin it: export a newer step, or the output dir "
                          f"(its newest)")


@contextmanager
def pinned_source(checkpoint: str):
    """pin_source, unpinned when the block ends."""
    source = pin_source(checkpoint)
    try:
        yield source
    finally:
        release_pin(source.weights)
