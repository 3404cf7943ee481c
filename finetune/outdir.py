"""Output directories written whole (prepared checkpoints, exports): refuse to overwrite what we did not write,
and publish a finished temporary directory by rename, so the output is the old one or the new one, never half."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .config import ConfigError


def check_output_dir(out: Path, marker: str, kind: str) -> None:
    """`out` is missing, empty, or an earlier `kind` (it holds `marker`), which the new one will replace."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out} is a file")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise ConfigError(f"--output-dir {out} is not empty and not {kind} (no {marker}); refusing to overwrite it: "
                          f"pick another directory")


def publish_dir(new: Path, out: Path) -> None:
    """Move the finished `new` to `out`; an empty or earlier `out` is replaced (the old one removed only after)."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    elif out.is_dir():
        out.rmdir()
    new.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
