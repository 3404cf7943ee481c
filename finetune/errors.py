"""The errors finetune raises on purpose: one base class whose exit code the CLI ends with, after printing
`error: <message>` (one line). Bad input (config, paths, data, checkpoints) exits 2; a run that fails (a
non-finite loss, an export that does not verify) sets exit_code = 1."""
from __future__ import annotations


class FinetuneError(Exception):
    """Bad input; str(e) is one line that names the key, file, row or checkpoint and what is wrong."""

    exit_code = 2


def one_line(e: BaseException) -> str:
    """`Type: first line of the message`: a library's exception inside one of our one-line messages."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


class ModelError(FinetuneError, ValueError):
    """The model cannot be loaded or does not match; the message is one line."""
