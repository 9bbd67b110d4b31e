"""The one local launcher (lioncub.testbed.launch.spawn) as tests and the harness use it:
results by rank, the failing rank named with its traceback, the others killed, a deadline."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from lioncub.testbed.launch import WorkerError, spawn
from tests.dist import run_workers


def _sum_ranks(rank, world, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return scale * t.item(), os.environ.get("OMP_NUM_THREADS")


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits for rank 1 here until the launcher kills it


def _rank1_hangs(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank


def test_results_by_rank_and_keep():
    assert run_workers(_sum_ranks, 2, 10.0) == [(10.0, "1"), (10.0, "1")]
    assert spawn(_sum_ranks, 2, 1.0, timeout_s=60, keep={0}) == [(1.0, "1"), None]


@pytest.mark.slow  # ~19 s of a worker dying and the others being killed: .ci/run runs it after the suite
def test_failing_rank_is_named_with_its_traceback_and_the_others_are_killed():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed.*ValueError: boom on purpose"):
        run_workers(_rank1_raises, 2, timeout_s=60)
    assert time.monotonic() - t0 < 30  # not the group's 60 s timeout: rank 0 was killed
    with pytest.raises(TimeoutError, match=r"alive: \[(0, )?1\]"):
        spawn(_rank1_hangs, 2, timeout_s=60, deadline_s=15)
    with pytest.raises(ValueError, match="nproc must be an int >= 1"):
        spawn(_rank1_hangs, 0)
    assert issubclass(WorkerError, RuntimeError)
