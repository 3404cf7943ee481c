"""Fingerprints of a model's weights: what a LoRA checkpoint and a prepared dir record of the base they came from."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..weights import MANIFEST, is_prepared
from ..weights import INDEX
from ..hub import local_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")


def base_fingerprint(path: str) -> str:
    """weights.fingerprint of the model at `path` (a prepared checkpoint's: its source's)."""
    if is_prepared(path):
        return json.loads((Path(path) / MANIFEST).read_text())["source"]["fingerprint"]
    return fingerprint(local_dir(path))


def fingerprint(directory: Path, num_reads: int = 64) -> str:
    """sha256 of the weight files' names and sizes and of `num_reads` 4 KiB reads spread over each (<1 s for a 70B
    model; a change confined to bytes between the reads goes unseen)."""
    h = hashlib.sha256()
    for f in sorted(directory.rglob("*")):
        if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name in (".metadata", INDEX)):
            size = f.stat().st_size
            h.update(f"{f.relative_to(directory)}:{size}\n".encode())
            with open(f, "rb") as file:
                for i in range(num_reads):
                    file.seek(size * i // num_reads)
                    h.update(file.read(4096))
    return "sha256:" + h.hexdigest()
