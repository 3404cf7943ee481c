"""Batches: right-pad (or keep packed position_ids), with the boundaries of the samples in them."""

from __future__ import annotations

import numpy as np
import torch

from .labels import IGNORE_INDEX


def pad_collate(samples: list[dict], pad_id: int, pad_to: int | None = None) -> dict:
    """Right-pad to the longest sample (or pad_to), with sample_boundaries. Packed samples (with position_ids) get no
    attention_mask: transformers builds the block-diagonal mask from the position_ids restarts (use_cache=False)."""
    longest = max(len(s["input_ids"]) for s in samples)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest sample ({longest} tokens)")
    fills = {"input_ids": pad_id, "labels": IGNORE_INDEX, "position_ids": 0, "attention_mask": 0}
    batch = {k: torch.full((len(samples), width), fill, dtype=torch.long) for k, fill in fills.items()}
    lengths = []
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        for k in ("input_ids", "labels"):
            batch[k][i, :n] = torch.as_tensor(s[k])
        batch["position_ids"][i, :n] = torch.as_tensor(s["position_ids"]) if "position_ids" in s else torch.arange(n)
        batch["attention_mask"][i, :n] = 1
        starts = np.flatnonzero(np.asarray(s.get("position_ids", [0])) == 0).tolist()
        lengths += np.diff(starts + [n]).tolist() + [width - n] * (width > n)
    if any("position_ids" in s for s in samples):
        del batch["attention_mask"]
    return {**batch, **sample_boundaries(lengths)}


def sample_boundaries(lengths: list[int]) -> dict:
    """(host) flash-attention's varlen kwargs (int32 `cu_seq_lens_q`/`_k`, int `max_length_q`/`_k`) from the lengths
    of the segments of the flattened (batch x seq) tokens: each row's samples, then its padding as one."""
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}


def batch_efficiency(lengths, micro_batch_size: int, num_ranks: int, pad_to: int | None = None) -> float:
    """Real / computed tokens of units of these lengths (in global order) batched as train does: unit g on rank
    g % num_ranks, micro_batch_size of a rank per micro-batch, padded to its longest (or pad_to); whole rounds only."""
    lengths = np.asarray(lengths, dtype=np.int64)
    group = micro_batch_size * num_ranks
    n = max(len(lengths) // group, 1) * group
    x = np.resize(lengths, n).reshape(-1, micro_batch_size, num_ranks)  # [micro-batch round, row, rank]
    width = x.max(axis=1) if pad_to is None else np.full(x[:, 0].shape, pad_to)
    return float(x.sum() / (width.sum() * micro_batch_size))

