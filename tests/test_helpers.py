"""run_ranks: return values per rank, a real process group, a rank's exception re-raised with its traceback,
a dead rank and a hung rank reported instead of hanging the suite."""
from __future__ import annotations

import os
import time

import pytest

from helpers import RankError, run_ranks


def rank_and_sum(x):
    import torch
    import torch.distributed as dist
    t = torch.tensor(float(x + dist.get_rank()))
    dist.all_reduce(t)
    print(f"hello from rank {dist.get_rank()}")
    return dist.get_rank(), dist.get_world_size(), t.item(), os.environ.get("FAULT_NAME")


def fail_on_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("bad value on rank 1")
    dist.barrier()  # rank 0 waits here for a rank that never comes


def die_on_rank_1():
    import signal
    import torch.distributed as dist
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "alive"


def hang_on_rank_0():
    import torch.distributed as dist
    if dist.get_rank() == 0:
        time.sleep(3600)
    return "done"


def test_ranks_return_values_share_a_group_and_replay_output(capsys):
    start = time.monotonic()
    got = run_ranks(rank_and_sum, 2, 10, env={"FAULT_NAME": "x"})
    assert got == [(0, 2, 21.0, "x"), (1, 2, 21.0, "x")]
    assert run_ranks(rank_and_sum, 1, 10) == [(0, 1, 10.0, None)]
    out = capsys.readouterr().out
    assert out.index("hello from rank 0") < out.index("hello from rank 1")
    start = time.monotonic()
    for _ in range(3):
        run_ranks(rank_and_sum, 2, 0)
    per_call = (time.monotonic() - start) / 3
    print(f"run_ranks: {per_call:.2f} s per 2-rank call (warm fork server)")
    assert per_call < 10


def test_an_exception_in_a_rank_is_raised_with_its_traceback():
    with pytest.raises(ValueError, match="bad value on rank 1") as info:
        run_ranks(fail_on_rank_1, 2, timeout_s=60)
    assert "in rank 1" in str(info.value.__cause__) and "fail_on_rank_1" in str(info.value.__cause__)


def test_a_dead_rank_is_reported():
    with pytest.raises(RankError, match=r"rank 1 died without a result \(exit code -9\)"):
        run_ranks(die_on_rank_1, 2, timeout_s=60)


def test_a_hung_rank_times_out():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank\(s\) \[0\] did not finish within 3 s"):
        run_ranks(hang_on_rank_0, 2, timeout_s=3)
    assert time.monotonic() - start < 30
