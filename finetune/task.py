"""What a caller passes to train.train: the `Recipe`, and the `Task` its setup returns for the built `Run`."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from .checkpoint import Checkpointer
from .loss import collate_labelled, token_loss_sum
from .metrics import MetricsLogger
from .model import Transforms, load_tokenizer


class Run(NamedTuple):
    """What a task's setup may use: the built run, before its first step."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tokenizer: object
    dims: object  # distributed.ParallelDims
    device: torch.device
    out: Path
    resume_dir: Path | None


def sft_loss(model, batch: dict) -> tuple[torch.Tensor, dict]:
    """The summed token loss at the label positions; normalised by the global label-token count (no "count")."""
    return token_loss_sum(model, batch), {}


@dataclass
class Task:
    """What a task does on the loop (default: sft). `loss(model, batch)` -> (summed loss, {statistic: 0-dim sum}), the
    gradient / the global "count" (default: label tokens); reported: `means` per count, `totals` as sums."""
    loss: Callable = sft_loss
    collate: Callable = collate_labelled  # (items, pad_id, width) -> a micro-batch (on the host)
    means: tuple = ()
    totals: tuple = ()
    begin_step: Callable = lambda micro_batches, device: None  # before the step's first forward
    clip: Callable | None = None  # (model, max_norm) -> the grad norm, for parameters on several device meshes
    end_step: Callable = lambda: {}  # -> {statistic: float64 0-dim tensor}: after the backward (MoE's aux loss)
    evaluate_before: Callable | None = None  # () -> the held-out result before training (a fresh run only)
    evaluate_after: Callable | None = None  # (the result before, or None) -> the held-out result after training


@dataclass
class Recipe:
    """A run as its caller configures it (finetune.build.recipe fills it from the config; the defaults: bare sft)."""
    name: str = "sft"
    setup: Callable = lambda cfg, run: Task()  # (cfg, Run) -> Task, once the model is built
    transforms: Callable = lambda cfg, dims, device: Transforms()  # -> model.Transforms
    export: dict = field(default_factory=dict)  # export_hf's hooks (adapters=, check=) for the final export
    samples: dict = field(default_factory=dict)  # build_samples' labellers= (formats labelled otherwise), stream=
    tokenizer: Callable = lambda cfg, resume_dir: (load_tokenizer(cfg.model.path, cfg.model.trust_remote_code), None)
    accum: Callable | None = None  # (cfg, data ranks) -> micro-batches per rank per step, for train.tokens_per_step
    mfu: Callable | None = None  # (model, device) -> (micro-batches -> {key: FLOPs per token}, peak FLOP/s or None)
    logger: Callable = MetricsLogger  # (out, start_step=) -> the step-metrics logger (run/wandb.py's: also to W&B)
    report: Callable | None = None  # (cfg, model, samples, dims, device, global batch, TrainState) -> the console:
    # prints the start-up lines; a context (the progress bar) whose value is called with each step's record
    checkpointer: Callable = Checkpointer  # (root, keep=, lora=, run=, locks=) -> it (run/saving.py's: async saves)
    resume_note: Callable = lambda saved, cfg, samples_seen: None  # (saved config, ...) -> a resumed run's line or None
