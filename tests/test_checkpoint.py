"""Checkpoints: exact resume (same and other world size), kill -9 while saving and while training, SIGTERM,
non-finite loss. CPU, gloo, fp32; constant lr so a 4-step run and an 8-step run share a schedule."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO, losses, read_metrics, run_cli

ARGS = ["train.micro_batch_size=2", "train.mixed_precision=fp32", "train.lr=3e-3", "train.warmup_steps=0",
        "train.min_lr_ratio=1.0", "eval.path=", "log.progress=false"]


def sft(model_dir, data, out, *extra, nproc=2, env=None, check=True):
    return run_cli("sft", "--model", model_dir, "--dataset", data, "--output-dir", out, "--nproc-per-node", nproc,
                   *ARGS, *extra, env=env, check=check)


def steps(out):
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").iterdir()
                  if (p / "finetune_complete.json").exists() and (p / ".metadata").exists())


@pytest.fixture(scope="module")
def straight(llama_dir, chat_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    sft(llama_dir, chat_file, out, "train.max_steps=8")
    return losses(out)


def test_resume_is_exact_same_and_other_world_size(llama_dir, chat_file, tmp_path, straight):
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=4", "checkpoint.interval=4")
    assert steps(out) == [4]
    proc = sft(llama_dir, chat_file, out, "train.max_steps=8", "checkpoint.interval=4")
    assert "resumed from" in proc.stdout and "step-4" in proc.stdout
    resumed = losses(out)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    assert resumed == straight  # bitwise on CPU
    # the same checkpoint resumed on 1 rank: DCP reshards, the data position is global
    one = tmp_path / "one"
    proc = sft(llama_dir, chat_file, one, "train.max_steps=8", "train.grad_accum_steps=2",
               "--resume-from", out / "checkpoints" / "step-4", nproc=1)
    assert "note: the global batch" not in proc.stdout  # 1 rank x accum 2 == 2 ranks x accum 1: the same batch
    tail = losses(one)
    assert len(tail) == 4
    assert max(abs(a - b) / b for a, b in zip(tail, straight[4:])) < 1e-5


def test_kill_while_saving_then_resume(llama_dir, chat_file, tmp_path, straight):
    out = tmp_path / "run"
    proc = sft(llama_dir, chat_file, out, "train.max_steps=8", "checkpoint.interval=4",
               env={"FINETUNE_TEST_FAULTS": "kill_in_save=8"}, check=False)
    assert proc.returncode != 0
    assert steps(out) == [4] and (out / "checkpoints" / "step-8" / ".metadata").exists()  # written, not complete
    proc = sft(llama_dir, chat_file, out, "train.max_steps=8", "checkpoint.interval=4")
    assert proc.stdout.count("ignoring incomplete checkpoint(s)") == 1 and "step-8" in proc.stdout
    assert "resumed from" in proc.stdout and "step-4" in proc.stdout
    assert losses(out)[-4:] == straight[-4:]
    assert steps(out) == [4, 8]


def test_kill_while_training_then_resume(llama_dir, chat_file, tmp_path, straight):
    out = tmp_path / "run"
    proc = sft(llama_dir, chat_file, out, "train.max_steps=8", "checkpoint.interval=2", "checkpoint.keep=1",
               env={"FINETUNE_TEST_FAULTS": "kill_at_step=6"}, check=False)
    assert proc.returncode != 0
    assert steps(out) == [4]  # keep=1 pruned step-2 only after step-4 was complete
    sft(llama_dir, chat_file, out, "train.max_steps=8", "checkpoint.interval=2", "checkpoint.keep=1")
    assert losses(out) == straight
    assert steps(out) == [8]


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_saves_and_exits_zero_then_resume_is_exact(llama_dir, chat_file, tmp_path, straight, nproc):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "finetune", "sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", out,
           "--nproc-per-node", str(nproc), *ARGS, "train.max_steps=8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FINETUNE_TEST_FAULTS": "step_sleep_s=0.5"}
    if nproc == 1:
        cmd.append("train.grad_accum_steps=2")
    proc = subprocess.Popen(list(map(str, cmd)), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    saved = steps(out)
    assert len(saved) == 1 and 2 <= saved[0] < 8
    assert f"received SIGTERM: saved checkpoint {out / 'checkpoints' / f'step-{saved[0]}'}" in stdout
    sft(llama_dir, chat_file, out, "train.max_steps=8", *(["train.grad_accum_steps=2"] if nproc == 1 else []),
        nproc=nproc)
    got = losses(out)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    assert max(abs(a - b) / b for a, b in zip(got, straight)) < (0 if nproc == 2 else 1e-5) + 1e-12


def test_nan_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(llama_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    proc = sft(llama_dir, chat_file, out, "train.max_steps=8", "checkpoint.interval=4",
               env={"FINETUNE_TEST_FAULTS": "nan_at_step=6"}, check=False)
    assert proc.returncode == 1
    assert "non-finite loss at step 6" in proc.stderr
    assert steps(out) == [4]
    assert len(read_metrics(out)) == 5


def test_nan_skip_policy_counts_skips(llama_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    proc = sft(llama_dir, chat_file, out, "train.max_steps=4", "train.nan_policy=skip",
               env={"FINETUNE_TEST_FAULTS": "nan_at_step=2"}, nproc=1)
    assert "step 2: non-finite loss/grad norm, update skipped (1 skipped so far)" in proc.stdout
    assert len(read_metrics(out)) == 4 and steps(out) == [4]


def test_no_resume_refuses_to_overwrite_checkpoints(llama_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=2", nproc=1)
    proc = sft(llama_dir, chat_file, out, "train.max_steps=2", "--no-resume", nproc=1, check=False)
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    assert steps(out) == [2]


def test_checkpoint_of_another_architecture_is_refused(llama_dir, qwen_tied_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=2", nproc=1)
    proc = sft(qwen_tied_dir, chat_file, tmp_path / "other", "train.max_steps=4", nproc=1, check=False,
               *["--resume-from", out / "checkpoints" / "step-2"])
    assert proc.returncode == 2
    assert "does not match the model" in proc.stderr and "model_type" in proc.stderr
