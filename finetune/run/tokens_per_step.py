"""train.tokens_per_step: a step of that many packed tokens, as micro-batches per rank (train.train)."""
from __future__ import annotations

from ..config import Config, ConfigError


def accum_steps(micro_batch_size: int, grad_accum_steps: int, tokens_per_step: int, max_seq_len: int,
                num_ranks: int) -> int:
    """Micro-batches per rank per step; with tokens_per_step, its rows / (ranks x micro_batch_size)."""
    if not tokens_per_step:
        return grad_accum_steps
    rows = tokens_per_step // max_seq_len
    if rows % (micro_batch_size * num_ranks):
        raise ConfigError(f"train.tokens_per_step={tokens_per_step} is {rows} rows of data.max_seq_len={max_seq_len}, "
                          f"not a multiple of train.micro_batch_size ({micro_batch_size}) x ranks ({num_ranks})")
    return rows // (micro_batch_size * num_ranks)


def run_accum(cfg: Config, num_ranks: int) -> int:
    """The micro-batches per rank of a step of cfg's train.tokens_per_step on `num_ranks` data ranks."""
    tc = cfg.train
    return accum_steps(tc.micro_batch_size, tc.grad_accum_steps, tc.tokens_per_step, cfg.data.max_seq_len, num_ranks)
