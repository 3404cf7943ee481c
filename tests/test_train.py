"""SFT (in-process ranks): FSDP on 2 gloo ranks equals 1 process; any micro-batch/accumulation split gives the
same losses; tied embeddings of another architecture train; targets never cross a packed-sample boundary."""
from __future__ import annotations

import pytest

from helpers import read_metrics, sft

TWO_RANKS = ("train.max_steps=8", "train.micro_batch_size=2")  # the 2-rank reference run (also test_checkpoint's)
ONE_RANK = ("train.max_steps=8", "train.micro_batch_size=4")  # the same global batch on 1 rank


def test_two_ranks_equal_one_process(llama_dir, chat_file, reference):
    one, two = read_metrics(reference(llama_dir, chat_file, *ONE_RANK)), \
        read_metrics(reference(llama_dir, chat_file, *TWO_RANKS, nproc=2))
    assert len(one) == len(two) == 8
    assert one[-1]["loss"] < one[0]["loss"]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    # the same global batch: same label-token counts at every step
    assert [r["num_tokens"] for r in one] == [r["num_tokens"] for r in two]


def test_micro_batch_and_accumulation_splits_agree(llama_dir, chat_file, tmp_path, reference):
    ref = read_metrics(reference(llama_dir, chat_file, *ONE_RANK))[:4]  # constant lr: the first 4 of 8 steps
    for mbs, accum in [(2, 2), (1, 4)]:
        recs = sft(llama_dir, chat_file, tmp_path / f"m{mbs}a{accum}", "train.max_steps=4",
                   f"train.micro_batch_size={mbs}", f"train.grad_accum_steps={accum}")
        assert [r["num_tokens"] for r in recs] == [r["num_tokens"] for r in ref], (mbs, accum)
        assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref], rel=1e-5), (mbs, accum)
        assert [r["grad_norm"] for r in recs] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4), (mbs, accum)


def test_tied_embedding_model_of_another_architecture_trains_on_two_ranks(qwen_tied_dir, chat_file, tmp_path):
    ls = [r["loss"] for r in sft(qwen_tied_dir, chat_file, tmp_path / "qwen", "train.max_steps=8",
                                 "train.micro_batch_size=4", nproc=2)]
    assert len(ls) == 8 and all(x == x for x in ls)
    assert sum(ls[-2:]) < sum(ls[:2])
