"""Batches: right-pad (or keep packed position_ids), with the boundaries of the samples in them."""

from __future__ import annotations

import numpy as np
import torch

from .labels import IGNORE_INDEX


def pad_collate(samples: list[dict], pad_id: int, pad_to: int | None = None) -> dict:
    """Right-pad to the longest sample (or pad_to), with sample_boundaries; packed samples (position_ids): no mask."""
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
