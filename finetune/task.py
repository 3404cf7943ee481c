"""The one interface of a task (sft, dpo) on the loop: the `Task` its setup (build.task) returns for the built `Run`,
and the sample stream a run's config describes."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from .config import Config
from .data import build_samples
from .loss import collate_labelled, token_loss_sum


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
    gradient / the global "count" (default: label tokens); the statistics named in `means` are reported per count."""
    loss: Callable = sft_loss
    collate: Callable = collate_labelled  # (items, pad_id, width) -> a micro-batch (on the host)
    means: tuple = ()
    begin_step: Callable = lambda micro_batches, device: None  # before the step's first forward
    end_step: Callable = lambda: {}  # -> {statistic: float64 0-dim tensor}: after the backward (MoE's aux loss)
    evaluate_before: Callable | None = None  # () -> the held-out result before training (a fresh run only)
    evaluate_after: Callable | None = None  # (the result before, or None) -> the held-out result after training


def build_run_samples(cfg: Config, tokenizer, **kwargs):
    """The sample stream `cfg.data` describes (for sft, dpo, bench and preview-data alike)."""
    dc = cfg.data
    return build_samples([asdict(s) for s in dc.sources] or dc.path, tokenizer, fmt=dc.format, split=dc.split,
                         name=dc.name or None, max_seq_len=dc.max_seq_len, packing=dc.packing,
                         seed=cfg.train.seed, on_unsupported=dc.on_unsupported, num_proc=dc.num_proc,
                         chat_template_kwargs=dc.chat_template_kwargs, **kwargs)
