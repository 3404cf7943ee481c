"""A `finetune` process's console (cli.main calls `setup` first): the libraries' progress bars and logs quiet, and
Ctrl-C before training (then checkpoint.SignalFlag takes over: save and stop) or during an export as one line; in a
launcher of ranks (`forward_interrupts`), Ctrl-C passed on to them."""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn


def interrupted(signum, frame) -> NoReturn:
    print("finetune: interrupted; nothing was saved", file=sys.stderr, flush=True)
    raise SystemExit(130)


def setup() -> None:
    # our progress bar and log lines only: no per-load bars from transformers/datasets
    for key, value in (("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("TRANSFORMERS_VERBOSITY", "error"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    # torchao (imported by peft where it is installed) registers an Enum with torch's pytree, which logs a
    # deprecation warning in every process: not ours to act on, and it would break the one-line errors
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    signal.signal(signal.SIGINT, interrupted)


def forward_interrupts() -> None:
    """In the launcher (run/rank_errors.py): the first Ctrl-C passed on to the ranks, the second kills them."""
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
