"""An output dir that survives anything (issue 14): damaged checkpoints, concurrent runs, half-written logs, bad
bytes, interrupted exports, Ctrl-C. Library functions are tested in-process; the CLI only where it is the point."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import (BASE, REPO, CliProcess, cli_env, cli_process, export_hf, invoke, losses, read_metrics, run_ranks,
                     sft, start)

from finetune import checkpoint as ckpt
from finetune.data import DataError, load_rows
from finetune.run.locks import LockError, hold_lock, release_lock
from finetune.metrics import MetricsLogger

ARGS = ["train.micro_batch_size=2", "train.max_steps=8"]


def sft_args(model_dir, data, out, *extra, nproc=1) -> list:
    return ["sft", "--model", model_dir, "--dataset", data, "-o", out, "--nproc-per-node", nproc, *BASE, *ARGS, *extra]


def sft_popen(model_dir, data, out, *extra, nproc=1, pause_at_step=2) -> CliProcess:
    """A CLI run that pauses at the start of step `pause_at_step` until a signal arrives (fault pause_at_step)."""
    return cli_process(*sft_args(model_dir, data, out, *extra, nproc=nproc),
                       env={"FINETUNE_TEST_FAULTS": f"pause_at_step={pause_at_step}"})


def wait_paused(proc: CliProcess, nproc: int) -> None:
    seen, paused = [], 0
    while paused < nproc and (line := proc.stderr.readline()):
        seen.append(line)
        paused += "paused at step" in line
    assert paused == nproc, "".join(seen)


def kill_tree(proc: CliProcess) -> None:
    """Kill a CLI run and the ranks it launched (they run in sessions of their own)."""
    import psutil
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            child.kill()


def wait_for(predicate, timeout_s=180):
    deadline = time.time() + timeout_s
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def fake_checkpoint(root: Path, step: int) -> Path:
    """A real (single-process) DCP save with our marker, as Checkpointer writes it."""
    path = root / f"step-{step}"
    dcp.save({"w": torch.full((1000,), float(step))}, checkpoint_id=str(path), no_dist=True)
    ckpt.write_marker(path, {"step": step})
    return path


@pytest.fixture(scope="module")
def run_dir(llama_dir, chat_file, tmp_path_factory):
    """A finished 8-step run with checkpoints at steps 2, 4, 6 and 8: the straight run the others compare with."""
    out = tmp_path_factory.mktemp("run") / "run"
    sft(llama_dir, chat_file, out, *ARGS, "checkpoint.interval=2", "checkpoint.keep=0")
    return out


def copy_run(run_dir, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


# 1. damaged checkpoints

def test_damaged_checkpoints_are_reported_once_and_skipped(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in range(1, 6):
        fake_checkpoint(root, step)
    shard = next(p for p in (root / "step-5").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    next(p for p in (root / "step-4").iterdir() if p.suffix == ".distcp").unlink()  # missing
    (root / "step-3" / ckpt.MARKER).write_text('{"step": 3, "fil')  # garbled marker
    (root / "step-2" / ckpt.MARKER).write_text("")  # empty marker
    assert ckpt.find_resume(tmp_path, resume=True, resume_from="") == root / "step-1"
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(line.startswith("skipping damaged checkpoint") for line in lines)
    assert "step-5: __0_0.distcp has" in lines[0] and "step-4: __0_0.distcp is missing" in lines[1]
    assert ckpt.MARKER in lines[2] and ckpt.MARKER in lines[3]
    with pytest.raises(ckpt.CheckpointError, match="step-5 is damaged: __0_0.distcp has"):
        ckpt.find_resume(tmp_path, resume=True, resume_from=str(root / "step-5"))


def save_sharded(path: str) -> None:
    """On every rank: a DCP save of a tensor sharded over the ranks (each writes its own file), then rank 0's marker."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dcp.save({"w": distribute_tensor(torch.arange(4000.0), mesh, [Shard(0)])}, checkpoint_id=path)
    if dist.get_rank() == 0:
        ckpt.write_marker(Path(path), {"step": 1})


def test_marker_records_every_ranks_file(tmp_path):
    path = tmp_path / "step-1"
    run_ranks(save_sharded, 2, str(path))
    assert sorted(ckpt.read_marker(path)["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert ckpt.damage(path) is None
    with open(path / "__1_0.distcp", "r+b") as f:
        f.truncate(10)
    assert ckpt.damage(path).startswith("__1_0.distcp has 10 bytes")


def test_retention_never_deletes_the_last_intact_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        fake_checkpoint(root, step)
    (root / "step-3" / ".metadata").write_bytes(b"garbage")  # newer, but damaged
    ckpt.prune(root, keep=1)
    assert [p.name for p in ckpt.step_dirs(root)] == ["step-2", "step-3"]
    assert ckpt.latest_complete(root, report=False) == root / "step-2"


def test_resume_falls_back_to_the_newest_intact_checkpoint_and_matches_the_straight_run(run_dir, llama_dir,
                                                                                         chat_file, tmp_path, capsys):
    out = copy_run(run_dir, tmp_path)
    cps = out / "checkpoints"
    (cps / "step-8" / ckpt.MARKER).write_text("not json")
    (cps / "step-6" / "__0_0.distcp").unlink()
    with open(cps / "step-4" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 1.2')  # a half-written last line
    capsys.readouterr()
    sft(llama_dir, chat_file, out, *ARGS, "checkpoint.interval=2", "checkpoint.keep=0")
    stdout = capsys.readouterr().out
    skipped = [line for line in stdout.splitlines() if line.startswith("skipping damaged checkpoint")]
    assert [line.split(":")[0].rsplit("/", 1)[1] for line in skipped] == ["step-8", "step-6", "step-4"]
    assert f"resumed from {cps / 'step-2'} at step 2" in stdout
    assert "dropped 1 unreadable line(s)" in stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    assert losses(out) == losses(run_dir)  # bitwise on CPU: steps 3-8 redone from step-2
    assert all(ckpt.damage(cps / f"step-{s}") is None for s in (2, 4, 6, 8))


# 2. one run per output dir

def lock_holder(lock: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from finetune.run.locks import hold_lock; "
                               f"hold_lock({str(lock)!r}, 'x'); print('held', flush=True); time.sleep(600)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_lock_names_its_holder_and_dies_with_it(tmp_path):
    lock = tmp_path / "out" / ".finetune.lock"
    holder = lock_holder(lock)
    with pytest.raises(LockError, match=f"out is in use by pid {holder.pid} on "):
        hold_lock(lock, str(tmp_path / "out"))
    holder.kill()  # kill -9: the OS releases the lock, nothing goes stale
    holder.wait()
    hold_lock(lock, "out")
    release_lock(lock)


def test_a_released_lock_leaves_no_file_and_a_lock_on_a_removed_file_is_taken_again(tmp_path, monkeypatch):
    lock = tmp_path / ".hf.lock"
    hold_lock(lock, "hf")
    release_lock(lock)
    assert not lock.exists()  # no .<name>.lock files pile up beside export dirs
    real, fds = fcntl.flock, []

    def flock(fd, op):  # between our open and flock, the holder removed the file on release; another made it anew
        if not fds:
            lock.unlink()
            lock.touch()
        fds.append(fd)
        return real(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock)
    hold_lock(lock, "hf")  # the first flock holds the removed file, which locks nothing: it takes the new one
    assert len(fds) == 2 and os.path.samestat(os.fstat(fds[1]), os.stat(lock))
    release_lock(lock)
    assert not lock.exists()


def test_a_run_into_a_locked_dir_is_refused_before_torch_loads(llama_dir, chat_file, tmp_path):
    """The run's lock is taken before the recipe imports torch and transformers (which took ~20 s of a busy CPU
    before the refusal): a fresh interpreter refused on a locked dir never imported torch."""
    out = tmp_path / "out"
    holder = lock_holder(out / ".finetune.lock")
    try:
        t0 = time.perf_counter()
        refused = subprocess.run([sys.executable, "-X", "importtime", "-m", "finetune", *map(str, sft_args(
            llama_dir, chat_file, out))], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - t0
    finally:
        holder.kill()
        holder.wait()
    error = [line for line in refused.stderr.splitlines() if not line.startswith("import time:")]
    assert refused.returncode == 2 and error == [f"error: output dir {out} is in use by pid {holder.pid} on "
                                                 f"{error[0].split(' on ', 1)[1]}"], refused.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in refused.stderr.splitlines() if line.startswith("import ti")}
    assert "finetune.cli" in imported and "torch" not in imported, seconds


def test_export_locks_its_output_dir(run_dir, tmp_path):
    holder = lock_holder(tmp_path / ".hf.lock")  # what a running export-hf -o hf holds
    try:
        with pytest.raises(LockError, match=f"--output-dir {tmp_path / 'hf'} is in use by pid {holder.pid}"):
            export_hf(str(run_dir), str(tmp_path / "hf"), verify=False)
    finally:
        holder.kill()
    assert not (tmp_path / "hf").exists()


def test_two_runs_into_one_output_dir_one_exits_2_naming_the_other(llama_dir, chat_file, tmp_path):
    out = tmp_path / "run"
    procs = [sft_popen(llama_dir, chat_file, out) for _ in range(2)]  # started together
    wait_for(lambda: any(p.poll() is not None for p in procs))
    [loser] = [p for p in procs if p.poll() is not None]
    [winner] = [p for p in procs if p is not loser]
    err = loser.communicate()[1]
    assert loser.returncode == 2 and err.count("\n") == 1 and f"is in use by pid {winner.pid} on" in err, err
    wait_paused(winner, 1)  # the winner runs on, undisturbed
    winner.send_signal(signal.SIGTERM)
    stdout, stderr = winner.communicate(timeout=180)
    assert winner.returncode == 0, stderr[-3000:]
    assert stdout.splitlines()[0] == f"sft: loading {llama_dir} and {chat_file} -> {out}"  # at once, first
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


# 3. a refused run rewrites nothing; export-hf pairs the weights with the model they trained

def test_refused_run_keeps_config_and_export_reads_the_checkpoint(run_dir, llama_dir, qwen_tied_dir, chat_file,
                                                                  tmp_path):
    """The CLI in-process (helpers.invoke): the refusal and "nothing to do" come before any rank starts."""
    out = copy_run(run_dir, tmp_path)
    config_before = (out / "config.toml").read_bytes()
    refused = invoke(*sft_args(qwen_tied_dir, chat_file, out, "train.max_steps=10"))
    assert refused.exit_code == 2 and "does not match the model" in refused.stderr, refused.output
    assert (out / "config.toml").read_bytes() == config_before
    (out / "config.toml").write_text(f'[model]\npath = "{qwen_tied_dir}"\n')  # even a config.toml that lies
    export_hf(str(out), str(tmp_path / "hf"), verify=True)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (Path(llama_dir) / "tokenizer.json").read_bytes()
    again = invoke(*sft_args(llama_dir, chat_file, out))  # a resume with nothing to do says so
    assert again.exit_code == 0 and f"nothing to do: checkpoint {out / 'checkpoints' / 'step-8'} is at step 8" in \
        again.stdout, again.output


# 4. metrics.jsonl repair

def test_metrics_repair_drops_a_half_line_and_records_past_the_checkpoint(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(json.dumps({"step": s, "loss": 1.0}).encode() + b"\n" for s in range(1, 6))
                     + b'{"step": 6, "lo\xff')
    MetricsLogger(tmp_path, start_step=3).close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert "dropped 1 unreadable line(s) (line 6)" in capsys.readouterr().out


# 5. bad bytes in data

def test_non_utf8_data_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    row = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]})
    path.write_bytes(f"{row}\n{row}\n".encode() + row.encode().replace(b"hi", b"h\xe9") + b"\n")
    with pytest.raises(DataError, match=rf"^{path}:3: not UTF-8 text \(byte 0xe9"):
        load_rows(str(path))


# 6. export of a damaged checkpoint

def test_export_of_a_truncated_shard_names_the_file(run_dir, tmp_path):
    out = copy_run(run_dir, tmp_path)
    with open(out / "checkpoints" / "step-8" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ckpt.CheckpointError, match="step-8 is damaged: __0_0.distcp has 1000 bytes"):
        export_hf(str(out / "checkpoints" / "step-8"), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


# 7. kill -9 during export-hf, then export again

def test_partial_export_of_a_killed_run_is_removed_by_the_next(run_dir, tmp_path, capsys):
    """The first export runs in a process of its own (forked warm: helpers.start), killed once it wrote the weights."""
    proc = start(export_hf, str(run_dir), str(tmp_path / "hf"))
    wait_for(lambda: any(tmp_path.glob(".hf.partial-*/model.safetensors")) or not proc.is_alive())
    proc.kill()
    proc.join()
    [partial] = tmp_path.glob(".hf.partial-*")
    export_hf(str(run_dir), str(tmp_path / "hf"), verify=False)
    assert "removed 1 partial export(s) left by interrupted runs" in capsys.readouterr().out
    assert not partial.exists() and (tmp_path / "hf" / "model.safetensors").is_file()


# 8, 9 and the start-up items: one line, exit 2, before torch is imported

@pytest.mark.parametrize("args, env, message", [
    (["sft", "eval.path=/no/such/eval.jsonl"], {}, "eval path '/no/such/eval.jsonl' does not exist"),
    (["sft", "-o", "{file}"], {}, "is a file, not a directory"),
    (["sft", "train.max_stepz=3"], {}, "unknown config key 'train.max_stepz'"),
    (["sft", "--model", "org/no-model"], {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
     "cannot be reached: pass a local path, or set HF_HUB_OFFLINE=1"),
    (["export-hf", "--checkpoint", "{file}", "-o", "hf", "--dtype", "float16"], {},
     "--dtype must be one of auto, bfloat16, float32, got 'float16'"),
    (["export-hf", "--checkpoint", "{file}", "-o", "hf", "--max-shard-size", "5XB"], {},
     "--max-shard-size must be a positive size like 5GB"),
    (["--version"], {}, None),
])
def test_startup_errors_are_one_line_before_torch(tmp_path, args, env, message):
    (tmp_path / "file").write_text("x")
    args = [a.replace("{file}", str(tmp_path / "file")) for a in args]
    code = ("import sys; from finetune.cli import main; sys.argv = ['finetune', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=cli_env(env))
    if message is None:
        assert proc.stdout.splitlines() == ["finetune 0.1.0", "exit 0 False"]
        return
    assert proc.stdout.strip() == "exit 2 False" and proc.stderr.count("\n") == 1 and message in proc.stderr


# 10. Ctrl-C

@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_saves_and_a_second_one_exits_at_once(llama_dir, chat_file, tmp_path, nproc):
    runs = {times: sft_popen(llama_dir, chat_file, tmp_path / f"ctrl-c-{times}", nproc=nproc) for times in (1, 2)}
    try:  # both at once: each waits on its own launcher and ranks, not on the other run
        for proc in runs.values():
            wait_paused(proc, nproc)
        for times, proc in runs.items():
            for _ in range(times):  # the step and the save after the first take far longer than the gap
                proc.send_signal(signal.SIGINT)
                time.sleep(0.05)
        for times, proc in runs.items():
            out = tmp_path / f"ctrl-c-{times}"
            stdout, stderr = proc.communicate(timeout=180)
            saved = [p for p in ckpt.step_dirs(out / "checkpoints") if ckpt.damage(p) is None]
            if times == 1:
                assert proc.returncode == 0, stderr[-3000:]
                assert saved == [out / "checkpoints" / "step-2"]
                assert f"received SIGINT: saved checkpoint {saved[0]}" in stdout
            else:
                assert proc.returncode == 130, stderr[-3000:]
                assert "nothing was saved" in stderr and saved == []
    finally:  # a failed test leaves no paused run behind
        for proc in runs.values():
            if proc.poll() is None:
                kill_tree(proc)
