"""Ownership of output dirs (the CLI's run lock, checkpoint.prune): an exclusive flock held for a whole run, released
however the process ends (kill -9 included, unlike a pid file); a step dir an export pinned (run/pins.py) is left by
retention."""
from __future__ import annotations

import fcntl
import os
import shlex
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

from ..errors import FinetuneError

_held: dict[str, int] = {}  # lock path -> open fd: the lock lasts while the fd stays open, i.e. this process


class LockError(FinetuneError):
    """Another process owns the directory; the message names it."""


def hold_lock(path: Path, what: str) -> None:
    """Take the lock at `path` for the rest of this process, or raise LockError naming its holder (pid, host, argv)."""
    path = Path(path).resolve()
    if str(path) in _held:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise LockError(f"{what} is in use by {holder}; wait for it to finish or pick another directory") from None
        except OSError as e:  # a filesystem without locks (some NFS set-ups): run, but say it is unprotected
            print(f"note: cannot lock {path} ({e.strerror}); nothing stops a second run into {what}", flush=True)
            os.close(fd)
            return
        if same_file(fd, path):
            break
        os.close(fd)  # its holder removed it on release after we opened it: the lock is a new file now
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} ({shlex.join(['finetune', *sys.argv[1:]])})".encode())
    _held[str(path)] = fd


def release_lock(path: Path) -> None:
    """Release the lock and remove its file, so none pile up (removed while held: whoever opened it meanwhile finds
    it gone once they get the lock, and takes a new one)."""
    key = str(Path(path).resolve())
    fd = _held.pop(key, None)
    if fd is not None:
        if same_file(fd, key):
            os.unlink(key)
        os.close(fd)


def same_file(fd: int, path: str | Path) -> bool:
    """The open file `fd` is the one at `path` (not one removed from there since it was opened)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def hold_run_lock(lock_path: Path, what: str) -> None:
    """The run's lock, taken once per run: by the `finetune` process (the ranks it launches inherit FINETUNE_LOCK and
    leave it to their parent), or under a bare torchrun launch by global rank 0."""
    key = str(Path(lock_path).resolve())
    if "RANK" in os.environ and (os.environ.get("FINETUNE_LOCK") == key or os.environ["RANK"] != "0"):
        return
    hold_lock(lock_path, what)
    os.environ["FINETUNE_LOCK"] = key


def pin_file(step: Path) -> Path:
    """Where checkpoint dir `step` is pinned: `.<step>.pin` beside it (the checkpoint's own files stay as saved)."""
    return Path(step).parent / f".{Path(step).name}.pin"


@contextmanager
def unpinned(step: Path):
    """Yields whether `step` is free to delete (no process pins it, see hold_pin), holding its pin exclusively
    meanwhile so that no reader pins it halfway; the pin file goes with the step."""
    path = pin_file(step)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # nobody can have pinned it where no pin file can be made
        yield True
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        free = True
    except BlockingIOError:
        free = False
    except OSError:  # a filesystem without locks
        free = True
    try:
        yield free
    finally:
        if free:
            path.unlink(missing_ok=True)
        os.close(fd)
