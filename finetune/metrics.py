"""Step metrics: peak memory, and the sinks (metrics.jsonl, console) on rank 0."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path

import torch

from .distributed import is_main, print0
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


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on rank 0 when stderr is a terminal (or FINETUNE_PROGRESS is set); None otherwise."""
    if not (enabled and is_main()):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, desc="sft", dynamic_ncols=True, file=sys.stderr,
                disable=not sys.stderr.isatty() and not os.environ.get("FINETUNE_PROGRESS"))


def report(bar, record: dict, log_interval: int, max_steps: int) -> None:
    """Advance the bar; every log_interval steps, one console line."""
    line = (f"step {record['step']:>5}/{max_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:.0f} tok/s "
            f"({record['tokens_per_s_per_gpu']:.0f}/device" + (f", MFU {record['mfu']:.1%}" if "mfu" in record else "")
            + f") | mem {record['peak_mem_mb']:.0f} MB"
            + (f" | reward acc {record['accuracy']:.2f} margin {record['margin']:.3f}" if "accuracy" in record else "")
            + (f" | aux loss {record['aux_loss']:.4f}" if "aux_loss" in record else ""))
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}")
    if record["step"] % log_interval == 0 or record["step"] == max_steps:
        (bar.write if bar is not None and not bar.disable else print0)(line)
