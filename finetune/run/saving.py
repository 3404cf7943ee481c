"""checkpoint.async and failed saves (train.train's): a Checkpointer that saves in the background (at most
one save in flight) and stops every rank on a failed save with one line naming its cause."""
from __future__ import annotations

import shutil
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import checkpoint
from ..checkpoint import latest_complete
from ..distributed import is_main
from ..errors import FinetuneError, one_line, os_error_line

FULL_BYTES = 2**26  # free space under which a failed save is reported as a full disk


class SaveError(FinetuneError):
    """A checkpoint could not be written (disk full, quota, read-only): exit 1, printed by rank 0."""

    exit_code = 1
    on_rank0 = True


class Checkpointer(checkpoint.Checkpointer):
    """checkpoint.Checkpointer; with use_async, at most one save in flight (a new save first waits for it)."""

    def __init__(self, root: Path, keep: int, use_async: bool = False, **kwargs):
        super().__init__(root, keep, **kwargs)
        self.use_async, self.pending = use_async, None
        # async saves run collectives from a background thread: give them their own gloo group
        self.group = dist.new_group(backend="gloo") if use_async and dist.is_initialized() else None

    def write(self, path: Path, sd: dict, marker: dict) -> None:
        if not self.use_async:
            with removed_if_failed(path):
                return super().write(path, sd, marker)
        fut, finished = dcp.async_save(sd, checkpoint_id=str(path), process_group=self.group), Future()

        def on_done(f):  # rank 0's save ends after DCP's .metadata is written: the marker can follow
            try:
                f.result()
                self.finish(path, marker)
                finished.set_result(None)
            except (Exception, CheckpointException) as e:  # raised by wait(), in the loop's thread
                finished.set_exception(e)
        getattr(fut, "upload_completion", fut).add_done_callback(on_done)
        self.pending = (finished, path)

    def wait(self) -> None:
        if self.pending is not None:
            (finished, path), self.pending = self.pending, None
            with removed_if_failed(path):
                finished.result()
        super().wait()

    def close(self) -> None:
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


@contextmanager
def removed_if_failed(path: Path):
    """A failed save stops every rank with a SaveError naming the step dir and cause; rank 0 removes the dir."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        cause = save_failure(path, [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException)
                             else [e])
        if is_main():
            shutil.rmtree(path, ignore_errors=True)
        latest = latest_complete(path.parent, report=False)
        raise SaveError(f"cannot save checkpoint {path}: {cause}; removed it (the newest complete checkpoint: "
                        f"{latest.name if latest else 'none'})") from e


def save_failure(path: Path, causes: list[BaseException]) -> str:
    """The cause of a failed save: an OS error of any rank (also a chained one), else the first error, with the free
    space where it is little (torch.save reports a full disk as "unexpected pos N vs M")."""
    for cause in causes:
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno:
                return os_error_line(cause)
            cause = cause.__cause__ or cause.__context__
    free = shutil.disk_usage(path.parent).free
    return (f"no space left on the disk? ({free} bytes free; the error: {one_line(causes[0])})" if free < FULL_BYTES
            else one_line(causes[0]))
