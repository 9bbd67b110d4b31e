"""Run a function on a real multi-process torch.distributed (gloo) group.

Tests call ``run_workers(fn, world_size, *args)``; ``fn(rank, world_size, *args)``
runs in each worker after ``init_process_group`` and may return a picklable value. The list
of per-rank return values comes back in rank order. An exception in any worker fails the test
with that worker's traceback.

The workers are started by the library's one local launcher
(:func:`lioncub.testbed.launch.spawn`, one CPU thread each); this module only turns its
WorkerError into a test failure. They are forked from a forkserver that imported torch and
lioncub once for the whole run (``PRELOAD``): every call still gets fresh processes (no state
carries from one test to the next: seeds, globals, process groups), with the test's own
environment and working directory, but skips the ~2 s of imports each spawned interpreter pays.
"""
from __future__ import annotations

import os

from lioncub.testbed.launch import WorkerError, preload, spawn

PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "numpy", "lioncub", "pytest", "tests.dist")
"""What the forkserver imports once. ``torch._dynamo``: every ``torch.optim.Optimizer`` imports it
on construction (~3 s of CPU per worker otherwise); it imports triton where triton is installed,
so the server starts with ``TRITON_INTERPRET=1`` (workers have no GPU: triton can only interpret,
and tests/test_triton.py's kernels call triton.language's own, which must be interpreted too)."""
START_METHOD = "forkserver"


def _start_server() -> None:
    """Start the forkserver if it is not running (at the first call: a session that runs no group
    never pays for it; again if it died)."""
    import multiprocessing.forkserver

    from lioncub import fused

    fused.available()  # the C loops built once, into the run's LIONCUB_CACHE: workers load them, none compiles
    preload(PRELOAD)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def run_workers(fn, world_size: int, *args, timeout_s: float = 120.0, allow_exit=(), deadline_s=None):
    """Start ``world_size`` gloo workers running ``fn``; return their results by rank.

    ``timeout_s`` is the process group's timeout. ``allow_exit``: ranks that may die
    or fail (their result is None) without the others being killed, for tests of
    worker failure. ``deadline_s`` bounds the whole run (default ``2 * timeout_s``).
    Raises AssertionError naming the failing rank, with its traceback.
    """
    _start_server()
    try:
        return spawn(fn, world_size, *args, timeout_s=timeout_s, deadline_s=deadline_s, allow_exit=allow_exit,
                     start_method=START_METHOD)
    except WorkerError as exc:
        raise AssertionError(str(exc)) from None
