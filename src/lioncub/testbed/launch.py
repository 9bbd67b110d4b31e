"""The one local launcher: a process group of ``nproc`` workers spawned on this machine.

The tests (``tests/dist.py``'s ``run_workers``), the harness (``lioncub.harness.launch.spawn_local``)
and the benchmarks that use either all start their workers here, so a free port, the spawn,
the rendezvous, the result hand-back and the clean-up on failure are written once.

``spawn(fn, nproc, *args)`` runs ``fn(rank, nproc, *args)`` in ``nproc`` processes started with
``torch.multiprocessing``'s ``spawn`` method (a fresh interpreter each: no forked CUDA or
thread state), after each has joined a TCP rendezvous on a free loopback port. It returns every
rank's (picklable) result in rank order. When a rank fails, the others are killed (they would
wait for it in a collective until the group's timeout) and :class:`WorkerError` names the rank
and carries its traceback; ``allow_exit`` lists ranks that may die without that, for tests of
worker failure. A whole-run ``deadline_s`` bounds a hang that no collective notices.
"""
from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback

__all__ = ["WorkerError", "free_port", "spawn", "preload"]


class WorkerError(RuntimeError):
    """A worker failed: ``rank``, its exit code and, when it raised, its ``traceback``."""

    def __init__(self, rank: int, exitcode, tb: str | None):
        self.rank, self.exitcode, self.traceback = rank, exitcode, tb
        super().__init__(f"rank {rank} failed (exit code {exitcode}):\n{tb or '(no traceback: killed or crashed)'}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; the rendezvous binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _one_thread(rank: int, world_size: int) -> str:
    """Default per-rank setup: one CPU thread (many workers share few cores), gloo."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    return "gloo"


def _entry(rank, world_size, port, job, out_dir, timeout_s, keep, env, cwd):
    import torch.distributed as dist

    path = os.path.join(out_dir, f"{rank}.pkl")
    try:
        if env is not None:  # a forkserver's child: the caller's environment and directory, not the server's
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
        fn, args, setup = pickle.loads(job)  # after the environment: unpickling imports fn's module
        backend = (setup or _one_thread)(rank, world_size)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args)
        with open(path, "wb") as f:
            pickle.dump(("ok", result if keep is None or rank in keep else None), f)
    except BaseException:  # hand every failure to the parent, then exit non-zero
        with open(path, "wb") as f:
            pickle.dump(("error", (time.time(), traceback.format_exc())), f)  # when: the first failure is the cause
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _read(out_dir: str, rank: int):
    path = os.path.join(out_dir, f"{rank}.pkl")
    if not os.path.exists(path):
        return "missing", None
    with open(path, "rb") as f:
        return pickle.load(f)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def spawn(fn, nproc: int, *args, timeout_s: float = 600.0, deadline_s: float | None = None,
          allow_exit=(), setup=None, keep=None, start_method: str = "spawn") -> list:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` local workers; return their results by rank.

    Args:
        fn: a module-level (picklable) function; its return value must pickle.
        timeout_s: the process group's collective timeout.
        deadline_s: the whole run's bound (default ``2 * timeout_s``); past it every worker is
            killed and TimeoutError raised.
        allow_exit: ranks that may fail or die (their result is None) without the others being killed.
        setup: ``setup(rank, nproc) -> backend``, run in each worker before the rendezvous
            (threads, environment, device); default one CPU thread and gloo.
        keep: ranks whose results come back (default all; the others' are None), for results
            that only one rank's copy of is wanted.
        start_method: ``'spawn'`` (a fresh interpreter per worker) or ``'forkserver'``: each worker
            forked from one server process that imported the modules of :func:`preload` once, so a
            group starts in milliseconds instead of seconds of imports; still a fresh process per
            worker (nothing carries over between calls), with the caller's environment and working
            directory applied before ``fn`` is unpickled.

    Raises WorkerError for the first failing rank not in ``allow_exit``. A SIGTERM to the
    launcher (from the main thread) kills the workers too.
    """
    import torch.multiprocessing as mp

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1; got {nproc!r}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    allow_exit = set(allow_exit)
    keep = None if keep is None else set(keep)
    job = pickle.dumps((fn, args, setup))
    env, cwd = (dict(os.environ), os.getcwd()) if start_method == "forkserver" else (None, None)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the rendezvous is on loopback
    deadline = time.monotonic() + (2 * timeout_s if deadline_s is None else deadline_s)
    main = threading.current_thread() is threading.main_thread()
    with tempfile.TemporaryDirectory(prefix="lioncub-spawn-") as out_dir:
        ctx = mp.start_processes(_entry, args=(nproc, free_port(), job, out_dir, timeout_s, keep, env, cwd),
                                 nprocs=nproc, join=False, start_method=start_method)
        procs = ctx.processes
        previous = signal.signal(signal.SIGTERM, _raise_exit) if main else None
        try:
            while True:
                failed = [r for r, p in enumerate(procs)
                          if not p.is_alive() and p.exitcode not in (0, None) and r not in allow_exit]
                if failed:
                    time.sleep(1.0)  # let the ranks that fail in its wake land their reports
                    raise _first_failure(out_dir, procs, failed, allow_exit)
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                if not alive:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers still running after the deadline (alive: {alive}); killed")
                time.sleep(0.05)
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
        results = []
        for r in range(nproc):
            status, payload = _read(out_dir, r)
            if r not in allow_exit and status != "ok":
                raise _first_failure(out_dir, procs, [r], allow_exit)
            results.append(payload if status == "ok" else None)
        return results


def preload(modules) -> None:
    """Modules the forkserver imports once, before its first fork (``start_method='forkserver'``).
    Call before the first forkserver spawn of the process; later calls have no effect on a server
    already running."""
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(modules))


def _first_failure(out_dir: str, procs, failed: list[int], allow_exit: set) -> WorkerError:
    """The cause among the failures: a rank that died without a report (crashed or killed), else
    the rank whose exception came first (the others typically fail on its closed connections)."""
    failed = [r for r, p in enumerate(procs)  # again: more may have died since
              if not p.is_alive() and p.exitcode not in (0, None) and r not in allow_exit] or failed
    crashed = [r for r in failed if _read(out_dir, r)[0] != "error"]
    if crashed:
        return WorkerError(crashed[0], procs[crashed[0]].exitcode, None)
    errors = []  # (when, rank, traceback) of every rank that reported an exception
    for r in range(len(procs)):
        status, payload = _read(out_dir, r)
        if status == "error" and r not in allow_exit:
            errors.append((payload[0], r, payload[1]))
    if not errors:  # a rank exited non-zero after reporting success (e.g. in the group's teardown)
        return WorkerError(failed[0], procs[failed[0]].exitcode, None)
    _, r, tb = min(errors)
    return WorkerError(r, procs[r].exitcode, tb)
