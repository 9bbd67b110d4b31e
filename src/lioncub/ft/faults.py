"""Failures at chosen points of a fault-tolerant round, for tests and drills.

A timed kill lands wherever the replica happens to be, so what the survivors log depends on the
host's load. A :class:`Fault` names the point instead, and each point has one outcome (see
docs/fault_tolerance.md, "What each failure does"):

* ``inner``: at the first inner step of the round (the survivors' next quorum simply lacks it);
* ``head``: after the round's quorum formed, before its first collective (the head all-reduce);
* ``lanes``: after the head, as the round's data all-reduce starts;
* ``commit``: after every collective of the round finished, before ``should_commit()``.

The action is ``kill`` (SIGKILL: the process dies at once, as a lost machine does) or ``error``
(the replica reports an error to its own manager: its ``should_commit()`` is False while its
peers commit, the case a real partial failure of a collective produces). Round ``k`` is the
agreement whose commit makes ``FTLocalCub.rounds == k`` (a replica healed during an agreement
is then in the round after the one it began); a fault fires once.

Spec strings (``--ft-fault`` of ``lioncub train``, ``--fault`` of the tests' worker):
``REPLICA:ROUND:POINT[:ACTION]``, e.g. ``2:5:lanes`` or ``1:3:commit:error``.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

__all__ = ["Fault", "POINTS", "ACTIONS", "parse_fault", "install"]

POINTS = ("inner", "head", "lanes", "commit")
ACTIONS = ("kill", "error")
KILL_FLUSH_S = 0.5
"""A kill at ``commit`` waits this long first: its last sends of the round's all-reduce are then
delivered (the peers' collectives complete), not cut by the process's death."""


class InjectedFault(RuntimeError):
    """The error an ``error`` fault reports to the manager."""


@dataclass(frozen=True)
class Fault:
    replica: int
    round: int
    point: str
    action: str = "kill"

    def __post_init__(self):
        if self.point not in POINTS:
            raise ValueError(f"fault point must be one of {', '.join(POINTS)}, got {self.point!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"fault action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if self.replica < 0 or self.round < 1:
            raise ValueError(f"fault needs replica >= 0 and round >= 1, got {self}")


def parse_fault(spec: str) -> Fault:
    """``REPLICA:ROUND:POINT[:ACTION]`` -> :class:`Fault` (one-line ValueError otherwise)."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or not (parts[0].isdigit() and parts[1].isdigit()):
        raise ValueError(f"fault must be REPLICA:ROUND:POINT[:ACTION] (integers, then a point of {', '.join(POINTS)} "
                         f"and an action of {', '.join(ACTIONS)}), got {spec!r}")
    return Fault(int(parts[0]), int(parts[1]), parts[2], parts[3] if len(parts) > 3 else "kill")


def install(opt, faults, replica: int) -> None:
    """Arm ``opt`` (an :class:`~lioncub.ft.FTLocalCub`) with this replica's faults."""
    armed = [f for f in faults if f.replica == replica]

    def hook(point: str, rnd: int) -> None:
        for f in [f for f in armed if (f.point, f.round) == (point, rnd)]:
            armed.remove(f)
            if f.action == "error":
                opt.manager.report_error(InjectedFault(f"injected at {point} of round {rnd}"))
                continue
            if point == "commit":
                time.sleep(KILL_FLUSH_S)
            os.kill(os.getpid(), signal.SIGKILL)

    opt.fault_hook = hook if armed else None
