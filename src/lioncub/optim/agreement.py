"""A LocalCub round's agreement as an object: launched, in flight, read (:class:`Agreement`).

With ``delay=0`` a round's agreement completes before the next round starts; with ``delay=1``
(streaming rounds, docs/local_steps.md) it is launched as one asynchronous all-reduce through
:func:`lioncub.comm.all_reduce_async` and read one round later. The launchers here cover the
three aggregations a streaming round can keep in flight: the fp32 mean of Δ (``'grad'``), a vote
whose exchange is one all-reduce (:func:`one_allreduce`), and ``pbit``'s lane mean. :func:`sent_value`
is C(v), what this rank's message represents in the units of v (error feedback's subtrahend).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import comm, votes
from ..comm import CommStats
from ..quantize import quantize

__all__ = ["Agreement", "launch_mean", "launch_vote", "launch_lanes", "one_allreduce", "sent_value"]


def sent_value(v: Tensor, sizes: list[int], method: votes.VoteMethod) -> Tensor:
    """C(v): this rank's contribution to ``method``'s vote in the units of ``v`` (flat, fp32).

    Binary votes send sign(v); its magnitude is taken as ``mean|v|`` of each tensor
    (``sizes``: the tensors' element counts, in order). ``pbit`` with a quantizer sends
    q(v) with the scale of the whole flat ``v``, as :func:`~lioncub.majority_vote` does.
    """
    if method.levels is not None:  # a quantizer's values
        q = quantize(v, method.quantizer, levels=method.levels)
        return q.values.to(v.dtype) * q.scale
    out = torch.sign(v)
    for o, x in zip(out.split(sizes), v.split(sizes)):
        o.mul_(x.abs().mean())
    return out


def one_allreduce(method: Optional[votes.VoteMethod]) -> bool:
    """Whether ``delay=1`` can launch ``method``'s exchange asynchronously: ``'grad'`` (None), or
    a method whose plan is one all-reduce (its exchange is then the SUM all-reduce of its
    message, in place: ``sign_allreduce``, ``pbit``)."""
    return method is None or [kind for kind, _ in method.plan(1)] == ["allreduce"]


class Agreement:
    """A streaming round's agreement: its all-reduce in flight (or none: one rank, an empty
    vote) and ``read``, which turns the reduced buffer into the round's ``d``. :meth:`result`
    waits (once) and returns ``(d, signed)``; after it the agreement holds only ``d``."""

    def __init__(self, pending: Optional[comm.Pending], read: Callable[[Optional[Tensor]], Tensor], signed: bool):
        self.pending, self.read, self.signed, self.d = pending, read, signed, None

    @classmethod
    def finished(cls, d: Tensor, signed: bool) -> "Agreement":
        """An agreement whose ``d`` is already known (one rank, or restored from a checkpoint)."""
        done = cls(None, lambda _: d, signed)
        done.d = d
        return done

    def result(self, stats: Optional[CommStats] = None) -> tuple[Tensor, bool]:
        if self.d is None:
            self.d = self.read(None if self.pending is None else self.pending.wait(stats))
            self.pending = self.read = None
        return self.d, self.signed


def launch_mean(v: Tensor, world: int, group, stats: CommStats) -> Agreement:
    """The fp32 mean of the ranks' ``v`` (in place), its SUM all-reduce in flight."""
    if world == 1:
        return Agreement.finished(v, False)
    return Agreement(comm.all_reduce_async(v, group, stats), lambda total: total.div_(world), False)


def launch_vote(method: votes.VoteMethod, v: Tensor, step: int, generator, group, stats: CommStats) -> Agreement:
    """:meth:`VoteMethod.vote` with its one all-reduce in flight: encode now, decode at the wait."""
    msg, nb = method.encode_message(v, step, stats, generator)
    pending = comm.all_reduce_async(msg[:nb], group, stats)
    return Agreement(pending, lambda _: method.decode(msg, 0, v.numel(), torch.empty_like(v)), True)


def launch_lanes(lanes: votes.VoteMethod, v: Tensor, sizes: list[int], norms: list[float], group,
                 stats: CommStats) -> tuple[Agreement, Tensor]:
    """:meth:`PBit.lane_mean` with its lane-sum all-reduce in flight; returns the agreement
    (d = unit·Σ_i q_i / P) and this rank's C(v) = unit·q_i."""
    units, q, msg = lanes.lane_message(v, sizes, norms)
    if msg is None:
        agreement = Agreement.finished(lanes.lane_total(None, q, sizes, units), False)
    else:
        agreement = Agreement(comm.all_reduce_async(msg, group, stats),
                              lambda summed: lanes.lane_total(summed, q, sizes, units), False)
    return agreement, lanes.lane_sent(q, sizes, units)
