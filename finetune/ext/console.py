"""A `finetune` process's console and exit (cli.main runs the app through `run`): the libraries' progress bars and logs
quiet, and Ctrl-C before training (then checkpoint.SignalFlag takes over: save and stop) or during an export as one
line; in a launcher of ranks (`forward_interrupts`), Ctrl-C passed on to them."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
from typing import NoReturn


def interrupted(signum, frame) -> NoReturn:
    print("finetune: interrupted; nothing was saved", file=sys.stderr, flush=True)
    raise SystemExit(130)


def run(app) -> None:
    """app() with the libraries quiet, Ctrl-C as one line and a quick exit."""
    # our progress bar and log lines only: no per-load bars from transformers/datasets
    for key, value in (("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("TRANSFORMERS_VERBOSITY", "error"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    # torchao (imported by peft where it is installed) registers an Enum with torch's pytree, which logs a
    # deprecation warning in every process: not ours to act on, and it would break the one-line errors
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    signal.signal(signal.SIGINT, interrupted)
    # app()'s exit (a SystemExit: every command's) ends the process with its status once the threads are joined and
    # every atexit handler ran (this one, registered first, runs last), without the interpreter's teardown: ~1.5 s of
    # CPU in each process (the launcher, each rank) freeing the modules of torch, transformers and datasets
    status = []
    atexit.register(lambda: status and (sys.stdout.flush(), sys.stderr.flush(), os._exit(status[0])))
    try:
        app()
    except SystemExit as e:  # a traceback (an uncaught exception) ends as Python ends it
        status.append(e.code if isinstance(e.code, int) else int(e.code is not None))  # Python's status for it
        raise


def forward_interrupts() -> None:
    """In the launcher (ext/rank_errors.py): the first Ctrl-C passed on to the ranks, the second kills them."""
    # the ranks run in their own sessions, so a Ctrl-C reaches them only through this process, which passes the first
    # one on (the ranks save and stop, as on SIGTERM) and kills them on the second. (Not by raising into the launcher
    # as its own handler does: an except Exception there can swallow that, leaving the ranks paused.)
    import psutil

    def on_sigint(signum, frame):
        ranks = psutil.Process().children()
        if ranks and not getattr(on_sigint, "seen", False):
            on_sigint.seen = True
            for rank in ranks:
                rank.send_signal(signal.SIGINT)
            return
        for child in psutil.Process().children(recursive=True):
            child.kill()
        print("finetune: interrupted again: ranks killed, nothing was saved", file=sys.stderr, flush=True)
        os._exit(130)
    signal.signal(signal.SIGINT, on_sigint)
