"""Warm spares: a replica's replacement, started before it is needed.

A restarted replica spends most of its way back before it can join: a new interpreter imports torch and
torchft, reads its data and builds its model and optimizer (~10 s on a loaded 2-core host), while the heal
itself (the quorum and the state from a peer) takes about a second. A warm spare does the first part ahead of
time: the supervisor (``lioncub train --ft --warm-spare``) keeps, for every replica, a process that has
done everything up to making its torchft Manager and then waits on its standard input. When the replica is
lost the supervisor writes one line to its spare (the run's deadline, JSON), and the spare makes its Manager
under the lost replica's id, joins the next quorum and heals from a peer at once; the supervisor starts the
next spare for that replica once the replacement has joined (not before: on a small host its start would
take the CPU the heal needs), and, where it may (root), at the lowest priority (niceness 19), so that on a shared
host its set-up takes only the CPU the replicas leave idle, as a spare machine's would take none of theirs; on
activation its priority is the supervisor's again (:func:`restore_priority`).

A spare holds no state of the run before it is activated (its model is the seed's initial one; the heal
replaces it, and its data shard is sought to the healed round), so it can wait any length of time. A spare
whose standard input closes exits 0 (the run ended without needing it). On a real cluster the spare is a
process on a spare machine started with the same ``--ft-replica K`` options plus ``--ft-standby``, and
whatever starts the replacement writes the line.

A replica group of many ranks (``--nproc-per-replica N``) has spare *groups*: N processes started together, which
rendezvous in their own torch.distributed world (a port of the spare's), shard the model over it with FSDP2 and
warm up together before each waits for its line; the supervisor activates all N at once, and each rank makes its
Manager under the lost group's id and heals its own shard from the same rank of a live group. A spare group is
used whole or not at all: one of its ranks gone, the supervisor kills the rest.
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

__all__ = ["STANDBY_FLAG", "READY", "start_spare", "wait_ready", "activate", "wait_for_activation", "restore_priority"]

STANDBY_FLAG = "--ft-standby"
"""The replica option that makes it a spare (``lioncub train --ft-replica K --ft-standby``)."""
READY = "ready"
"""The line a spare prints on its standard output once it waits to be activated."""


def start_spare(argv: list, env: dict, ranks: int = 1, port: int = 0, nice: int = 0) -> list:
    """Start a spare of the replica ``argv`` runs (its options with no faults: a spare's life is not a first life):
    its ``ranks`` processes, rank 0 first (a group's rendezvous at ``port`` on the replica's host when ``ranks`` > 1),
    each its own process group, ``nice`` added to their niceness (see :func:`restore_priority`)."""
    import os

    group = ["--ft-group-port", str(port)] if ranks > 1 else []
    return [subprocess.Popen(list(argv) + [STANDBY_FLAG] + group + (["--ft-rank", str(k)] if k else []), env=env,
                             start_new_session=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None)
            for k in range(ranks)]


def restore_priority(proc: subprocess.Popen) -> None:
    """Give every thread of the spare ``proc`` (its process group) the supervisor's own niceness back: a spare started
    during the run sets itself up at a low priority on a shared host, and runs as a replica at the others' once
    activated. Lowering niceness needs root (or CAP_SYS_NICE): the supervisor only starts spares low when it has it."""
    import os

    try:
        os.setpriority(os.PRIO_PGRP, proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
    except ProcessLookupError:  # it exited: the activation that follows finds it gone
        pass


def wait_ready(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the spare ``proc`` to print :data:`READY` (its set-up done); False when it
    exits or does not in time. Reads the pipe's bytes itself (a buffered reader could hold the line unseen)."""
    import os
    import select
    import time

    fd, seen, end = proc.stdout.fileno(), b"", time.monotonic() + timeout_s
    while (READY + "\n").encode() not in seen:
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        chunk = os.read(fd, 4096)
        if not chunk:
            return False
        seen += chunk
    return True


def activate(proc: subprocess.Popen, deadline: Optional[float]) -> bool:
    """Tell the spare ``proc`` to join now, with the run's ``deadline`` (wall time; None: not yet known). False
    when the spare is no longer running (the caller then starts a replica the slow way)."""
    if proc.poll() is not None:
        return False
    try:
        proc.stdin.write(json.dumps({"deadline": deadline}) + "\n")
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        return False
    return True


def wait_for_activation(stdin=None) -> Optional[float]:
    """In a spare: block until the supervisor's line arrives; the run's deadline it carries (None: not yet known).
    Exits the process (status 0) when standard input closes with no line: the spare was not needed."""
    print(READY, flush=True)
    _quiet_stdout()  # the pipe carried the ready line only: nothing reads it after
    line = (stdin or sys.stdin).readline()
    if not line.strip():
        raise SystemExit(0)
    deadline = json.loads(line).get("deadline")
    return None if deadline is None else float(deadline)


def _quiet_stdout() -> None:
    import os

    sys.stdout.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
