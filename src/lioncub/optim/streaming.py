"""Streaming rounds (``delay=1``) of :class:`~lioncub.optim.localcub.LocalCub`, as a mixin.

The end of a streaming round k: wait for round k−1's agreement and take its outer step on θ_s,
rebase this worker onto it (θ_i ← θ_s − Δ_i^k, o_i ← θ_i), and launch round k's agreement as one
asynchronous all-reduce through :mod:`lioncub.comm` (:mod:`.agreement`). The rule and why it is
this one: docs/local_steps.md. The mixin uses what LocalCub defines: ``params``, ``state``
(``start`` = θ_s, ``origin`` = o_i, ``residual`` = e_i), ``method``, ``aggregate``,
``error_feedback``, ``world_size``, ``group``, ``rounds``, ``generator``, ``_pending``, and the
methods ``_outer_step``, ``_vote``, ``_nonfinite``, ``check_due``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import comm
from ..comm import CommStats
from ..engine import guard
from .agreement import Agreement, launch_lanes, launch_mean, launch_vote, sent_value

__all__ = ["StreamingRounds"]


class StreamingRounds:
    """The ``delay=1`` half of LocalCub's round: :meth:`flush` and the round-end helpers."""

    def _stream(self, delta: Tensor, v: Tensor, sizes: list[int], host: list[float], stats: CommStats) -> None:
        """The end of a streaming round: the previous round's outer step, the rebase, and this
        round's agreement launched (``host``: the head's all-reduced values)."""
        applied = self._apply_pending(sizes, stats)
        if host[0] > 0:
            self._nonfinite(int(host[0]))
            return
        if applied:
            self._rebase(delta.split(sizes))
        else:  # nothing in flight (the first round, after a skip or a flush): θ_i stays
            for p in self.params:
                self.state[p]["origin"].copy_(p)
        self._pending = self._launch(v, sizes, host, stats)

    def _apply_pending(self, sizes: list[int], stats: CommStats) -> bool:
        """Wait for the agreement in flight and take its outer step on θ_s; whether there was one."""
        if self._pending is None:
            return False
        d, signed = self._pending.result(stats)
        self._pending = None
        self._outer_step(d.split(sizes), signed, replicas=False)
        self.rounds += 1
        if self.check_due(self.rounds):
            guard.check_replicas([self.state[p]["start"] for p in self.params], self.group, self.world_size,
                                 step=self.rounds, names=self._param_names)
        return True

    def _rebase(self, delta: list[Tensor]) -> None:
        """θ_i ← θ_s − Δ_i (``delta``: this worker's progress since o_i, negated); o_i ← θ_i."""
        for p, piece in zip(self.params, delta):
            s = self.state[p]
            p.copy_(s["start"].float() - piece.view_as(p))
            s["origin"].copy_(p)

    def _launch(self, v: Tensor, sizes: list[int], host: list[float], stats: CommStats) -> Agreement:
        """Start the agreement on ``v`` (one asynchronous all-reduce), keep e_i ← v_i − C(v_i)."""
        P, group = self.world_size, self.group
        sent = None
        if self.aggregate == "mean":
            agreement, sent = launch_lanes(self.method, v, sizes, [x / P for x in host[1:]], group, stats)
        elif self.method is None:  # 'grad': the fp32 mean of Δ
            agreement = launch_mean(v, P, group, stats)
        else:
            if self.error_feedback:
                sent = sent_value(v, sizes, self.method)
            if P == 1 or v.numel() == 0:
                agreement = Agreement.finished(self._vote(v, stats), True)
            else:
                agreement = launch_vote(self.method, v, self.rounds, self.generator, group, stats)
        if self.error_feedback:  # e_i ← v_i − C(v_i)
            for s, r, c in zip([self.state[p] for p in self.params], v.split(sizes), sent.split(sizes)):
                torch.sub(r, c, out=s["residual"].view(-1))
        return agreement

    @torch.no_grad()
    def flush(self) -> None:
        """``delay=1``: wait for the round in flight and apply its outer step now, carrying each
        worker's progress since onto it (called at a round's end: every replica then holds θ_s,
        as with ``delay=0``). Every rank calls it at the same step; nothing to do otherwise."""
        if self._pending is None:
            return
        sizes = [p.numel() for p in self.params]
        stats = comm.step_stats(self.device)
        delta = [self.state[p]["origin"].float() - p.float() for p in self.params]
        self._apply_pending(sizes, stats)
        self._rebase(delta)
        self.last_round_stats = stats
