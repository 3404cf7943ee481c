"""Output dirs written whole (exports, prepared checkpoints): into a sibling temp dir, published by rename."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

from .config import ConfigError
from .errors import os_error_line


def check_output_dir(out: Path, marker: str, kind: str) -> None:
    """`out` is missing, empty, or an earlier `kind` (it holds `marker`), which the new one will replace."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise ConfigError(f"--output-dir {out} is not empty and not {kind} (no {marker}); refusing to overwrite it: "
                          f"pick another directory")


def publish_dir(new: Path, out: Path) -> None:
    """Move the finished `new` to `out`, replacing an empty or earlier `out` (removed only after)."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.is_dir():
        out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staging(out: Path, marker: str, locks=None):
    """On every rank: yields rank 0's sibling temp dir `.<name>.partial-<pid>` to write `out` into (`marker` last),
    published by rank 0 once the block has ended everywhere (under `locks`, run/pins, if given); on an error, not."""
    from .distributed import barrier, broadcast, is_main  # here: the CLI checks paths with this module before torch
    if not is_main():
        yield broadcast(None)
        barrier()
        return
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    with locks.guard(out) if locks else nullcontext():
        try:
            tmp.mkdir(parents=True)
            yield broadcast(tmp)
            barrier()  # every rank's files are written (and checked)
            locks.publish_dir(tmp, out, marker) if locks else publish_dir(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def check_writable(path: Path, what: str) -> None:
    """New files can be made in `path` (or its nearest existing parent; os.access passes root), or a ConfigError."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".finetune-write-check-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{what}: cannot write in {os_error_line(e, where)}") from None


def keep_beside(path: Path) -> Path | None:
    """Rename an earlier run's `path` to the first free `<path>.N`; returns the new name (None: nothing there)."""
    if not path.exists():
        return None
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.rename(path.with_name(f"{path.name}.{n}"))
