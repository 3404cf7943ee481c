"""Test helpers: run a function on N gloo ranks in fresh processes (`run_ranks`), run the real CLI in a process of
its own (`cli_process`, `run_cli`), read what a run wrote."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Imported once by the fork server, so a rank forked from it starts warm (~0.1 s) instead of paying the ~5 s
# torch/transformers import floor of a fresh interpreter. Anything not listed is imported lazily per rank.
PRELOAD = ["pytest", "torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "datasets", "accelerate",
           "transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2", "finetune.train", "finetune.tools.bench",
           "finetune.tools.prepare", "finetune.export", "finetune.hf.verify", "helpers"]


def _warm() -> None:
    """What every process builds on its first model load, built once here (in each process that imports this module,
    the fork server among them): transformers' table of checkpoint conversions, ~1,000 compiled regexes and ~0.5 s
    of CPU per rank. A pure table, deep-copied on every read, the same in every rank."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    get_checkpoint_conversion_mapping("llama")


_warm()


class RankError(RuntimeError):
    """A rank died without a result, or the ranks did not finish in time."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a rank (shown by pytest as the cause of the re-raised exception)."""

    def __str__(self):
        return self.args[0]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_main(conn, fn, args, rank: int, world_size: int, workdir: str, env: dict, timeout_s: float) -> None:
    """One rank: its stdout/stderr into files the caller replays, the process group on a FileStore, fn(*args)."""
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(workdir, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", **env})
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        if os.environ.get("FINETUNE_TEST_FAULTS"):  # as finetune.launch.rank_main does for a launched rank
            import faults
            faults.install()
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        message = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 - everything, SystemExit included, goes back to the test
        tb = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:  # noqa: BLE001 - an exception that does not survive pickling: its text does
            e = RuntimeError(f"{type(e).__name__}: {e}")
        message = ("error", e, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # before the group goes: the other ranks then fail on a closed connection, a symptom of this error
        conn.send(message)
    except Exception as e:  # noqa: BLE001 - an unpicklable return value
        conn.send(("error", RuntimeError(f"rank {rank}: cannot send the return value back: {e}"), ""))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, env: dict | None = None, timeout_s: float = 300) -> list:
    """Run `fn(*args)` on `world_size` gloo ranks and return their return values, rank 0 first.

    `fn` must be a top-level (picklable) function, its args and return value picklable. Each rank is a fresh
    process forked from a warm fork server (torch, transformers and finetune already imported), with
    RANK/WORLD_SIZE/LOCAL_RANK set, OMP_NUM_THREADS=1, the `env` entries added (the server's environment is this
    process's when it started: pass what a call needs, e.g. FINETUNE_TEST_FAULTS, in `env`), and the default group
    initialised (gloo, one FileStore per call), so `finetune.train.train(cfg)` and any library function
    run as under torchrun. The ranks' stdout/stderr are replayed on this process's after the call (pytest's
    capsys/capfd see them; rank 0 first).

    An exception raised in a rank is re-raised here (the first one to arrive; its remote traceback is the cause);
    a rank that dies without a result or a call that outlives `timeout_s` raises RankError, and the ranks still
    running are killed.

        def all_ranks_sum(x):                       # in a test module, at top level
            import torch, torch.distributed as dist
            t = torch.tensor(float(x)); dist.all_reduce(t); return t.item()

        assert run_ranks(all_ranks_sum, 2, 3) == [6.0, 6.0]
    """
    ctx = _context()
    workdir = tempfile.mkdtemp(prefix="run_ranks-")
    procs, conns = {}, {}
    results: dict[int, object] = {}
    errors = []  # (rank, exception, traceback text) in order of arrival
    try:
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(child, fn, args, rank, world_size, workdir, env or {}, timeout_s),
                            name=f"rank{rank}")
            p.start()
            child.close()
            procs[rank], conns[rank] = p, parent
        deadline = time.monotonic() + timeout_s
        while conns:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = set(wait([*conns.values(), *(procs[r].sentinel for r in conns)], timeout=remaining))
            for rank in list(conns):
                conn = conns[rank]
                if conn in ready or procs[rank].sentinel in ready:
                    try:
                        message = conn.recv() if conn.poll() else None
                    except EOFError:
                        message = None
                    if message is None:
                        procs[rank].join(5)
                        message = ("error", RankError(f"rank {rank} died without a result (exit code "
                                                      f"{procs[rank].exitcode})"), "")
                    del conns[rank]
                    if message[0] == "ok":
                        results[rank] = message[1]
                    else:
                        results[rank] = None
                        errors.append((rank, message[1], message[2]))
                        deadline = min(deadline, time.monotonic() + 10)  # the others get a moment to fail too
        if len(results) < world_size:
            missing = sorted(set(range(world_size)) - set(results))
            errors.append((missing[0], RankError(f"rank(s) {missing} did not finish within {timeout_s:g} s"), ""))
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(10)
        for conn in conns.values():
            conn.close()
        for rank in sorted(procs):
            for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
                path = Path(workdir) / f"rank{rank}.{name}"
                if path.exists():
                    stream.write(path.read_text(errors="replace"))
        shutil.rmtree(workdir, ignore_errors=True)
    if errors:  # the cause, not its echo: a peer's closed connection or a timeout comes after the real error
        rank, exc, tb = min(errors, key=lambda e: (_is_symptom(e[1]), errors.index(e)))
        if tb:
            exc.__cause__ = RemoteTraceback(f"\n\nin rank {rank}:\n{tb}")
        raise exc
    return [results[r] for r in range(world_size)]


def _is_symptom(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RankError) or "Connection closed by peer" in text or "Connection reset" in text


def start(fn, *args):
    """`fn(*args)` in a process forked from run_ranks' warm fork server (no process group, no output captured),
    started and returned (a multiprocessing Process): for a test that kills it midway."""
    process = _context().Process(target=fn, args=args)
    process.start()
    return process


# The one override list every sft run in the tests starts from: fp32 and a constant lr (so an 8-step run and a
# 4-step run share a schedule and resumes can be compared with a straight run), no eval, no progress bar.
BASE = ["train.mixed_precision=fp32", "train.lr=3e-3", "train.warmup_steps=0", "train.min_lr_ratio=1.0", "eval.path=",
        "log.progress=false"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSON-lines file at `path`; returns the path."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_config(model_dir, data, out, *overrides):
    """The Config `finetune sft --model model_dir --dataset data --output-dir out BASE... overrides...` builds."""
    from finetune.args import build_config
    return build_config(None, [*BASE, *map(str, overrides)], **{"model.path": str(model_dir), "data.path": str(data),
                                                               "output_dir": str(out)})


def train_rank(cfg):
    """finetune.train.train(cfg) on one rank (a top-level function for run_ranks)."""
    from finetune.train import train
    return train(cfg, "sft")


def sft(model_dir, data, out, *overrides, nproc: int = 1, env: dict | None = None) -> list[dict]:
    """An sft run in-process on `nproc` gloo ranks (run_ranks); returns metrics.jsonl's records."""
    run_ranks(train_rank, nproc, sft_config(model_dir, data, out, *overrides), env=env)
    return read_metrics(out)


def sft_cli(model_dir, data, out, *overrides, nproc: int = 1, **kwargs):
    """The same run through the CLI (`finetune sft`, the elastic launcher for nproc > 1; run_cli's kwargs)."""
    return run_cli("sft", "--model", model_dir, "--dataset", data, "--output-dir", out, "--nproc-per-node", nproc,
                   *BASE, *overrides, **kwargs)


def invoke(*args):
    """`finetune *args` in this process through the typer app (typer's CliRunner: result.exit_code, .stdout,
    .stderr), for commands that stop before any rank starts or run no ranks (or run bench's points, children of this
    process's fork server: started here with PRELOAD first). What a command leaves in the process (environment
    variables such as FINETUNE_LOCK, signal handlers) is undone after it."""
    from typer.testing import CliRunner

    from finetune.cli import app
    if args and args[0] == "bench":  # its points share this process's fork server: the ranks' one (PRELOAD), not
        from multiprocessing import forkserver  # one bench would start with its own list for the rest of the session
        _context()
        forkserver.ensure_running()
    env, handlers = dict(os.environ), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        return CliRunner().invoke(app, list(map(str, args)))
    finally:
        os.environ.clear()
        os.environ.update(env)
        for s, handler in handlers.items():
            signal.signal(s, handler)


CLI_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}


def cli_env(env: dict | None = None) -> dict:
    """The whole environment of a CLI run the tests start: this process's, CLI_ENV, then `env`."""
    return {**os.environ, **CLI_ENV, **(env or {})}


def _cli_main(args: list, env: dict, cwd: str, out, err, new_session: bool) -> None:
    """`finetune *args` in a child of the fork server, as `python -m finetune` would run it there."""
    if new_session:
        os.setsid()
    for fd, conn in ((1, out), (2, err)):
        os.dup2(conn.fileno(), fd)
        conn.close()
    sys.stdout.reconfigure(write_through=True)  # as PYTHONUNBUFFERED does for a fresh interpreter
    sys.stderr.reconfigure(write_through=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["finetune", *args]
    from finetune.cli import main
    main()  # its SystemExit is the process's exit code, as in a fresh interpreter


class CliProcess:
    """`finetune *args` started like `subprocess.Popen([python, "-m", "finetune", *args], text=True, stdout=PIPE,
    stderr=PIPE)` (the same interface: pid, stdout, stderr, poll, wait, communicate, send_signal, kill, returncode),
    but forked from run_ranks' warm fork server: the command, its launcher and signal handling are the real ones;
    only the ~5 s of CPU a fresh interpreter spends importing torch and transformers is skipped. The ranks a launcher
    starts are fresh interpreters as always. `env` is the whole environment of the command (the server's own is the
    one this process had when it started)."""

    def __init__(self, args, env: dict, cwd: Path = REPO, start_new_session: bool = False):
        self.args, ctx = [*map(str, args)], _context()
        (out, out_w), (err, err_w) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)  # raw pipes, passed by fd
        self._process = start(_cli_main, self.args, env, str(cwd), out_w, err_w, start_new_session)
        out_w.close()
        err_w.close()
        self.pid, self.returncode = self._process.pid, None
        self.stdout, self.stderr = (open(os.dup(c.fileno()), errors="replace") for c in (out, err))
        out.close()
        err.close()

    def poll(self):
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(["finetune", *self.args], timeout)
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) read to the end while the command runs, then its exit code in returncode."""
        import threading
        texts = {}
        readers = [threading.Thread(target=lambda s=s: texts.__setitem__(s, s.read()), daemon=True)
                   for s in (self.stdout, self.stderr)]
        for r in readers:
            r.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in readers:
            r.join(None if deadline is None else max(0, deadline - time.monotonic()))
        if any(r.is_alive() for r in readers):
            raise subprocess.TimeoutExpired(["finetune", *self.args], timeout)
        self.wait(None if deadline is None else max(1, deadline - time.monotonic()))
        self.stdout.close()
        self.stderr.close()
        return texts[self.stdout], texts[self.stderr]

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def cli_process(*args, env: dict | None = None, cwd: Path = REPO, start_new_session: bool = False) -> CliProcess:
    """`finetune *args` running (a CliProcess), in cli_env(env)."""
    return CliProcess(args, cli_env(env), cwd, start_new_session)


def run_cli(*args, env: dict | None = None, timeout: int = 300, check: bool = True, cwd: Path = REPO,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """`finetune *args` to its end: (args, returncode, stdout, stderr); an AssertionError with its output if it
    failed and `check`. In a warm CliProcess, or with `fresh`, a fresh `python -m finetune` (its own imports, from
    `cwd`: what a user's shell runs)."""
    env = cli_env(env)
    if fresh:
        proc = subprocess.run([sys.executable, "-m", "finetune", *map(str, args)], cwd=cwd, text=True, timeout=timeout,
                              env=env, capture_output=True)
    else:
        cli = CliProcess(args, env, cwd)
        try:
            stdout, stderr = cli.communicate(timeout=timeout)
        finally:
            cli.kill()
        proc = subprocess.CompletedProcess(cli.args, cli.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"finetune {' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(output_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir)]


def count_builds_and_opens(monkeypatch) -> dict[str, list]:
    """From now on, record each model construction (the config of every AutoModelForCausalLM.from_config, which
    every meta skeleton goes through), each tensor source opened (finetune.hf.files.open_dcp, open_safetensors/
    open_live, also where imported by name) and each DCP metadata read (FileSystemReader.read_metadata)."""
    import sys
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM
    seen: dict[str, list] = {"builds": [], "opens": [], "metadata_reads": []}

    def counted(fn, log: list, what):
        def wrapper(*args, **kwargs):
            log.append(what(*args))
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(AutoModelForCausalLM, "from_config",
                        counted(AutoModelForCausalLM.from_config, seen["builds"], lambda config: config))
    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", counted(
        dcp.FileSystemReader.read_metadata, seen["metadata_reads"], lambda reader, *a: str(reader.path)))
    for name in ("open_dcp", "open_safetensors", "open_live"):
        def source_of(source, *args, name=name):
            return name, str(source) if isinstance(source, (str, Path)) else type(source).__name__
        for module in [m for n, m in list(sys.modules.items()) if n.startswith("finetune") and hasattr(m, name)]:
            monkeypatch.setattr(module, name, counted(getattr(module, name), seen["opens"], source_of))
    return seen


def export_hf(*args, **kwargs):
    """finetune.export.export_hf, imported when called (a test module imports no torch at collection)."""
    from finetune.export import export_hf as export
    return export(*args, **kwargs)
