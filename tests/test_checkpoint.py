"""Checkpoints: exact resume (same and other world size), kill -9 while saving and while training, SIGTERM,
non-finite loss. CPU, gloo, fp32, constant lr (helpers.BASE) so a 4-step run and an 8-step run share a schedule.
In-process ranks (run_ranks) except where the launcher, a signal or an exit code is the point."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from finetune.checkpoint import CheckpointError, is_complete, step_dirs
from finetune.train import NonFiniteError
from helpers import BASE, REPO, RankError, losses, read_metrics, run_ranks, sft, sft_cli, sft_config

TWO_RANKS = ("train.max_steps=8", "train.micro_batch_size=2")  # the reference run, shared with test_train


def steps(out) -> list[int]:
    return [int(p.name[5:]) for p in step_dirs(out / "checkpoints") if is_complete(p)]


@pytest.fixture
def straight(llama_dir, chat_file, reference):
    return losses(reference(llama_dir, chat_file, *TWO_RANKS, nproc=2))


def train_with_nan_at(cfg, step: int):
    """train(cfg) with a non-finite loss in every micro-batch of optimizer step `step` (a forward hook on the
    model train() builds)."""
    import finetune.train as T
    build = T.build_model

    def build_model(*args, **kwargs):
        model = build(*args, **kwargs)
        calls = []

        def poison(module, inputs, output):
            calls.append(1)
            if (len(calls) - 1) // cfg.train.grad_accum_steps + 1 == step:
                output.loss = output.loss * float("nan")
            return output
        model.register_forward_hook(poison)
        return model
    T.build_model = build_model
    return T.train(cfg)


def test_resume_is_exact_same_and_other_world_size(llama_dir, chat_file, tmp_path, straight, capsys):
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=4", "train.micro_batch_size=2", "checkpoint.interval=4", nproc=2)
    assert steps(out) == [4]
    capsys.readouterr()
    sft(llama_dir, chat_file, out, *TWO_RANKS, "checkpoint.interval=4", nproc=2)
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "step-4" in printed
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    assert losses(out) == straight  # bitwise on CPU
    # the same checkpoint resumed on 1 rank: DCP reshards, the data position is global
    tail = sft(llama_dir, chat_file, tmp_path / "one", *TWO_RANKS, "train.grad_accum_steps=2",
               f"checkpoint.resume_from={out / 'checkpoints' / 'step-4'}")
    assert "note: the global batch" not in capsys.readouterr().out  # 1 rank x accum 2 == 2 ranks x accum 1
    assert [r["loss"] for r in tail] == pytest.approx(straight[4:], rel=1e-5)


def test_kill_while_saving_then_resume(llama_dir, chat_file, tmp_path, straight, capsys):
    out = tmp_path / "run"
    with pytest.raises(RankError, match="died without a result"):
        sft(llama_dir, chat_file, out, *TWO_RANKS, "checkpoint.interval=4", nproc=2,
            env={"FINETUNE_TEST_FAULTS": "kill_in_save=8"})
    assert steps(out) == [4] and (out / "checkpoints" / "step-8" / ".metadata").exists()  # written, not complete
    capsys.readouterr()
    sft(llama_dir, chat_file, out, *TWO_RANKS, "checkpoint.interval=4", nproc=2)
    printed = capsys.readouterr().out
    assert printed.count("ignoring incomplete checkpoint(s)") == 1 and "step-8" in printed
    assert "resumed from" in printed and "step-4" in printed
    assert losses(out)[-4:] == straight[-4:]
    assert steps(out) == [4, 8]


def test_kill_while_saving_fires_at_that_step_only(llama_dir, chat_file, tmp_path):
    """kill_in_save=1 must not fire at step 10 (a substring match once did)."""
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=10", "train.micro_batch_size=4", "checkpoint.interval=10",
        env={"FINETUNE_TEST_FAULTS": "kill_in_save=1"})
    assert steps(out) == [10]


def test_kill_while_training_then_resume(llama_dir, chat_file, tmp_path, straight):
    """Through the CLI: the elastic launcher with a rank killed by SIGKILL exits non-zero."""
    out = tmp_path / "run"
    proc = sft_cli(llama_dir, chat_file, out, *TWO_RANKS, "checkpoint.interval=2", "checkpoint.keep=1", nproc=2,
                   env={"FINETUNE_TEST_FAULTS": "kill_at_step=6"}, check=False)
    assert proc.returncode != 0
    assert steps(out) == [4]  # keep=1 pruned step-2 only after step-4 was complete
    sft(llama_dir, chat_file, out, *TWO_RANKS, "checkpoint.interval=2", "checkpoint.keep=1", nproc=2)
    assert losses(out) == straight
    assert steps(out) == [8]


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_saves_and_exits_zero_then_resume_is_exact(llama_dir, chat_file, tmp_path, straight, nproc):
    """Through the CLI (1 rank: the signal hits the rank; 2: the launcher forwards it). The run pauses at the start
    of step 3 (fault pause_at_step) until the signal arrives, so it saves exactly step 3."""
    out = tmp_path / "run"
    accum = ["train.grad_accum_steps=2"] if nproc == 1 else []
    cmd = [sys.executable, "-m", "finetune", "sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", out,
           "--nproc-per-node", str(nproc), *BASE, *TWO_RANKS, *accum]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FINETUNE_TEST_FAULTS": "pause_at_step=3"}
    proc = subprocess.Popen(list(map(str, cmd)), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        seen, paused = [], 0
        while paused < nproc and (line := proc.stderr.readline()):
            seen.append(line)
            paused += line.count("paused at step 3")
        assert paused == nproc, "".join(seen)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=180)
    finally:  # a failed test leaves no paused ranks behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert steps(out) == [3]
    assert f"received SIGTERM: saved checkpoint {out / 'checkpoints' / 'step-3'} at step 3" in stdout
    sft(llama_dir, chat_file, out, *TWO_RANKS, *accum, nproc=nproc)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    if nproc == 2:
        assert losses(out) == straight
    else:
        assert losses(out) == pytest.approx(straight, rel=1e-5)


def test_nan_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(llama_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    cfg = sft_config(llama_dir, chat_file, out, *TWO_RANKS, "checkpoint.interval=4")
    with pytest.raises(NonFiniteError, match="non-finite loss at step 6"):
        run_ranks(train_with_nan_at, 2, cfg, 6)
    assert steps(out) == [4]
    assert len(read_metrics(out)) == 5


def test_a_diverging_run_exits_1_naming_the_step(llama_dir, chat_file, tmp_path):
    """Through the CLI: a non-finite loss is a failure (exit 1), not bad input. An absurd lr makes step 2's loss
    non-finite."""
    proc = sft_cli(llama_dir, chat_file, tmp_path / "run", "train.max_steps=3", "train.micro_batch_size=4",
                   "train.lr=1e30", check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: non-finite "), proc.stderr[-3000:]
    assert "at step 2" in proc.stderr and len(read_metrics(tmp_path / "run")) == 1


def test_nan_skip_policy_counts_skips(llama_dir, chat_file, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = sft_config(llama_dir, chat_file, out, "train.max_steps=4", "train.micro_batch_size=4",
                     "train.nan_policy=skip")
    run_ranks(train_with_nan_at, 1, cfg, 2)
    printed = capsys.readouterr().out
    assert "step 2: non-finite loss/grad norm, update skipped (1 skipped so far)" in printed
    assert "2 skipped" not in printed  # the parameters were not touched: the next steps are finite again
    assert len(read_metrics(out)) == 4 and steps(out) == [4]


def test_no_resume_refuses_to_overwrite_checkpoints(llama_dir, chat_file, tmp_path):
    from typer.testing import CliRunner
    from finetune.cli import app
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=2")
    result = CliRunner().invoke(app, ["sft", "--model", str(llama_dir), "--dataset", str(chat_file), "--output-dir",
                                      str(out), *BASE, "train.max_steps=2", "--no-resume"])
    assert result.exit_code == 2 and "already holds checkpoints" in result.stderr
    assert steps(out) == [2]


def test_checkpoint_of_another_architecture_is_refused(llama_dir, qwen_tied_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=2")
    with pytest.raises(CheckpointError, match="does not match the model.*model_type"):
        sft(qwen_tied_dir, chat_file, tmp_path / "other", "train.max_steps=4",
            f"checkpoint.resume_from={out / 'checkpoints' / 'step-2'}")
