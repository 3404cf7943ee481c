"""Fault injection for the tests: crashes and pauses at exact steps, from the environment variable
FINETUNE_TEST_FAULTS="kill_at_step=6,kill_in_save=8,pause_at_step=3" (parsed once per process, on first use):

  kill_at_step=N   SIGKILL this rank at the start of step N (a crash while training)
  kill_in_save=N   SIGKILL this rank once DCP has written step N's checkpoint, before the completeness marker
                   (a crash while saving)
  pause_at_step=N  at the start of step N, print "finetune: rank R paused at step N" on stderr and block until
                   `released()` is true (the loop passes "a preemption signal arrived"), so a test can signal a
                   run at a known step instead of sleeping and polling

A non-finite loss is injected by the tests themselves (a forward hook), not from here.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import time
from typing import Callable

KINDS = ("kill_at_step", "kill_in_save", "pause_at_step")


@functools.cache
def spec() -> dict[str, int]:
    """{fault: step} from FINETUNE_TEST_FAULTS; a malformed entry is a ValueError (a broken test, not user input)."""
    parsed = {}
    for item in filter(None, os.environ.get("FINETUNE_TEST_FAULTS", "").split(",")):
        name, _, value = item.partition("=")
        if name not in KINDS or not value.isdigit():
            raise ValueError(f"FINETUNE_TEST_FAULTS: bad entry {item!r}; expected one of {', '.join(KINDS)} "
                             f"as name=step")
        parsed[name] = int(value)
    return parsed


def kill_if(kind: str, step: int) -> None:
    if spec().get(kind) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def pause_if(step: int, released: Callable[[], bool]) -> None:
    if spec().get("pause_at_step") == step:
        sys.stderr.flush()  # one write of the whole line: print() writes the newline apart, and ranks interleave
        os.write(2, f"finetune: rank {os.environ.get('RANK', '0')} paused at step {step}\n".encode())
        while not released():
            time.sleep(0.02)
