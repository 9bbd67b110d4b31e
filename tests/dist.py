"""Run a function on a real multi-process torch.distributed (gloo) group.

Tests call ``run_workers(fn, world_size, *args)``; ``fn(rank, world_size, *args)``
runs in each spawned worker after ``init_process_group`` and may return a
picklable value. The list of per-rank return values comes back in rank order.
An exception in any worker fails the test with that worker's traceback.

Spawning costs ~2 s per group (torch import), so tests batch several checks
into one ``fn`` rather than spawning per check.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, out_dir, timeout_s):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        with open(path, "wb") as f:
            pickle.dump(("ok", result), f)
    except BaseException:  # report every failure to the parent, then exit non-zero
        with open(path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_allowing_exits(ctx, world_size, out_dir, allow_exit, deadline):
    """Wait for every worker without killing the others when one dies (ctx.join would)."""
    import time

    while any(p.is_alive() for p in ctx.processes):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise TimeoutError(f"workers still running after the deadline (alive: "
                               f"{[r for r, p in enumerate(ctx.processes) if p.is_alive()]})")
        time.sleep(0.1)
    results = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"{r}.pkl")
        status, payload = ("missing", None)
        if os.path.exists(path):
            with open(path, "rb") as f:
                status, payload = pickle.load(f)
        if r in allow_exit:
            results.append(payload if status == "ok" else None)
        elif status != "ok":
            raise AssertionError(f"rank {r} failed (exit code {ctx.processes[r].exitcode}):\n{payload}")
        else:
            results.append(payload)
    return results


def run_workers(fn, world_size: int, *args, timeout_s: float = 120.0, allow_exit=(), deadline_s=None):
    """Spawn ``world_size`` gloo workers running ``fn``; return their results by rank.

    ``timeout_s`` is the process group's timeout. ``allow_exit``: ranks that may die
    or fail (their result is None) without the others being killed, for tests of
    worker failure. ``deadline_s`` bounds the whole run (default ``2 * timeout_s``).
    """
    port = _free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, port, fn, args, out_dir, timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        import time

        deadline = time.monotonic() + (2 * timeout_s if deadline_s is None else deadline_s)
        if allow_exit:
            return _wait_allowing_exits(ctx, world_size, out_dir, set(allow_exit), deadline)
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    raise TimeoutError(f"workers still running after {2 * timeout_s:.0f} s")
        except Exception as exc:  # surface the first worker traceback we saved
            for r in range(world_size):
                p = os.path.join(out_dir, f"{r}.pkl")
                if os.path.exists(p):
                    with open(p, "rb") as f:
                        status, payload = pickle.load(f)
                    if status == "error":
                        raise AssertionError(f"rank {r} failed:\n{payload}") from exc
            raise
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                status, payload = pickle.load(f)
            assert status == "ok", payload
            results.append(payload)
        return results
