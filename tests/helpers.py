"""Run the real CLI in a subprocess (as users do) and read what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args, env: dict | None = None, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    # each CLI child imports torch/transformers: let them share compiled bytecode even where .pyc writing is off
    cache = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(Path(tempfile.gettempdir()) / "finetune-pycache")}
    full_env = {**os.environ, **cache, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "finetune", *map(str, args)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"finetune {' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir)]
