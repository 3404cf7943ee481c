"""A `finetune` process's console (cli.main calls `setup` first): the libraries' progress bars and logs quiet, and
Ctrl-C before training (then checkpoint.SignalFlag takes over: save and stop) or during an export as one line."""
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
