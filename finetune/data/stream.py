"""Samples in a world-size-independent order: tokenize rows (one row may give several samples), shuffle, shard, pack."""

from __future__ import annotations

import bisect
import collections
import itertools

import datasets
import numpy as np
import torch

from .formats import DataError, columns_of, detect_format, load_rows, locate, to_conversation
from .labels import DROP_REASONS, tokenize_messages

_META = ("row", "turns", "split")  # where a sample comes from: row index, trained message indices, why split out


PACK_WINDOW = 1000  # samples that best-fit-decreasing packs together: larger fills rows better, reorders more


def _best_fit_packs(items, max_len: int, window: int = PACK_WINDOW):
    """Best-fit-decreasing packing of (item, length) pairs (each length <= max_len), one window of `window`
    consecutive pairs at a time: longest first, each into the fullest row it fits (ties: the older row), else a
    new row. Each row keeps its items in input order; rows come in the order of their first item. Deterministic,
    and the same whatever reads it (so the same on every rank)."""
    it = iter(items)
    while chunk := list(itertools.islice(it, window)):
        rows: list[list[int]] = []
        free: list[tuple[int, int]] = []  # (space left, row), sorted: bisect finds the fullest row that fits
        for j in sorted(range(len(chunk)), key=lambda j: (-chunk[j][1], j)):
            k = bisect.bisect_left(free, (chunk[j][1], -1))
            space, r = free.pop(k) if k < len(free) else (max_len, len(rows))
            if r == len(rows):
                rows.append([])
            rows[r].append(j)
            bisect.insort(free, (space - chunk[j][1], r))
        for row in sorted(map(sorted, rows)):
            yield [chunk[j][0] for j in row]


def _count(counts: dict, samples: list[dict], reason: str | None) -> None:
    counts["rows"] += 1
    if reason:
        counts[f"dropped_{reason}"] = counts.get(f"dropped_{reason}", 0) + 1
        return
    counts["kept"] += 1
    counts["samples"] += len(samples)
    counts["turns_trained"] += sum(len(s["turns"]) for s in samples)
    for s in samples:
        if s["split"]:
            counts[f"turns_split_{s['split']}"] = counts.get(f"turns_split_{s['split']}", 0) + 1


def _new_counts() -> dict:
    return dict(rows=0, kept=0, samples=0, turns_trained=0, **{f"dropped_{r}": 0 for r in DROP_REASONS})


class SampleStream(torch.utils.data.IterableDataset):
    """This rank's samples, forever (or epoch_limit epochs). Global sample g (world-size independent, counted
    across epochs) goes to rank g % world_size; iteration starts at global sample start_sample. A row's samples
    follow each other in row order before shuffling. Iterate it in the training process (DataLoader num_workers=0):
    counts for streaming data are filled in as it goes. `tokenize(row, idx)` returns (samples, drop reason)."""

    def __init__(self, rows, tokenize, *, streaming, shuffle, packing, max_seq_len, seed, rank, world_size,
                 start_sample, epoch_limit, source, num_proc=1, pack_window=PACK_WINDOW):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.streaming, self.shuffle, self.packing, self.max_seq_len = streaming, shuffle, packing, max_seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.start_sample, self.epoch_limit, self.source = start_sample, epoch_limit, source
        self.pack_window = pack_window
        self._rows, self._tokenize = rows, tokenize
        self.counts = _new_counts()
        self.num_samples: int | None = None
        if streaming:
            return
        ints = getattr(datasets, "List", datasets.Sequence)(datasets.Value("int32"))  # List is datasets>=4
        features = datasets.Features({"input_ids": ints, "labels": ints, "length": datasets.Value("int32"),
                                      "drop": datasets.Value("string"), "row": datasets.Value("int64"),
                                      "turns": ints, "split": datasets.Value("string")})

        def tokenize_batch(batch, indices):  # one output per sample, or one placeholder naming why a row is dropped
            out = {k: [] for k in features}
            for j, idx in enumerate(indices):
                samples, reason = tokenize({k: v[j] for k, v in batch.items()}, idx)
                for s in samples or [{"input_ids": [], "labels": [], "turns": [], "split": ""}]:
                    entry = {**s, "length": len(s["input_ids"]), "drop": reason or "", "row": idx}
                    for k in features:
                        out[k].append(entry[k])
            return out

        # Tokenize once; every epoch then only reorders sample indices.
        self._tok = rows.map(tokenize_batch, batched=True, batch_size=64, with_indices=True,
                             remove_columns=rows.column_names, features=features, keep_in_memory=True,
                             load_from_cache_file=False, num_proc=num_proc if num_proc > 1 else None,
                             desc="Tokenizing")
        drops, turns, splits, row_ids = (self._tok[k] for k in ("drop", "turns", "split", "row"))
        kept = [i for i, d in enumerate(drops) if not d]
        reasons = collections.Counter(d for d in drops if d)
        kept_rows = len({row_ids[i] for i in kept})
        self.counts.update(rows=kept_rows + sum(reasons.values()), kept=kept_rows, samples=len(kept),
                           turns_trained=sum(len(turns[i]) for i in kept),
                           **{f"turns_split_{k}": v for k, v in sorted(collections.Counter(
                               splits[i] for i in kept if splits[i]).items())},
                           **{f"dropped_{r}": n for r, n in reasons.items()})
        lengths = np.asarray(self._tok["length"], dtype=np.int64)
        if packing:  # pack once in file order, then shuffle the packs each epoch: a constant epoch length
            self._units = list(_best_fit_packs(((i, int(lengths[i])) for i in kept), max_seq_len, pack_window))
            self._unit_lengths = np.asarray([lengths[u].sum() for u in self._units], dtype=np.int64)
        else:
            self._units = np.asarray(kept, dtype=np.int64)
            self._unit_lengths = lengths[self._units]
        self.num_samples = len(self._units)
        if not self.num_samples:
            raise DataError(f"{source}: no usable samples ({self.counts})")

    def _assemble(self, samples: list[dict]) -> dict:
        unit = {k: [t for s in samples for t in s[k]] for k in ("input_ids", "labels")}
        if self.packing:  # position_ids restart per sample: transformers derives the block-diagonal attention from them
            unit["position_ids"] = [p for s in samples for p in range(len(s["input_ids"]))]
        unit["sources"] = [{k: s[k] for k in _META} for s in samples]  # for the preview; the collator ignores it
        return unit

    def _order(self, epoch: int) -> np.ndarray:
        n = self.num_samples
        return np.random.default_rng(self.seed + epoch).permutation(n) if self.shuffle else np.arange(n)

    def unit_lengths(self, epoch: int = 0) -> np.ndarray:
        """Real tokens of each global unit (sample, or packed row) of an epoch, in global order (not streaming)."""
        return self._unit_lengths[self._order(epoch)]

    def _epoch_indexed(self, epoch: int, g0: int):
        n, order = self.num_samples, self._order(epoch)
        first = max(0, self.start_sample - g0)
        first += (self.rank - g0 - first) % self.world_size
        for p in range(first, n, self.world_size):
            unit = self._units[order[p]]
            rows = self._tok[[int(unit)] if not self.packing else unit]
            yield self._assemble([dict(zip(rows, values)) for values in zip(*rows.values())])
        return n

    def _epoch_streamed(self, g0: int):
        first_pass = self.num_samples is None
        if first_pass:  # counts describe one pass over the data
            self.counts = _new_counts()

        def kept():
            for idx, row in enumerate(self._rows):
                samples, reason = self._tokenize(row, idx)
                if first_pass:
                    _count(self.counts, samples, reason)
                for s in samples:
                    yield {**s, "row": idx}, len(s["input_ids"])

        units = (_best_fit_packs(kept(), self.max_seq_len, self.pack_window) if self.packing
                 else ([s] for s, _ in kept()))
        n = 0
        for n, unit in enumerate(units, 1):
            g = g0 + n - 1
            if g >= self.start_sample and g % self.world_size == self.rank:
                yield self._assemble(unit)
        if not n:
            raise DataError(f"{self.source}: no usable samples ({self.counts})")
        if first_pass:
            self.num_samples = n
        return n

    def __iter__(self):
        g0, epoch = 0, 0
        while self.epoch_limit is None or epoch < self.epoch_limit:
            if self.num_samples is not None and g0 + self.num_samples <= self.start_sample:
                n = self.num_samples  # the whole epoch lies before the resume point
            elif self.streaming:
                n = yield from self._epoch_streamed(g0)
            else:
                n = yield from self._epoch_indexed(epoch, g0)
            g0, epoch = g0 + n, epoch + 1


def build_samples(path, tokenizer, *, fmt="auto", split="train", name=None, streaming=False, max_seq_len=2048,
                  packing=False, shuffle=True, seed=0, rank=0, world_size=1, start_sample=0,
                  epoch_limit=None, on_unsupported="error", num_proc=1, pack_window=PACK_WINDOW) -> SampleStream:
    """This rank's tokenized (optionally packed) samples; see SampleStream for the order contract.
    Non-streaming data is tokenized up front (num_proc workers) and shuffled per epoch (seed + epoch) when shuffle;
    streaming data is read lazily in file order (never shuffled), so it matches non-streaming with shuffle=False.
    Rows the chat template cannot hold stop with a DataError (on_unsupported="error") or are dropped and counted."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{path}: the tokenizer has no chat template; use a chat/instruct model's tokenizer")
    rows = load_rows(path, split=split, name=name, streaming=streaming)
    fmt = detect_format(columns_of(rows), fmt)

    def tokenize(row: dict, idx: int):
        where = f"{path} row {idx}"
        try:
            conv = to_conversation(row, fmt, where)
            return tokenize_messages(tokenizer, conv.messages, max_seq_len, where, conv.tools, on_unsupported)
        except DataError as e:  # name the row's file and line (a directory holds several files)
            if not str(e).startswith(where):
                raise
            raise DataError(locate(path, idx) + str(e)[len(where):]) from e

    return SampleStream(rows, tokenize, streaming=streaming, shuffle=shuffle and not streaming, packing=packing,
                        max_seq_len=max_seq_len, seed=seed, rank=rank, world_size=world_size,
                        start_sample=start_sample, epoch_limit=epoch_limit, source=path, num_proc=num_proc,
                        pack_window=pack_window)
