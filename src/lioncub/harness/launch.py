"""Process launch: under ``torchrun`` (env:// rendezvous) or spawning local workers.

``launch(fn, config)`` returns ``fn(config)`` as computed on rank 0:

- inside an initialised process group: calls ``fn`` directly (the caller owns the group);
- under torchrun (RANK/WORLD_SIZE in the environment): joins the env:// rendezvous,
  single or multi node, NCCL when the device is CUDA, gloo otherwise;
- else: spawns ``config.nproc`` workers on this machine (TCP rendezvous on loopback).

``run_in_testbed(argv, nproc, link)`` runs a whole ``lioncub`` command once per worker
inside an emulated cluster (:class:`lioncub.testbed.Testbed`: a namespace per worker,
every link shaped to ``link``), where each worker finds torchrun's environment.
"""
from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0


def _timeout(config) -> datetime.timedelta:
    """The process group's collective timeout: ``config.timeout`` seconds (``--timeout``)."""
    return datetime.timedelta(seconds=float(getattr(config, "timeout", DEFAULT_TIMEOUT_S)))


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> cuda:LOCAL_RANK when CUDA is present, else cpu."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available; use 'auto' or 'cpu'")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def launch(fn, config):
    """Run ``fn(config)`` on every rank of a process group; return rank 0's result."""
    if dist.is_available() and dist.is_initialized():
        return fn(config)
    if under_torchrun():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = resolve_device(config.device, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _init_under_torchrun(_backend(device), _timeout(config))
        try:
            return fn(config)
        finally:
            dist.destroy_process_group()
    return spawn_local(fn, config, config.nproc)


def _init_under_torchrun(backend: str, timeout: datetime.timedelta) -> None:
    """env:// rendezvous, with the keys of each torchrun restart under their own prefix.

    torchrun's workers share the agent's TCP store across restarts (TORCHELASTIC_USE_AGENT_STORE),
    so a restarted attempt could read the dead attempt's gloo addresses and fail to connect
    ("connectFullMesh ... Connection refused"); a prefix per TORCHELASTIC_RESTART_COUNT avoids that."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"lioncub/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)


def spawn_local(fn, config, nproc: int):
    """Spawn ``nproc`` local workers running ``fn(config)``; return rank 0's result.

    Through the one local launcher (:func:`lioncub.testbed.launch.spawn`); each worker gets
    torchrun's RANK/LOCAL_RANK/WORLD_SIZE, a share of the cores and its device first.
    A failing worker raises :class:`lioncub.testbed.WorkerError` (a RuntimeError) with its traceback.
    """
    from functools import partial

    from ..testbed.launch import spawn

    return spawn(_call, nproc, fn, config, timeout_s=_timeout(config).total_seconds(),
                 deadline_s=float("inf"), setup=partial(_prepare_rank, config), keep={0})[0]


def _prepare_rank(config, rank: int, world_size: int) -> str:
    """A spawned worker's setup before the rendezvous; returns the process group's backend."""
    # Share the cores: 4 workers on a 2-core laptop get one thread each.
    threads = max(1, (os.cpu_count() or 1) // world_size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    device = resolve_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return _backend(device)


def _call(rank: int, world_size: int, fn, config):
    return fn(config)


def run_in_testbed(argv: list[str], nproc: int, link, *, prefix: str = "lct", nodes: int | None = None) -> int:
    """Run ``python -m lioncub.cli *argv`` on ``nproc`` workers behind ``link``-shaped links.

    ``link``: a rate such as '1gbit' or '500mbit', or None (unshaped). ``nodes``: namespaces
    (default ``nproc``: a worker each); the ranks of one node talk unshaped. Rank 0 prints to
    this terminal; the other ranks' output is kept only when a worker fails. Needs root.
    Returns the first non-zero exit code, else 0.
    """
    import sys

    from ..testbed.netem import Testbed, check_available, wait_all

    reason = check_available()
    if reason is not None:
        raise RuntimeError(f"--link needs the netem testbed, which cannot be built here: {reason}")
    cmd = [sys.executable, "-m", "lioncub.cli"] + list(argv)
    with tempfile.TemporaryDirectory(prefix="lioncub-link-") as tmp, Testbed(nproc, rate=link, prefix=prefix, nodes=nodes) as tb:
        logs = [None] + [open(os.path.join(tmp, f"{r}.log"), "w+") for r in range(1, nproc)]
        try:
            procs = tb.launch([cmd] * nproc, stdout=logs, stderr=[None] + logs[1:])
            wait_all(procs, timeout=7 * 24 * 3600.0)
            codes = [p.returncode for p in procs]
            for r, code in enumerate(codes):
                if code and r:
                    logs[r].seek(0)
                    sys.stderr.write(f"--- worker {r} exited with {code}:\n{logs[r].read()[-4000:]}\n")
        finally:
            for f in logs[1:]:
                f.close()
    return next((c for c in codes if c), 0)
