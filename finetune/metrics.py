"""Step metrics: peak memory, and the metrics.jsonl sink on rank 0."""
from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

from .distributed import is_main
from .outdir import keep_beside

def peak_mem_mb(device: torch.device) -> float:
    """CUDA: max allocated since start; CPU: this process's peak RSS."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak_rss_mb()


def peak_rss_mb() -> float:
    """This process's peak RSS in MiB: VmHWM (ru_maxrss would count the parent's RSS at fork/exec time)."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.exists() else []:
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20  # macOS: bytes


def repair_metrics(path: Path, start_step: int) -> None:
    """On resume: keep the records up to the checkpoint's step and drop half-written lines, saying so (atomically)."""
    kept, bad = [], []
    for n, line in enumerate(path.read_bytes().decode("utf-8", "replace").splitlines(keepends=True), 1):
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, TypeError, KeyError):
            if line.strip():
                bad.append(n)
            continue
        if step <= start_step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if bad:
        print(f"{path}: dropped {len(bad)} unreadable line(s) (line {', '.join(map(str, bad[:5]))}), "
              f"e.g. half-written by a killed run", flush=True)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.rename(path)


class MetricsLogger:
    """Writes one JSON object per optimizer step to metrics.jsonl (append, so resumed runs continue it)."""

    def __init__(self, output_dir: Path, start_step: int = 0):
        self.file = None
        if not is_main():
            return
        path = Path(output_dir) / "metrics.jsonl"
        if start_step == 0:  # an earlier fresh run: keep it beside, never overwrite
            keep_beside(path)
        elif path.exists():
            repair_metrics(path, start_step)
        self.file = open(path, "a")

    def log(self, record: dict) -> None:
        if self.file:  # strict JSON: a non-finite value (a skipped step's loss) is null, not NaN
            strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            try:
                self.file.write(json.dumps(strict, allow_nan=False) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk: write() names no file; the one-line error (launch.guarded) names it
                e.filename = e.filename or self.file.name
                raise

    def close(self) -> None:
        if self.file:
            self.file.close()
