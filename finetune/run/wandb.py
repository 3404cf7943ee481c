"""log.wandb: each step's metrics also to Weights & Biases on rank 0 (offline without WANDB_API_KEY)."""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from ..config import Config
from ..metrics import MetricsLogger


class WandbLogger(MetricsLogger):
    """metrics.jsonl, and with cfg.log.wandb a W&B run (project log.wandb_project, the config as its config)."""

    def __init__(self, output_dir: Path, start_step: int = 0, *, cfg: Config):
        super().__init__(output_dir, start_step)
        self.wandb = None
        if self.file and cfg.log.wandb:  # rank 0
            import wandb
            if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
                os.environ["WANDB_MODE"] = "offline"  # never fail (or prompt) for a missing key
            self.wandb = wandb.init(project=cfg.log.wandb_project, dir=str(output_dir), config=asdict(cfg))

    def log(self, record: dict) -> None:
        super().log(record)
        if self.wandb:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        super().close()
        if self.wandb:
            self.wandb.finish()
