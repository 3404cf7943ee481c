"""Output directories written whole (prepared checkpoints, exports): refuse to overwrite what we did not write, write
into a sibling temp dir and publish it by rename, so the output is the old one or the new one, never half."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .config import ConfigError
from .errors import os_error_line
from .lock import hold_lock, release_lock, remove_stale_partials


def check_output_dir(out: Path, marker: str, kind: str) -> None:
    """`out` is missing, empty, or an earlier `kind` (it holds `marker`), which the new one will replace."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise ConfigError(f"--output-dir {out} is not empty and not {kind} (no {marker}); refusing to overwrite it: "
                          f"pick another directory")


def publish_dir(new: Path, out: Path, marker: str) -> None:
    """Move the finished `new` to `out`, its `marker` (JSON) listing the names in it as ours ("files"), replacing an
    empty or earlier `out` (removed only after) but moving into it first what the user added there (names the
    earlier marker does not list: an older finetune's, listing none, is ours whole)."""
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
def staging(out: Path, marker: str):
    """On every rank: yields rank 0's sibling temp dir `.<name>.partial-<pid>`, which they all write `out` into
    (`marker` last); once the block has ended everywhere, rank 0 publishes it (publish_dir), holding the lock
    `.<name>.lock` meanwhile (unless the launcher does) and first removing the temp dirs of runs killed -9. On an
    error the temp dir is removed and nothing is published."""
    from .distributed import barrier, broadcast, is_main  # here: the CLI checks paths with this module before torch
    if not is_main():
        yield broadcast(None)
        barrier()
        return
    lock, tmp = out.parent / f".{out.name}.lock", out.parent / f".{out.name}.partial-{os.getpid()}"
    own_lock = os.environ.get("FINETUNE_LOCK") != str(lock.resolve())  # else the launcher holds it for us
    if own_lock:
        hold_lock(lock, f"--output-dir {out}")
    try:
        remove_stale_partials(out.parent, out.name)
        tmp.mkdir(parents=True)
        yield broadcast(tmp)
        barrier()  # every rank's files are written (and checked)
        publish_dir(tmp, out, marker)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if own_lock:
            release_lock(lock)


def check_writable(path: Path, what: str) -> None:
    """New files can be made in `path` (or its nearest existing parent): checked at start-up by making one, so a
    read-only, full or forbidden place is one line now, not an OSError later. (Not os.access: root passes it.)"""
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
    """Rename an earlier run's `path` (file or dir) to the first free `<path>.N`, so that a fresh run deletes
    nothing; returns the new name (None: nothing was there)."""
    if not path.exists():
        return None
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.rename(path.with_name(f"{path.name}.{n}"))
