"""One line for a run whose ranks refused their input (launch.launch's `errors`): each rank leaves its error line in a
file (launch.report), the launcher prints the first, and holds torch's own account of the failure meanwhile."""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from logging.handlers import MemoryHandler

from ..launch import RANK_ERRORS
from .console import forward_interrupts


def print_rank_errors(where: str) -> bool:
    """Print the first error line the ranks left in `where` and how many failed otherwise; False when none did."""
    lines = [open(os.path.join(where, name)).read() for name in sorted(os.listdir(where))]
    if lines:
        others = len(lines) - lines.count(lines[0])
        print(lines[0] + (f" ({others} other rank(s) failed otherwise: --debug shows each)" if others else ""),
              file=sys.stderr, flush=True)
    return bool(lines)


@contextmanager
def rank_errors():
    """Around the ranks' launch: yields what to call when they failed (prints the ranks' line, print_rank_errors);
    a Ctrl-C meanwhile goes to the ranks (console.forward_interrupts)."""
    forward_interrupts()
    # torch's own lines about the ranks (a rank "failed (exitcode: 2)", SIGTERM sent to the others) are held: shown
    # when a rank crashed, left out when the ranks refused the input (then one line says why: print_rank_errors)
    held, loggers = MemoryHandler(capacity=10**6, flushLevel=logging.CRITICAL + 1), [
        logging.getLogger(name) for name in ("torch.distributed.elastic.multiprocessing",
                                             "torch.distributed.elastic.agent")]  # rendezvous logs stay live
    for logger in loggers:
        logger.addHandler(held)
        logger.propagate = False
    os.environ[RANK_ERRORS] = errors = tempfile.mkdtemp(prefix="finetune-rank-errors-")
    refused = []
    try:
        yield lambda: refused.append(print_rank_errors(errors))
    finally:
        for logger in loggers:
            logger.removeHandler(held)
            logger.propagate = True
        if not any(refused):
            for record in held.buffer:
                logging.getLogger(record.name).handle(record)
        held.close()
        del os.environ[RANK_ERRORS]
        shutil.rmtree(errors, ignore_errors=True)
