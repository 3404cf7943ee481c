"""Samples in a world-size-independent order: tokenize rows of one source (or several), shuffle, shard, pack."""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from typing import NamedTuple

import datasets
import numpy as np
import torch

from ..keys import ConfigError
from .formats import DataError, Rows, detect_format, load_rows, row_of, to_conversation
from .labels import DROP_REASONS, tokenize_messages
from .template import require_chat_template

_META = ("row", "turns", "split", "left_out", "source")  # where a sample comes from (see _entries)
PACK_WINDOW = 1000  # samples that best-fit-decreasing packs together: larger fills rows better, reorders more


class Source(NamedTuple):
    spec: dict  # path, split, name, format, and how much of it an epoch takes: weight | samples | epochs
    rows: Rows
    fmt: str


def open_sources(data: str | list[dict], *, fmt: str = "auto", split: str = "train", name: str | None = None,
                 load=load_rows) -> list[Source]:
    """The rows of `data` (a path, or source dicts: see build_samples) read by `load`, their format checked."""
    specs = [{"path": data, "split": split, "name": name, "format": fmt}] if isinstance(data, str) else data
    sources = []
    for spec in specs:
        rows = load(spec["path"], split=spec.get("split") or "train", name=spec.get("name") or None)
        sources.append(Source(spec, rows, detect_format(rows.columns, spec.get("format") or "auto")))
    return sources


def _best_fit_packs(items, max_len: int, window: int = PACK_WINDOW):
    """Best-fit-decreasing packing of (item, length) pairs, `window` pairs at a time: longest first, into the fullest
    row it fits (ties: the older), else a new row; rows keep input order and come in the order of their first item."""
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


def _new_counts() -> Counter:
    return Counter(dict(rows=0, kept=0, samples=0, turns_trained=0, **{f"dropped_{r}": 0 for r in DROP_REASONS}))


def _entries(labelled, row: int, source: int) -> list[dict]:
    """A row's samples with _META, length and drop (a dropped row: one empty entry); left_out goes with the first."""
    left_out = [f"{e.reason} {e}" for e in labelled.left_out]
    samples = labelled.samples or [{"input_ids": [], "labels": [], "turns": [], "split": ""}]
    return [{"starts": [], **s, "length": len(s["input_ids"]), "drop": labelled.dropped or "", "row": row,
             "left_out": [] if n else left_out, "source": source} for n, s in enumerate(samples)]


def _count(counts: dict, entries) -> None:
    counts["rows"] += 1
    reasons = [x.split(" ", 1)[0] for x in entries[0]["left_out"]]
    counts.update(f"turns_unsupported_{r}" for r in reasons)
    counts.update(f"rows_unsupported_{r}" for r in dict.fromkeys(reasons))
    if entries[0]["drop"]:
        counts[f"dropped_{entries[0]['drop']}"] += 1
        return
    counts.update(kept=1, samples=len(entries), turns_trained=sum(len(s["turns"]) for s in entries))
    counts.update(f"turns_split_{s['split']}" for s in entries if s["split"])


def describe_counts(counts: dict) -> str:
    """The counts as one line."""
    return ", ".join(f"dropped {k[8:]} {v}" if k.startswith("dropped_") else
                     f"turns left untrained {k[18:]} {v} (in {counts['rows_unsupported_' + k[18:]]} rows)"
                     if k.startswith("turns_unsupported_") else f"{k.replace('_', ' ')} {v}"
                     for k, v in counts.items() if not k.startswith("rows_unsupported_"))


def data_lines(samples) -> list[str]:
    """A sample stream's start-up lines, the first of its summary() (Mixture, Streamed): the files read, the counts."""
    lines = []
    for src in samples.sources:
        path, files, split = src.spec["path"], src.rows.files, src.spec.get("split") or "train"
        shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        where = f": {len(files)} file(s): {shown}" if files else " from the hub"
        lines.append(f"read {path}" if files == [path] else f"read {path} split {split}{where}")
    return lines + [describe_counts(samples.counts)]


def _labeller(source: Source, tokenizer, max_seq_len: int, on_unsupported: str, template_kwargs, labellers: dict,
              hint):
    def tokenize(item: dict, idx: int):
        row, where = row_of(item, source.spec["path"], idx)
        if source.fmt in labellers:  # a format a task labels its own way (dpo's pairs: tasks/pairs.py)
            return labellers[source.fmt](tokenizer, row, where, max_seq_len, on_unsupported, template_kwargs)
        conv = to_conversation(row, source.fmt, where)
        return tokenize_messages(tokenizer, conv.messages, max_seq_len, where, conv.tools, on_unsupported,
                                 template_kwargs, hint)
    return tokenize


class SampleStream(torch.utils.data.IterableDataset):
    """This rank's samples, forever (or epoch_limit epochs): global sample g (counted across epochs) goes to rank
    g % world_size, from global sample start_sample on. An epoch: the samples choose takes of each source, packed,
    then shuffled. `tokenizers[k](item, idx)` labels a row of sources[k]. Iterate it in the training process. A kind of
    stream overrides tokenize, choose and epoch_samples (data/mixture.py, data/streaming.py)."""
    open_sources = staticmethod(open_sources)  # how build_samples opens its sources

    def __init__(self, sources: list[Source], tokenizers, *, max_seq_len=2048, packing=False, shuffle=True, seed=0,
                 rank=0, world_size=1, start_sample=0, epoch_limit=None, num_proc=1, pack_window=PACK_WINDOW):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.shuffle, self.packing, self.max_seq_len = shuffle, packing, max_seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.start_sample, self.epoch_limit, self.pack_window = start_sample, epoch_limit, pack_window
        self.sources, self._tokenizers = sources, tokenizers
        self.counts = _new_counts()
        self.source_counts = [_new_counts() for _ in sources]
        self.num_samples: int | None = None
        self.tokenize(num_proc)

    def tokenize(self, num_proc: int) -> None:
        # Tokenize once; every epoch then only reorders sample indices.
        tokenizers, sources = self._tokenizers, self.sources
        seq, v = getattr(datasets, "List", datasets.Sequence), datasets.Value  # List is datasets>=4
        features = datasets.Features({
            "input_ids": seq(v("int32")), "labels": seq(v("int32")), "length": v("int32"), "drop": v("string"),
            "row": v("int64"), "turns": seq(v("int32")), "split": v("string"), "left_out": seq(v("string")),
            "source": v("int32"), "starts": seq(v("int32"))})

        def tokenize_batch(batch, indices, k):
            entries = [e for j, idx in enumerate(indices)
                       for e in _entries(tokenizers[k]({c: v[j] for c, v in batch.items()}, idx), idx, k)]
            return {name: [e[name] for e in entries] for name in features}

        # in memory, never read from a cache: a random fingerprint (datasets' own fallback) spares it hashing
        # tokenize_batch with dill, the tokenizers it holds included (~0.05 s a rank)
        fingerprint = datasets.fingerprint.generate_random_fingerprint
        parts = [src.rows.data.map(tokenize_batch, batched=True, batch_size=64, with_indices=True, fn_kwargs={"k": k},
                                   remove_columns=src.rows.data.column_names, features=features, keep_in_memory=True,
                                   load_from_cache_file=False, num_proc=num_proc if num_proc > 1 else None,
                                   new_fingerprint=fingerprint(), desc="Tokenizing") for k, src in enumerate(sources)]
        self._tok = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        self._units, self._unit_lengths = self._epoch_units()
        self.num_samples = len(self._units)

    def _epoch_units(self):
        """(an epoch's units in order, their real token counts): rows counted, sources chosen, interleaved, packed."""
        names = ("drop", "turns", "split", "left_out", "row", "source")
        entries = (dict(zip(names, values)) for values in zip(*(self._tok[c] for c in names)))
        lengths = np.asarray(self._tok["length"], dtype=np.int64)
        kept = [[] for _ in self.sources]
        for (k, _), group in itertools.groupby(enumerate(entries), key=lambda e: (e[1]["source"], e[1]["row"])):
            ids, group = zip(*group)
            _count(self.source_counts[k], group)
            if not group[0]["drop"]:
                kept[k] += ids
        for src, counts, ids in zip(self.sources, self.source_counts, kept):
            self.counts.update(counts)
            if not ids:
                raise DataError(f"{src.spec['path']}: no usable samples ({describe_counts(counts)})")
        order = self.choose(kept, lengths)
        if not self.packing:
            return order, lengths[order]
        units = list(_best_fit_packs(((int(i), int(lengths[i])) for i in order), self.max_seq_len, self.pack_window))
        return units, np.asarray([lengths[u].sum() for u in units], dtype=np.int64)

    def choose(self, kept: list[list[int]], lengths: np.ndarray) -> np.ndarray:
        """An epoch's samples in order: every usable one of the one source (a mixture's shares: data/mixture.py)."""
        if len(kept) > 1 or any(src.spec.get(k) for src in self.sources for k in ("weight", "samples", "epochs")):
            raise ConfigError("data.sources: a mixture's shares need finetune/data/mixture.py (its build_samples)")
        return np.asarray(kept[0], dtype=np.int64)

    def _assemble(self, samples: list[dict]) -> dict:
        unit = {k: [t for s in samples for t in s[k]] for k in ("input_ids", "labels")}
        if self.packing or samples[0].get("starts"):  # position_ids restart per sample (and per side of a pair):
            # transformers derives the block-diagonal attention from them
            bounds = [[*(s.get("starts") or [0]), len(s["input_ids"])] for s in samples]
            unit["position_ids"] = [p for b in bounds for a, z in zip(b, b[1:]) for p in range(z - a)]
        unit["sources"] = [{k: s[k] for k in _META} for s in samples]  # for the preview; the collator ignores it
        return unit

    def _order(self, epoch: int) -> np.ndarray:
        n = self.num_samples
        return np.random.default_rng(self.seed + epoch).permutation(n) if self.shuffle else np.arange(n)

    def unit_lengths(self, epoch: int = 0) -> np.ndarray:
        """Real tokens of each global unit of an epoch, in global order (not streaming)."""
        return self._unit_lengths[self._order(epoch)]

    def epoch_samples(self, epoch: int, g0: int):
        n, order = self.num_samples, self._order(epoch)
        first = max(0, self.start_sample - g0)
        first += (self.rank - g0 - first) % self.world_size
        for p in range(first, n, self.world_size):
            unit = self._units[order[p]]
            rows = self._tok[[int(unit)] if not self.packing else unit]
            yield self._assemble([dict(zip(rows, values)) for values in zip(*rows.values())])
        return n

    def __iter__(self):
        g0, epoch = 0, 0
        while self.epoch_limit is None or epoch < self.epoch_limit:
            if self.num_samples is not None and g0 + self.num_samples <= self.start_sample:
                n = self.num_samples  # the whole epoch lies before the resume point
            else:
                n = yield from self.epoch_samples(epoch, g0)
            g0, epoch = g0 + n, epoch + 1


def build_samples(data: str | list[dict], tokenizer, *, fmt="auto", split="train", name=None, max_seq_len=2048,
                  on_unsupported="error", chat_template_kwargs=None, labellers: dict | None = None, hint=None,
                  stream=SampleStream, **order) -> SampleStream:
    """This rank's samples of `data` (a path: fmt, split, name apply; or source dicts: path, split, name, format) by
    `stream` (SampleStream, data/mixture.py's, data/streaming.py's) given `order`; `hint`: tokenize_messages'.
    `labellers`: {format: fn(tokenizer, row, where, max_seq_len, on_unsupported, template_kwargs) -> Labelled}."""
    require_chat_template(tokenizer, data if isinstance(data, str) else "data.sources")
    sources = stream.open_sources(data, fmt=fmt, split=split, name=name)
    tokenizers = [_labeller(src, tokenizer, max_seq_len, on_unsupported, chat_template_kwargs, labellers or {}, hint)
                  for src in sources]
    return stream(sources, tokenizers, max_seq_len=max_seq_len, **order)
