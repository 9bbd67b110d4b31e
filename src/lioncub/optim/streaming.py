"""Streaming rounds (``delay=1``) of :class:`~lioncub.optim.localcub.LocalCub`, as a mixin.

The end of a streaming round k: wait for round k−1's agreement and take its outer step on θ_s,
rebase this worker onto it (θ_i ← θ_s − Δ_i^k, o_i ← θ_i), and launch round k's agreement as one
asynchronous all-reduce (:mod:`lioncub.votes.rounds`). The rule and why it is
this one: docs/local_steps.md. The mixin uses what LocalCub defines: ``params``, ``state``
(``start`` = θ_s, ``origin`` = o_i), ``world_size``, ``group``, ``rounds``, ``_pending``, and the
methods ``_outer_step``, ``_launch`` (the round's aggregation, one for every kind of round), ``_nonfinite``,
``check_due``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import comm
from ..comm import CommStats
from ..engine import guard

__all__ = ["StreamingRounds"]


class StreamingRounds:
    """The ``delay=1`` half of LocalCub's round: :meth:`flush` and the round-end helpers."""

    def _stream(self, delta: Tensor, v: Tensor, sizes: list[int], verdict: guard.Verdict, stats: CommStats) -> None:
        """The end of a streaming round: the previous round's outer step, the rebase, and this
        round's agreement launched (``verdict``: the round's agreement on finiteness and its head)."""
        applied = self._apply_pending(sizes, stats)
        if verdict.bad_ranks:
            self._nonfinite(verdict.bad_ranks)
            return
        if applied:
            self._rebase(delta.split(sizes))
        else:  # nothing in flight (the first round, after a skip or a flush): θ_i stays
            for p in self.params:
                self.local_state[p]["origin"].copy_(p)
        self._pending, sent = self._launch(v, sizes, verdict.extra, self.world_size, stats)
        self._keep_residuals(v, sent, sizes)

    def _apply_pending(self, sizes: list[int], stats: CommStats) -> bool:
        """Wait for the agreement in flight and take its outer step on θ_s; whether there was one."""
        if self._pending is None:
            return False
        d, signed = self._pending.result(stats)
        self._pending = None
        self._outer_step(d.split(sizes), signed, replicas=False)
        self.rounds += 1
        if self.check_due(self.rounds):
            guard.check_replicas([self.local_state[p]["start"] for p in self.params], self.group, self.world_size,
                                 step=self.rounds, names=self._param_names)
        return True

    def _rebase(self, delta: list[Tensor]) -> None:
        """θ_i ← θ_s − Δ_i (``delta``: this worker's progress since o_i, negated); o_i ← θ_i."""
        for p, piece in zip(self.params, delta):
            s = self.local_state[p]
            p.copy_(s["start"].float() - piece.view_as(p))
            s["origin"].copy_(p)

    @torch.no_grad()
    def flush(self) -> None:
        """``delay=1``: wait for the round in flight and apply its outer step now, carrying each
        worker's progress since onto it (called at a round's end: every replica then holds θ_s,
        as with ``delay=0``). Every rank calls it at the same step; nothing to do otherwise."""
        if self._pending is None:
            return
        sizes = [p.numel() for p in self.params]
        stats = comm.step_stats(self.device)
        delta = [self.local_state[p]["origin"].float() - p.float() for p in self.params]
        self._apply_pending(sizes, stats)
        self._rebase(delta)
        self.last_round_stats = stats
