"""The end of a LocalCub round (``delay=0``), as a mixin: this worker's pseudo-gradient, the round's one
finite agreement (:func:`~lioncub.engine.guard.agree`), its aggregation (:mod:`lioncub.votes.rounds`), the
residuals and the outer step. Streaming rounds (:mod:`.streaming`) and torchft's rounds
(:class:`~lioncub.ft.FTLocalCub`) reuse every piece; they differ only in when the agreement is read, and on
which group and count. Uses what LocalCub defines: ``params``, ``state`` (``start`` = θ_s, ``origin`` = o_i,
``residual`` = e_i), ``aggregation``, ``rule``, ``error_feedback``, ``delay``, ``world_size``, ``group``,
``generator``, ``rounds``, ``nonfinite``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import comm
from ..comm import CommStats
from ..engine import guard
from ..votes.rounds import Agreement

__all__ = ["Rounds"]


class Rounds:
    """A round's end: :meth:`_round`, and the pieces every kind of round shares."""

    def _round(self) -> None:
        stats = comm.step_stats(self.device)
        sizes = [p.numel() for p in self.params]
        delta, v = self._pseudo_gradient("origin" if self.delay else "start")
        head = self.aggregation.head(v, sizes)
        # the round's one small all-reduce and host read: how many ranks hold a non-finite value, and the
        # aggregation's own per-tensor sums (the lane mean's shared scale)
        verdict = guard.agree([], self.group, self.world_size, self.device, stats,
                              finite=False if self._bad_round else torch.isfinite(delta).all(), extra=head)
        self._bad_round = False
        self.last_round_stats = stats
        if self.delay:
            self._stream(delta, v, sizes, verdict, stats)
            return
        if verdict.bad_ranks:
            self._nonfinite(verdict.bad_ranks)
            return
        agreement, sent = self._launch(v, sizes, verdict.extra, self.world_size, stats)
        self._keep_residuals(v, sent, sizes)
        d, signed = agreement.result(stats)
        self._outer_step(d.split(sizes), signed)
        self.rounds += 1
        if self.check_due(self.rounds):
            guard.check_replicas(self.params, self.group, self.world_size, step=self.rounds,
                                 names=self._param_names)

    def _pseudo_gradient(self, began: str) -> tuple[Tensor, Tensor]:
        """(Δ_i, v_i = Δ_i + e_i) flat fp32: this worker's progress since ``state[p][began]``."""
        states = [self.state[p] for p in self.params]
        delta = torch.cat([(s[began].float() - p.float()).reshape(-1) for s, p in zip(states, self.params)])
        if not self.error_feedback:
            return delta, delta
        return delta, delta + torch.cat([s["residual"].reshape(-1) for s in states])

    def _launch(self, v: Tensor, sizes: list[int], head: list[float], count: int, stats: CommStats, *,
                aggregation=None, group=None) -> tuple[Agreement, Optional[Tensor]]:
        """Start the round's agreement on ``v`` (:mod:`lioncub.votes.rounds`): the agreement, and
        C(v_i) with error feedback (None without)."""
        aggregation = self.aggregation if aggregation is None else aggregation
        return aggregation.launch(v, sizes, head=head, count=count, step=self.rounds, generator=self.generator,
                                  group=self.group if group is None else group, stats=stats,
                                  feedback=self.error_feedback)

    def _keep_residuals(self, v: Tensor, sent: Optional[Tensor], sizes: list[int]) -> None:
        """e_i ← v_i − C(v_i), per parameter (nothing without error feedback: ``sent`` None)."""
        if sent is None or not self.error_feedback:
            return
        for p, r, c in zip(self.params, v.split(sizes), sent.split(sizes)):
            torch.sub(r, c, out=self.state[p]["residual"].view(-1))

    def _outer_step(self, d: list[Tensor], signed: bool, replicas: bool = True) -> None:
        """θ_s ← decayed θ_s, then the outer rule by d; every replica ← θ_s (``replicas``).
        ``signed``: d holds u."""
        i = 0
        for group in self.param_groups:
            lr, wd = group["lr"], group["outer_weight_decay"]
            for p in group["params"]:
                s = self.state[p]
                start = s["start"]
                if wd != 0:
                    start.mul_(1.0 - self.rule.lr * lr * wd)
                self.rule.step(start, d[i].view_as(p), s, lr=lr, signed=signed)
                i += 1
                if replicas:
                    p.copy_(start)

    def _nonfinite(self, bad_ranks: int) -> None:
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradients or parameters in round {self.rounds} on {bad_ranks} rank(s); "
                "pass nonfinite='skip' to drop such rounds")
        for p in self.params:  # every rank drops the round's local progress
            p.copy_(self.state[p]["start"])
            if self.delay:
                self.state[p]["origin"].copy_(p)
        self.skipped_rounds += 1
