"""Fault injection for the tests: crashes and pauses at exact steps, from the environment variable
FINETUNE_TEST_FAULTS="kill_at_step=6,kill_in_save=8,pause_at_step=3":

  kill_at_step=N   SIGKILL this rank at the start of step N (a crash while training)
  kill_in_save=N   SIGKILL this rank once DCP has written step N's checkpoint, before the completeness marker
                   (a crash while saving)
  pause_at_step=N  at the start of step N, print "finetune: rank R paused at step N" on stderr and block until a
                   preemption signal arrived (the run's SignalFlag is set), so a test can signal a run at a known step
                   instead of sleeping and polling

Not part of the package: `install()` patches the core in the process of one rank. A launched rank runs it from
finetune.launch.rank_main when FINETUNE_TEST_FAULTS is set (this directory is on PYTHONPATH: conftest.py), an
in-process rank from helpers.run_ranks. A non-finite loss is injected by the tests themselves (a forward hook).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

KINDS = ("kill_at_step", "kill_in_save", "pause_at_step")


def spec(text: str | None = None) -> dict[str, int]:
    """{fault: step} from `text` (default FINETUNE_TEST_FAULTS); a malformed entry is a ValueError (a broken test,
    not user input)."""
    parsed = {}
    text = os.environ.get("FINETUNE_TEST_FAULTS", "") if text is None else text
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in KINDS or not value.isdigit():
            raise ValueError(f"FINETUNE_TEST_FAULTS: bad entry {item!r}; expected one of {', '.join(KINDS)} "
                             f"as name=step")
        parsed[name] = int(value)
    return parsed


def kill_if(faults: dict, kind: str, step: int) -> None:
    if faults.get(kind) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def pause_if(faults: dict, step: int, released: Callable[[], bool]) -> None:
    if faults.get("pause_at_step") == step:
        sys.stderr.flush()  # one write of the whole line: print() writes the newline apart, and ranks interleave
        os.write(2, f"finetune: rank {os.environ.get('RANK', '0')} paused at step {step}\n".encode())
        while not released():
            time.sleep(0.02)


def install(text: str | None = None) -> dict[str, int]:
    """Patch this process's finetune so the faults of `text` (default FINETUNE_TEST_FAULTS) fire; returns them.
    The start of step N is the loop's call of train.next_micro_batches while the run's TrainState is at step N - 1;
    "saved but not marked" is the start of Checkpointer.finish (every rank, then rank 0 writes the marker)."""
    import finetune.checkpoint as ckpt
    import finetune.train as train
    faults = spec(text)
    run = {}  # the TrainState and the SignalFlag of the run in this process (the latest made)
    for cls, method, key in ((ckpt.TrainState, "__init__", "state"), (ckpt.SignalFlag, "__enter__", "signals")):
        def remember(self, *args, _original=getattr(cls, method), _key=key, **kwargs):
            run[_key] = self
            return _original(self, *args, **kwargs)
        setattr(cls, method, remember)

    def next_micro_batches(*args, _original=train.next_micro_batches, **kwargs):
        if "state" in run and "signals" in run:
            step = run["state"].step + 1
            kill_if(faults, "kill_at_step", step)
            pause_if(faults, step, lambda: run["signals"].name is not None)
        return _original(*args, **kwargs)
    train.next_micro_batches = next_micro_batches

    def finish(self, path, marker, _original=ckpt.Checkpointer.finish):
        kill_if(faults, "kill_in_save", marker["step"])
        return _original(self, path, marker)
    ckpt.Checkpointer.finish = finish
    return faults
