"""The errors finetune raises on purpose: the CLI prints `error: <message>` (one line) and exits with exit_code: 2 for
bad input, 1 for a run that fails."""
from __future__ import annotations

import errno


class FinetuneError(Exception):
    """Bad input; str(e) is one line that names the key, file, row or checkpoint and what is wrong."""

    exit_code = 2
    on_rank0 = False  # True: rank 0 raises it whenever another rank does, and alone prints it


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (two when the first ends with ':'), for a library's exception."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# OS errors about the files we read and write (not bugs): reported as one line naming the file, wherever they occur
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def os_error_line(e: OSError, path=None) -> str:
    """`<path>: <cause> (<ERRNO>)`; the path is the error's own unless given (none: the cause alone)."""
    where = path or (f"{e.filename} -> {e.filename2}" if e.filename2 else e.filename)
    cause = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
    return f"{where}: {cause}" if where else cause


class ModelError(FinetuneError, ValueError):
    """The model cannot be loaded or does not match; the message is one line."""
