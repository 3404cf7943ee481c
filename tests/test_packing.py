"""Packing (on by default): best-fit-decreasing rows, their order on any world size, train.tokens_per_step steps,
the padding fraction of each step, and exact resume of packed runs. In-process (run_ranks) throughout."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from _tokenizers import build_tokenizer
from finetune.config import Config, ConfigError
from finetune.data import build_samples
from finetune.data.stream import _best_fit_packs
from finetune.data.streaming import build_samples as build_streamed
from finetune.run.report import batch_efficiency
from finetune.model import load_tokenizer
from finetune.run.tokens_per_step import accum_steps
from helpers import invoke, read_metrics, run_ranks, sft, sft_config, train_rank

TOK = build_tokenizer("llama3")
SEQ = ("data.max_seq_len=256",)  # rows of 2-3 samples of the test data (tiny.toml's 128 holds about one)


def rows_of(lengths, max_len, window=1000):
    return list(_best_fit_packs(enumerate(lengths), max_len, window))


def test_best_fit_decreasing_by_hand():
    # longest first: 5 -> new row A, 4 -> new row B, 3 -> A (fullest that fits, 0 left), 3 -> B (1 left),
    # 2 -> new row C, 2 -> C, 1 -> B (the fullest row it fits, not the first). Rows in input order.
    assert rows_of([5, 4, 3, 3, 2, 2, 1], 8) == [[0, 2], [1, 3, 6], [4, 5]]
    assert rows_of([8, 8], 8) == [[0], [1]]


@pytest.mark.parametrize("window", [1, 7, 1000])
def test_best_fit_rows_keep_every_sample_once_within_capacity(window):
    rng = random.Random(window)
    lengths = [min(1024, max(1, int(rng.lognormvariate(5.4, 0.6)))) for _ in range(1500)]
    rows = rows_of(lengths, 1024, window)
    flat = [i for r in rows for i in r]
    assert sorted(flat) == list(range(len(lengths)))  # none lost, none twice
    assert all(sum(lengths[i] for i in r) <= 1024 for r in rows)
    assert all(r == sorted(r) for r in rows) and [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert all(r[0] // window == r[-1] // window for r in rows)  # a row never mixes windows
    assert rows == rows_of(lengths, 1024, window)  # deterministic
    efficiency = sum(lengths) / (len(rows) * 1024)
    if window == 1:
        assert len(rows) == len(lengths)
    elif window == 1000:  # the default window fills rows almost completely on lognormal lengths (mean ~260)
        assert efficiency > 0.97, efficiency
    # a row is opened only for a sample no earlier row has room for (rows only fill up afterwards)
    opened_by = [min((-lengths[i], i) for i in r) for r in rows]
    for (ka, a), (kb, b) in itertools.combinations(sorted(zip(opened_by, rows)), 2):
        if a[0] // window == b[0] // window:
            assert 1024 - sum(lengths[i] for i in a) < -kb[0]


def test_packed_order_is_world_size_independent_streamed_or_not_with_small_windows(chat_file):
    def packs(build=build_samples, **kw):
        return [tuple(x["input_ids"]) for x in build(str(chat_file), TOK, max_seq_len=512, packing=True, pack_window=9,
                                                     epoch_limit=2, **kw)]
    ref = packs()
    for world in (2, 3):
        per_rank = [packs(rank=r, world_size=world) for r in range(world)]
        assert [per_rank[g % world][g // world] for g in range(len(ref))] == ref
    assert packs(shuffle=False) == packs(build_streamed)
    s = build_samples(str(chat_file), TOK, max_seq_len=512, packing=True, pack_window=9)
    plain = build_samples(str(chat_file), TOK, max_seq_len=512)
    assert s.unit_lengths().sum() == plain.unit_lengths().sum() and s.num_samples < plain.num_samples / 2


def test_batch_efficiency_is_real_over_computed_tokens():
    # 2 ranks, micro-batch 2: micro-batch round k holds global units 4k..4k+3, rank 0 [4k, 4k+2], rank 1 [4k+1, 4k+3]
    lengths = [10, 3, 4, 5, 6, 6, 6, 1]
    computed = 2 * (10 + 5) + 2 * (6 + 6)
    assert batch_efficiency(lengths, 2, 2) == pytest.approx(sum(lengths) / computed)
    assert batch_efficiency(lengths, 1, 1) == 1.0
    assert batch_efficiency(lengths, 2, 2, pad_to=16) == pytest.approx(sum(lengths) / (8 * 16))


def test_tokens_per_step_forms_steps_of_rows():
    assert accum_steps(2, 1, 0, 128, 2) == 1  # off: grad_accum_steps as set
    assert accum_steps(2, 1, 8 * 128, 128, 2) == 2  # 8 rows: 2 ranks x 2 rows x 2 micro-batches
    assert accum_steps(1, 1, 8 * 128, 128, 1) == 8
    with pytest.raises(ConfigError, match=r"tokens_per_step=768 is 6 rows .*micro_batch_size \(4\) x ranks \(1\)"):
        accum_steps(4, 1, 6 * 128, 128, 1)


@pytest.mark.parametrize("args, expect", [
    (["train.tokens_per_step=1000"], "train.tokens_per_step=1000 must be a multiple of data.max_seq_len (128)"),
    (["train.tokens_per_step=1024", "data.packing=false"], "train.tokens_per_step=1024 needs data.packing=true"),
    (["train.tokens_per_step=1024", "train.grad_accum_steps=2"], "leave train.grad_accum_steps at 1 (got 2)"),
    (["train.tokens_per_step=-1"], "train.tokens_per_step must be >= 0 (0 = off), got -1"),
])
def test_bad_tokens_per_step_is_one_line_and_exit_2(args, expect, tmp_path, llama_dir):
    result = invoke("sft", "--output-dir", tmp_path / "out", "--model", llama_dir, *args)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], result.stderr


def test_packing_is_the_default():
    assert Config().data.packing


STRAIGHT = (*SEQ, "train.max_steps=8", "train.micro_batch_size=2")  # 2 ranks: 4 packed rows of 256 per step


def lengths_of(llama_dir, chat_file, packing: bool):
    """Real tokens of each global unit of the first two epochs, as the sft runs below order them (seed 0)."""
    s = build_samples(str(chat_file), load_tokenizer(str(llama_dir)), max_seq_len=256, packing=packing)
    return np.concatenate([s.unit_lengths(0), s.unit_lengths(1)])


def test_tokens_per_step_steps_and_resume_at_another_world_size(llama_dir, chat_file, tmp_path, reference, capsys):
    # tokens_per_step=1024 is 4 rows of 256: 2 ranks x micro-batch 2 x 1, or 1 rank x 2 x 2 (accum derived). Run 4
    # steps on 2 ranks, checkpoint, resume on 1: the data position is a count of packed rows, global across ranks.
    # (Resume on the same world size: test_checkpoint, packed by default.)
    straight = read_metrics(reference(llama_dir, chat_file, *STRAIGHT, nproc=2))
    per_step = (*SEQ, "train.micro_batch_size=2", "train.tokens_per_step=1024")
    out = tmp_path / "run"
    capsys.readouterr()
    head = sft(llama_dir, chat_file, out, *per_step, "train.max_steps=4", "checkpoint.interval=4", nproc=2)
    printed = capsys.readouterr().out
    assert "global batch 4 packed rows (<= 1024 tokens)" in printed
    both = lengths_of(llama_dir, chat_file, True)
    first_epoch = both[:len(both) // 2]
    efficiency = batch_efficiency(first_epoch, 2, 2)
    assert f"packing efficiency {efficiency:.1%} (real tokens / computed tokens, first epoch)" in printed
    tail = sft(llama_dir, chat_file, tmp_path / "one", *per_step, "train.max_steps=8",
               f"checkpoint.resume_from={out / 'checkpoints' / 'step-4'}")
    assert [r["step"] for r in head + tail] == list(range(1, 9))
    assert [r["num_tokens"] for r in head + tail] == [r["num_tokens"] for r in straight]
    assert [r["loss"] for r in head + tail] == pytest.approx([r["loss"] for r in straight], rel=1e-5)
    cfg = sft_config(llama_dir, chat_file, tmp_path / "bad", *SEQ, "train.micro_batch_size=3",
                     "train.tokens_per_step=1024")
    with pytest.raises(ConfigError, match=r"is 4 rows of data.max_seq_len=256, not a multiple"):
        run_ranks(train_rank, 2, cfg)


@pytest.mark.parametrize("packing", [True, False])
def test_padding_fraction_of_each_step(llama_dir, chat_file, tmp_path, reference, packing, capsys):
    if packing:  # 2 ranks x micro-batch 2 (the run above compares against)
        recs, mbs, nproc = read_metrics(reference(llama_dir, chat_file, *STRAIGHT, nproc=2)), 2, 2
    else:
        recs, mbs, nproc = sft(llama_dir, chat_file, tmp_path / "run", *SEQ, "train.max_steps=3",
                               "train.micro_batch_size=2", "train.grad_accum_steps=2", "data.packing=false"), 2, 1
    lengths = lengths_of(llama_dir, chat_file, packing)
    for k, r in enumerate(recs):  # each step's 4 units: real tokens / rows x their padded width, over every rank
        step = lengths[4 * k:4 * k + 4]
        assert r["padding_fraction"] == pytest.approx(1 - batch_efficiency(step, mbs, nproc)), k
    assert len(recs) >= 3 and any(r["padding_fraction"] > 0 for r in recs)
    if not packing:  # resuming an unpacked run packed (the default) says that the data position changes meaning
        capsys.readouterr()
        sft(llama_dir, chat_file, tmp_path / "run", *SEQ, "train.max_steps=4", "train.micro_batch_size=2")
        assert ("data.packing False -> True (the data position, 12 samples, was counted under the checkpoint's "
                "values") in capsys.readouterr().out
