"""Batches and the preview: right-pad (or keep packed position_ids), and decoded samples with trained text marked."""

from __future__ import annotations

import itertools

import torch

from .labels import IGNORE_INDEX


def pad_collate(samples: list[dict], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample (or pad_to). Packed samples (with position_ids) get no attention_mask:
    transformers then builds the block-diagonal causal mask from the position_ids restarts (call the model with
    use_cache=False: a cache disables that detection)."""
    longest = max(len(s["input_ids"]) for s in samples)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest sample ({longest} tokens)")
    fills = {"input_ids": pad_id, "labels": IGNORE_INDEX, "position_ids": 0, "attention_mask": 0}
    batch = {k: torch.full((len(samples), width), fill, dtype=torch.long) for k, fill in fills.items()}
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        for k in ("input_ids", "labels"):
            batch[k][i, :n] = torch.as_tensor(s[k])
        batch["position_ids"][i, :n] = torch.as_tensor(s["position_ids"]) if "position_ids" in s else torch.arange(n)
        batch["attention_mask"][i, :n] = 1
    if any("position_ids" in s for s in samples):
        del batch["attention_mask"]
    return batch


def format_preview(tokenizer, sample: dict, color: bool = True) -> str:
    """The decoded sample with trained tokens highlighted (ANSI green, or [[...]] without color), then counts."""
    ids, labels = list(sample["input_ids"]), list(sample["labels"])
    parts = []
    for trained, group in itertools.groupby(zip(ids, labels), key=lambda t: t[1] != IGNORE_INDEX):
        text = tokenizer.decode([t for t, _ in group], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        parts.append((f"\x1b[30;42m{text}\x1b[0m" if color else f"[[{text}]]") if trained else text)
    trained = sum(x != IGNORE_INDEX for x in labels)
    return "".join(parts) + f"\ntrained tokens: {trained} / total: {len(ids)}"
