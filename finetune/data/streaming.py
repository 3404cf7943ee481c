"""Streamed data (data.streaming): rows read as training needs them, in file order, counted as they go by."""
from __future__ import annotations

from functools import partial

import datasets
import pyarrow.parquet as pq

from . import DataError, build_samples as build_one, describe_counts, load_rows, open_sources, row_of
from .formats import WHERE, Rows, _iter_rows, _no_rows
from .stream import SampleStream, _best_fit_packs, _count, _entries, _new_counts
from .stream import data_lines


def _iter_parquet(files):
    for file in files:
        for b, batch in enumerate(pq.ParquetFile(file).iter_batches(batch_size=1024)):
            for i, row in enumerate(batch.to_pylist()):
                yield {WHERE: f"{file} row {b * 1024 + i}", **row}


def _streamed(files):
    yield from (_iter_parquet(files) if files[0].endswith(".parquet") else (item for item, _ in _iter_rows(files)))


def _stream_files(path: str, split: str, files: list[str]) -> Rows:
    # A tuple, not a list: datasets would shard list gen_kwargs, and the order must stay the file order.
    data = datasets.IterableDataset.from_generator(_streamed, gen_kwargs={"files": tuple(files)})
    first = next(iter(data), None)
    if first is None:
        raise DataError(_no_rows(path, split, files))
    return Rows(data, list(row_of(first, path, 0)[0]), files)


load_streamed = partial(load_rows, stream=_stream_files)  # data.load_rows, as an IterableDataset


def open_streamed(data: str | list[dict], **kwargs) -> list:
    """data.open_sources, streamed: one source only."""
    if not isinstance(data, str) and len(data) > 1:
        raise DataError("data.sources: a mixture needs each source's size before it starts, so it cannot stream; set "
                        "data.streaming=false")
    return open_sources(data, load=load_streamed, **kwargs)


class Streamed(SampleStream):
    """A SampleStream of one source read as it goes: in file order (no shuffle), packed a window at a time; the
    number of samples an epoch and the counts are known after the first pass."""
    open_sources = staticmethod(open_streamed)

    def tokenize(self, num_proc: int) -> None:
        pass  # rows are labelled as they are read

    def epoch_samples(self, epoch: int, g0: int):
        first_pass = self.num_samples is None
        if first_pass:  # counts describe one pass over the data
            self.counts = _new_counts()

        def kept():
            for idx, item in enumerate(self.sources[0].rows.data):
                entries = _entries(self._tokenizers[0](item, idx), idx, 0)
                if first_pass:
                    _count(self.counts, entries)
                if not entries[0]["drop"]:
                    yield from ((s, s["length"]) for s in entries)

        units = (_best_fit_packs(kept(), self.max_seq_len, self.pack_window) if self.packing
                 else ([s] for s, _ in kept()))
        n = 0
        for n, unit in enumerate(units, 1):
            g = g0 + n - 1
            if g >= self.start_sample and g % self.world_size == self.rank:
                yield self._assemble(unit)
        if not n:
            raise DataError(f"{self.sources[0].spec['path']}: no usable samples ({describe_counts(self.counts)})")
        if first_pass:
            self.num_samples = n
        return n

    def summary(self) -> list[str]:
        """Start-up lines: the files read and the counts (of the rows read so far until a pass is done)."""
        lines = data_lines(self)
        if self.num_samples is None:
            lines[-1:] = ["streamed so far: " + lines[-1]] if self.counts["rows"] else []
        return lines


build_samples = partial(build_one, stream=Streamed)  # data.build_samples, streamed
