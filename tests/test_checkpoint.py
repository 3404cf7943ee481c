"""Checkpoints: exact resume (same and other world size), kill -9 while saving and while training, SIGTERM,
non-finite loss. CPU, gloo, fp32, constant lr (helpers.BASE) so a 4-step run and an 8-step run share a schedule.
In-process ranks (run_ranks) except where the launcher or a signal is the point (exit codes: launch.rank_main)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import warnings

import pytest
import torch

from finetune import checkpoint as ckpt
from finetune.checkpoint import CheckpointError, is_complete, step_dirs
from finetune.errors import FinetuneError
from finetune.train import NonFiniteError
from helpers import BASE, RankError, cli_process, losses, read_metrics, run_ranks, sft, sft_cli, sft_config

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
        model, lora = build(*args, **kwargs)
        calls = []

        def poison(module, inputs, output):
            calls.append(1)
            if (len(calls) - 1) // cfg.train.grad_accum_steps + 1 == step:
                output.logits = output.logits * float("nan")  # the loss is computed from them (loss.py)
            return output
        model.register_forward_hook(poison)
        return model, lora
    T.build_model = build_model
    return T.train(cfg, "sft")


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


def test_sigterm_saves_and_exits_zero_then_resume_is_exact(llama_dir, chat_file, tmp_path, straight):
    """Through the CLI on 1 rank (the signal hits the rank) and on 2 (the launcher forwards it), both runs at once.
    Each pauses at the start of step 3 (fault pause_at_step) until the signal arrives, so it saves exactly step 3."""
    accum = {1: ["train.grad_accum_steps=2"], 2: []}
    procs = {nproc: cli_process("sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir",
                                tmp_path / f"run{nproc}", "--nproc-per-node", nproc, *BASE, *TWO_RANKS, *accum[nproc],
                                env={"FINETUNE_TEST_FAULTS": "pause_at_step=3"}, start_new_session=True)
             for nproc in (1, 2)}
    try:
        for nproc, proc in procs.items():
            seen, paused = [], 0
            while paused < nproc and (line := proc.stderr.readline()):
                seen.append(line)
                paused += line.count("paused at step 3")
            assert paused == nproc, "".join(seen)
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        done = {nproc: proc.communicate(timeout=180) for nproc, proc in procs.items()}
    finally:  # a failed test leaves no paused ranks behind
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    for nproc, (stdout, stderr) in done.items():
        out = tmp_path / f"run{nproc}"
        assert procs[nproc].returncode == 0, stderr[-3000:]
        assert steps(out) == [3]
        assert f"received SIGTERM: saved checkpoint {out / 'checkpoints' / 'step-3'} at step 3" in stdout
        sft(llama_dir, chat_file, out, *TWO_RANKS, *accum[nproc], nproc=nproc)
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


def exit_of_rank(cfg):
    """The exit code of a rank as the CLI runs it (launch.rank_main: train(cfg), an error as one line on stderr)."""
    from finetune.launch import rank_main
    from finetune.train import train
    try:
        rank_main(train, (cfg, "sft"), False)
    except SystemExit as e:
        return e.code


def test_a_diverging_run_exits_1_naming_the_step(llama_dir, chat_file, tmp_path, capsys):
    """As the CLI runs a rank (launch.rank_main): a non-finite loss is a failure (exit 1), not bad input. An absurd lr
    makes step 2's loss non-finite."""
    cfg = sft_config(llama_dir, chat_file, tmp_path / "run", "train.max_steps=3", "train.micro_batch_size=4",
                     "train.lr=1e30")
    assert run_ranks(exit_of_rank, 1, cfg) == [1]
    stderr = capsys.readouterr().err
    assert stderr.strip().splitlines()[-1].startswith("error: non-finite "), stderr[-3000:]
    assert "at step 2" in stderr and len(read_metrics(tmp_path / "run")) == 1


def test_nan_skip_policy_counts_skips(llama_dir, chat_file, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = sft_config(llama_dir, chat_file, out, "train.max_steps=4", "train.micro_batch_size=4",
                     "train.nan_policy=skip")
    run_ranks(train_with_nan_at, 1, cfg, 2)
    printed = capsys.readouterr().out
    assert "step 2: non-finite loss/grad norm, update skipped (1 skipped so far)" in printed
    assert "2 skipped" not in printed  # the parameters were not touched: the next steps are finite again
    assert len(read_metrics(out)) == 4 and steps(out) == [4]
    strict = [json.loads(line, parse_constant=pytest.fail) for line in (out / "metrics.jsonl").open()]  # no NaN
    assert strict[1]["loss"] is None and all(r["loss"] > 0 for r in strict[:1] + strict[2:])


def test_no_resume_starts_fresh_and_keeps_the_earlier_checkpoints_beside(llama_dir, chat_file, tmp_path, capsys):
    """--no-resume (checkpoint.resume=false) does what its help and the LoRA/full mismatch error say: a fresh run.
    The earlier run's checkpoints move to checkpoints.N once the run is accepted (not at the pre-flight check, so a
    refused run moves nothing), as metrics.jsonl goes to metrics.jsonl.N."""
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=2")
    before = ckpt.read_marker(out / "checkpoints" / "step-2")
    with pytest.raises(CheckpointError, match=r"start a new one \(--no-resume"):  # the advice that is followed
        sft(llama_dir, chat_file, out, "train.max_steps=4", "lora.rank=4")
    assert ckpt.find_resume(out, resume=False, resume_from="") is None  # what the pre-flight check asks: no refusal
    assert steps(out) == [2]  # and nothing moved yet
    capsys.readouterr()
    sft(llama_dir, chat_file, out, "train.max_steps=2", "lora.rank=4", "checkpoint.resume=false")  # the advice
    assert (f"checkpoint.resume=false: starting fresh; the checkpoints already in {out / 'checkpoints'} were moved "
            f"to {out / 'checkpoints.1'}") in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and (out / "metrics.jsonl.1").is_file()
    assert steps(out) == [2] and ckpt.read_marker(out / "checkpoints" / "step-2")["lora"]["rank"] == 4
    kept = out / "checkpoints.1" / "step-2"  # the first run's, untouched
    assert ckpt.damage(kept) is None and ckpt.read_marker(kept) == before


def test_a_kept_run_resumed_into_its_output_dir_keeps_the_runs_apart(llama_dir, chat_file, tmp_path):
    """Issue 53 item 4: --resume-from a run kept as checkpoints.1 into its own output dir appended to the newer run's
    metrics.jsonl (steps [1, 3]) and saved among its checkpoints; now refused, or with --no-resume kept apart."""
    from helpers import invoke
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=2")
    sft(llama_dir, chat_file, out, "train.max_steps=1", "checkpoint.resume=false")  # the first run: checkpoints.1
    kept = out / "checkpoints.1" / "step-2"
    result = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "-o", out, "--resume-from", kept, *BASE,
                    "train.max_steps=3")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: output_dir {out} holds another run (checkpoints/step-1, metrics.jsonl) than the one of "
        f"checkpoint.resume_from {kept}; their checkpoints and metrics would mix: to continue the run in {out}, leave "
        f"out --resume-from; to keep it beside (checkpoints.N, metrics.jsonl.N), pass --no-resume; or pass another "
        f"--output-dir"]
    assert steps(out) == [1] and [r["step"] for r in read_metrics(out)] == [1]  # nothing moved
    resumed = sft(llama_dir, chat_file, out, "train.max_steps=3", "checkpoint.resume=false",
                  f"checkpoint.resume_from={kept}")
    assert [r["step"] for r in resumed] == [3] and steps(out) == [3]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl.2").open()] == [1]  # the newer run's, kept
    assert step_dirs(out / "checkpoints.2") == [out / "checkpoints.2" / "step-1"]


def model_tensors(step_dir) -> dict:
    """The model tensors a DCP checkpoint holds, read in this process."""
    import torch.distributed.checkpoint as dcp
    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if k.startswith("model.")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
    return sd


def loaded_settings(cfg, step_dir, step: int) -> tuple[list[dict], list[dict]]:
    """(each param group's settings after load_checkpoint(step_dir) into the optimizer and scheduler `cfg` builds,
    the settings of a fresh such optimizer whose scheduler took `step` steps)."""
    from finetune.distributed import init_distributed
    from finetune.build import transforms
    from finetune.optim import build_scheduler, settings
    from finetune.run.resume import load_checkpoint
    from finetune.train import build_model_and_optimizer
    device, dims = init_distributed()
    tc = cfg.train
    found = []
    for load in (True, False):
        model, optimizer, lora = build_model_and_optimizer(cfg, device, dims, transforms(cfg, dims, device))
        scheduler = build_scheduler(optimizer, warmup_steps=tc.warmup_steps, max_steps=tc.max_steps,
                                    min_lr_ratio=tc.min_lr_ratio)
        if load:
            load_checkpoint(step_dir, model, optimizer, scheduler, ckpt.TrainState(), model.config, lora)
        else:
            with warnings.catch_warnings():  # stepped without optimizer steps, on purpose
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(step):
                    scheduler.step()
        assert scheduler.get_last_lr() == [g["lr"] for g in optimizer.param_groups]
        found.append(settings(optimizer))
    return found[0], found[1]


NEW = {"lr": 1e-3, "warmup_steps": 3, "min_lr_ratio": 0.5, "max_steps": 5, "weight_decay": 0.1, "beta1": 0.8,
       "beta2": 0.9, "eps": 1e-6, "max_grad_norm": 0.5}  # every optimizer and schedule key, changed on resume


def test_a_resume_with_changed_optimizer_and_schedule_settings_uses_them(llama_dir, chat_file, tmp_path, capsys):
    """The checkpoint gives the state (weights, moments, step, data position); the run's config its settings, the
    schedule evaluated at the resumed step with the new values. One line lists what changed; config.toml records
    what is used."""
    import tomllib
    from finetune.optim import lr_at
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=2", "train.micro_batch_size=2")  # lr 3e-3, constant (BASE)
    for name in ("new", "lr", "lr2"):
        shutil.copytree(out, tmp_path / name)
    capsys.readouterr()
    new = [f"train.{k}={v}" for k, v in NEW.items()]
    records = sft(llama_dir, chat_file, tmp_path / "new", *new, "train.micro_batch_size=2")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records[2:]:  # the new schedule at the resumed steps, of the new peak lr
        assert r["lr"] == pytest.approx(NEW["lr"] * lr_at(r["step"] - 1, warmup_steps=3, max_steps=5,
                                                           min_lr_ratio=0.5), rel=1e-12)
    [note] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: changed since")]
    old = {"lr": 3e-3, "warmup_steps": 0, "min_lr_ratio": 1.0, "max_steps": 2, "weight_decay": 0.01,  # BASE over
           "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "max_grad_norm": 1.0}  # configs/tiny.toml
    assert all(f"train.{k} {old[k]!r} -> {v!r}" in note for k, v in NEW.items()) and "data" not in note, note
    assert tomllib.loads((tmp_path / "new" / "config.toml").read_text())["train"].items() >= NEW.items()
    cfg = sft_config(llama_dir, chat_file, tmp_path / "new", *new, "train.micro_batch_size=2")
    loaded, fresh = run_ranks(loaded_settings, 1, cfg, out / "checkpoints" / "step-2", 2)[0]
    assert loaded == fresh  # every setting of every param group: lr, initial_lr, betas, eps, weight_decay, ...
    assert fresh[0]["betas"] == (0.8, 0.9) and fresh[0]["weight_decay"] == 0.1 and fresh[1]["weight_decay"] == 0
    # a changed lr changes the update: AdamW's step (no weight decay) is proportional to the lr
    deltas = []
    for name, lr in (("lr", 1e-3), ("lr2", 2e-3)):
        sft(llama_dir, chat_file, tmp_path / name, "train.max_steps=3", "train.micro_batch_size=2", f"train.lr={lr}")
        start, end = (model_tensors(tmp_path / name / "checkpoints" / f"step-{s}") for s in (2, 3))
        deltas.append({k: end[k] - start[k] for k in start})
    for k, delta in deltas[0].items():
        torch.testing.assert_close(deltas[1][k], 2 * delta, rtol=1e-3, atol=1e-6, msg=k)  # fp32 rounding


def train_with_full_disk(cfg, step: int, rank: int) -> tuple[str, int]:
    """train(cfg) on a disk that fills up during step `step`'s checkpoint save: rank `rank`'s DCP file write raises
    ENOSPC, as write() on a full disk does. Returns the error's one line and exit code (on every rank)."""
    import errno

    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    from finetune.train import train
    write_item = fs._write_item

    def full_disk(transforms, stream, *args, **kwargs):
        if f"step-{step}" in stream.name and dist.get_rank() == rank:
            stream.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_item(transforms, stream, *args, **kwargs)
    fs._write_item = full_disk
    try:
        train(cfg, "sft")
    except FinetuneError as e:
        return str(e), e.exit_code
    raise AssertionError("the save did not fail")


@pytest.mark.parametrize("nproc, mode, rank", [(1, "sync", 0), (2, "sync", 1), (2, "async", 0)])
def test_a_full_disk_while_saving_is_one_line_and_leaves_no_partial_checkpoint(llama_dir, chat_file, tmp_path,
                                                                              nproc, mode, rank):
    out = tmp_path / "run"
    cfg = sft_config(llama_dir, chat_file, out, "train.max_steps=4", "train.micro_batch_size=2",
                     "checkpoint.interval=2", f"checkpoint.async={str(mode == 'async').lower()}")
    messages = run_ranks(train_with_full_disk, nproc, cfg, 4, rank)
    cps = out / "checkpoints"
    assert messages == [(f"cannot save checkpoint {cps / 'step-4'}: No space left on device (ENOSPC); removed it "
                         f"(the newest complete checkpoint: step-2)", 1)] * nproc  # every rank stops, saying so
    assert [p.name for p in cps.iterdir()] == ["step-2"] and ckpt.damage(cps / "step-2") is None
    if nproc == 1:  # and the run resumes from the older checkpoint
        sft(llama_dir, chat_file, out, "train.max_steps=4", "train.micro_batch_size=2", "checkpoint.interval=2")
        assert steps(out) == [2, 4] and [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


def test_checkpoint_of_another_architecture_is_refused(llama_dir, qwen_tied_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    sft(llama_dir, chat_file, out, "train.max_steps=2")
    with pytest.raises(CheckpointError, match="does not match the model.*model_type"):
        sft(qwen_tied_dir, chat_file, tmp_path / "other", "train.max_steps=4",
            f"checkpoint.resume_from={out / 'checkpoints' / 'step-2'}")


def test_resume_note_names_changes_of_the_data_the_config_keys_do_not_show(tmp_path):
    """data.chat_template_kwargs (an entry added, removed or changed) and data.sources (which source, which field)
    are announced as changes of the data, each with what the data position means now; nothing else is listed."""
    from dataclasses import asdict

    from finetune.config import load_config
    from finetune.run.resume import resume_note
    a, b = (str((tmp_path / f"{n}.jsonl").resolve()) for n in "ab")
    sources = {"data.sources": [{"path": a, "weight": 1.0}, {"path": b, "weight": 1.0}]}
    saved = asdict(load_config(None, {"data.chat_template_kwargs": {"enable_thinking": True}, **sources}))
    for kwargs, shown in (({}, "data.chat_template_kwargs.enable_thinking True -> unset"),
                          ({"enable_thinking": False}, "data.chat_template_kwargs.enable_thinking True -> False"),
                          ({"enable_thinking": True, "mode": "x"}, "data.chat_template_kwargs.mode unset -> 'x'")):
        note = resume_note(saved, load_config(None, {"data.chat_template_kwargs": kwargs, **sources}), 12)
        assert note == (f"note: changed since the checkpoint: {shown} (a change of the data: the chat template renders "
                        f"other text to train from here, and the data position, 12 samples, was counted under the "
                        f"checkpoint's values)"), note
    added = asdict(load_config(None, sources))  # saved without kwargs: adding them is announced too
    note = resume_note(added, load_config(None, {"data.chat_template_kwargs.enable_thinking": False, **sources}), 3)
    assert "data.chat_template_kwargs.enable_thinking unset -> False (a change of the data" in note
    assert "in effect from here" not in note
    now = load_config(None, {"data.chat_template_kwargs": {"enable_thinking": True},
                             "data.sources": [{"path": a, "weight": 1.0}, {"path": b, "weight": 3.0}]})
    note = resume_note(saved, now, 12)
    assert note == (f"note: changed since the checkpoint: data.sources[1] ({b}): weight 1.0 -> 3.0 (a change of the "
                    f"mixture: the data position, 12 samples, now indexes the new mixture's order: the run skips its "
                    f"first 12 samples, not the ones the checkpoint's run trained on; some of those come again, "
                    f"others are never read)"), note
    now.data.sources = now.data.sources[:1]
    assert f"data.sources[1] {b} removed (a change of the mixture" in resume_note(saved, now, 12)
    assert resume_note(saved, load_config(None, {"data.chat_template_kwargs": {"enable_thinking": True},
                                                 **sources}), 12) is None
