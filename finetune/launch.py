"""Where commands run: `guarded` (our errors as one line), `launch` (here, or on elastic-launched ranks), rank_main."""
from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from typing import Callable

from .errors import STORAGE_ERRNOS, FinetuneError, os_error_line


def guarded(fn: Callable, debug: bool, *args):
    """Run fn; our errors and storage OS errors (exit 1) end as `error: <one line>` and their exit code (or --debug)."""
    try:
        return fn(*args)
    except FinetuneError as e:
        if debug:
            raise
        if not e.on_rank0 or os.environ.get("RANK", "0") == "0":
            report(f"error: {e}")
        raise SystemExit(e.exit_code)
    except OSError as e:
        if debug or e.errno not in STORAGE_ERRNOS:
            raise
        report(f"error: {os_error_line(e)}{'' if e.filename else ' (--debug shows where)'}")
        raise SystemExit(1)


RANK_ERRORS = "FINETUNE_RANK_ERRORS"  # a dir where the ranks our launcher started leave their one-line errors


def report(line: str) -> None:
    """An error line on stderr; in a rank our launcher started, into its file instead (the launcher prints one)."""
    where = os.environ.get(RANK_ERRORS)
    if where and "RANK" in os.environ and os.path.isdir(where):
        with open(os.path.join(where, f"rank{int(os.environ['RANK']):06d}"), "w") as f:
            f.write(line)
        return
    print(line, file=sys.stderr, flush=True)


def set_threads(nproc: int) -> None:
    """OMP_NUM_THREADS defaults to physical cores / local ranks (oversubscription slows CPU runs a lot)."""
    if "OMP_NUM_THREADS" not in os.environ:
        import psutil
        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nproc))


def launch(entry: Callable, args: tuple, nproc: int, debug: bool, on_signal: Callable[[], bool] | None = None,
           nnodes: int = 1, rdzv_endpoint: str = "", errors: Callable | None = None):
    """entry(*args) here when one rank (or under torchrun); else `nproc` local ranks re-running this command line."""
    set_threads(nproc)  # nproc >= 1: checked with the rest of the input
    if (nproc <= 1 and nnodes <= 1) or "RANK" in os.environ:
        return rank_main(entry, args, debug)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    # the launcher forwards SIGTERM/SIGUSR1 to the ranks and gives them time to save before it kills them (Ctrl-C:
    # run/console.forward_interrupts, from the `errors` context)
    with (errors or nullcontext)() as refused:  # errors: a context whose value is called when the ranks failed
        try:
            elastic_launch(local_launch_config(nproc, nnodes, rdzv_endpoint), sys.executable)("-m", "finetune",
                                                                                             *sys.argv[1:])
        except ChildFailedError as e:
            codes = [f.exitcode for f in e.failures.values()]
            if refused is not None:
                refused()
            raise SystemExit(2 if 2 in codes else (codes[0] or 1)) from None
        except SignalException as e:
            ok = on_signal() if on_signal else False
            print(f"finetune: {e.sigval.name} forwarded to the ranks; "
                  f"{'they saved and stopped' if ok else 'no new checkpoint was completed'}", file=sys.stderr)
            raise SystemExit(0 if ok else 1) from None


def local_launch_config(nproc: int, nnodes: int = 1, rdzv_endpoint: str = ""):
    """torch's elastic LaunchConfig for `nproc` ranks here (of `nnodes` meeting at `rdzv_endpoint`), no restarts."""
    import uuid
    from .compat import launch_config
    from .distributed import free_port
    # every node's launcher must name the same rendezvous run: the SLURM job, or one fixed name per endpoint
    run_id = os.environ.get("SLURM_JOB_ID", "finetune") if nnodes > 1 else str(uuid.uuid4())
    return launch_config(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=run_id, rdzv_backend="c10d",
                       rdzv_endpoint=rdzv_endpoint or f"127.0.0.1:{free_port()}", max_restarts=0,
                       signals_to_handle="SIGTERM,SIGHUP,SIGQUIT,SIGUSR1", monitor_interval=0.5,
                       shutdown_timeout=int(os.environ.get("FINETUNE_SHUTDOWN_TIMEOUT_S", 3600)))


def rank_main(entry: Callable, args: tuple, debug: bool):
    """One rank: threads, the entry, errors as one line + exit 2, process group torn down."""
    import torch
    from .distributed import teardown
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if os.environ.get("FINETUNE_TEST_FAULTS"):  # the tests' fault injector: tests/faults.py, on their PYTHONPATH
        import faults
        faults.install()
    try:
        return guarded(entry, debug, *args)
    finally:
        teardown()
