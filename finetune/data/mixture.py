"""Data mixtures (data.sources): each source's share of an epoch (weight, samples or epochs), interleaved evenly."""
from __future__ import annotations

import math
from functools import partial

import numpy as np

from . import DataError, build_samples as build_one, describe_counts
from .stream import SampleStream
from .stream import data_lines

MAX_EPOCH_SAMPLES = 2**32  # of one source (8 bytes each: 32 GiB of indices)


def mixture_sizes(specs: list[dict], sizes: list[int]) -> list[int]:
    """Samples each source gives an epoch, from its size: `samples`; else `epochs` x size; the weighted sources share
    their pooled samples by weight; none of the three: epochs=1."""
    pooled = sum(m for spec, m in zip(specs, sizes) if spec.get("weight"))
    weights = sum(spec.get("weight") or 0 for spec in specs)

    def share(w):  # pooled * w overflows for a weight near the float maximum: then the ratio first
        return pooled * w / weights if math.isfinite(pooled * w) else pooled * (w / weights)
    counts = [spec["samples"] if spec.get("samples") else share(spec["weight"]) if spec.get("weight")
              else (spec.get("epochs") or 1) * m for spec, m in zip(specs, sizes)]
    for k, n in enumerate(counts):
        if not n <= MAX_EPOCH_SAMPLES:  # an epoch's sample indices are held in memory
            raise DataError(f"data.sources[{k}] ({specs[k]['path']}): {n:.3g} samples an epoch, more than "
                            f"{MAX_EPOCH_SAMPLES:,} can be held; lower its samples or epochs")
    return [round(n) for n in counts]


class Mixture(SampleStream):
    """A SampleStream whose epoch takes mixture_sizes' samples of each source (the source n // size times, then a
    fixed part of it), interleaved evenly in file order."""
    shares: list[tuple[int, int]] | tuple = ()  # each source's samples and real tokens an epoch (none when streaming)

    def choose(self, kept: list[list[int]], lengths: np.ndarray) -> np.ndarray:
        chosen, self.shares = [], []
        for k, (ids, n) in enumerate(zip(kept, mixture_sizes([s.spec for s in self.sources], list(map(len, kept))))):
            reps, rest = divmod(n, len(ids))
            part = np.sort(np.random.default_rng([self.seed, k]).choice(len(ids), rest, replace=False))
            chosen.append(np.concatenate([np.tile(ids, reps), np.asarray(ids)[part]]).astype(np.int64))
            self.shares.append((n, int(lengths[chosen[-1]].sum())))
        # interleaved evenly: the j-th of a source's n samples at (j + 0.5) / n of the epoch
        at = np.concatenate([(np.arange(len(c)) + 0.5) / len(c) for c in chosen if len(c)])
        order = np.concatenate(chosen)[np.argsort(at, kind="stable")]
        if not len(order):
            raise DataError(f"{', '.join(src.spec['path'] for src in self.sources)}: an epoch of this mixture holds no "
                            f"sample")
        return order

    def summary(self) -> list[str]:
        """Start-up lines: the files read, the counts, then each source's share of an epoch."""
        total_samples, total_tokens = (sum(x) for x in zip(*self.shares)) if self.shares else (0, 0)
        return data_lines(self) + ([
            f"source {k} {src.spec['path']}: {n} samples an epoch ({n / total_samples:.1%}), "
            f"{t / max(total_tokens, 1):.1%} of tokens; {describe_counts(counts)}"
            for k, (src, (n, t), counts) in enumerate(zip(self.sources, self.shares, self.source_counts))]
            if len(self.sources) > 1 and total_samples else [])


build_samples = partial(build_one, stream=Mixture)  # data.build_samples, a list of sources mixed
