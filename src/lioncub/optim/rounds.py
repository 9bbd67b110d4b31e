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

    round_chunk = 1 << 22
    """Elements of pseudo-gradient a ``delay=0`` round holds at once (whole tensors; a larger tensor is a
    chunk of its own): Δ, v, the message and d of one chunk (about 13 bytes an element), not of the whole
    model, where the aggregation decides each tensor alone (:attr:`~lioncub.votes.rounds.RoundAggregation.
    per_tensor`). Each chunk is one more exchange; the round still agrees once."""

    def _round(self) -> None:
        stats = comm.step_stats(self.device)
        sizes = [p.numel() for p in self.params]
        if self.delay:
            delta, v = self._pseudo_gradient("origin")
            verdict = self._agree(self.aggregation.head(v, sizes), delta, stats)
            self._stream(delta, v, sizes, verdict, stats)
            return
        chunks = self._round_chunks(sizes)
        heads, finite, kept = [], True, None  # pass 1: the round's one agreement, a chunk at a time
        for idx in chunks:
            delta, v = self._pseudo_gradient("start", idx)
            finite = guard.all_finite(finite, torch.isfinite(delta).all())
            heads.append(self.aggregation.head(v, [sizes[i] for i in idx]))
            kept = (delta, v) if len(chunks) == 1 else None
        verdict = self._agree(None if heads[0] is None else torch.cat(heads), finite, stats)
        if verdict.bad_ranks:
            self._nonfinite(verdict.bad_ranks)
            return
        first = 0
        for idx in chunks:  # pass 2: each chunk's Δ again, its exchange, residuals and outer step
            delta, v = kept if kept is not None else self._pseudo_gradient("start", idx)
            part = [sizes[i] for i in idx]
            head = verdict.extra[first:first + len(idx)] if heads[0] is not None else []
            first += len(idx)
            agreement, sent = self._launch(v, part, head, self.world_size, stats)
            self._keep_residuals(v, sent, part, idx)
            d, signed = agreement.result(stats)
            self._outer_step(d.split(part), signed, idx=idx)
        self.rounds += 1
        if self.check_due(self.rounds):
            guard.check_replicas(self.params, self.group, self.world_size, step=self.rounds,
                                 names=self._param_names)

    def _agree(self, head: Optional[Tensor], finite, stats: CommStats) -> guard.Verdict:
        """The round's one small all-reduce and host read: how many ranks hold a non-finite value (``finite``:
        this rank's Δ, or Δ itself), and the aggregation's per-tensor sums (the lane mean's shared scale)."""
        if isinstance(finite, Tensor) and finite.dim() > 0:
            finite = torch.isfinite(finite).all()
        sharded = self.sharding is not None and head is not None  # the world agrees; a shard's replicas sum
        verdict = guard.agree([], self.agree_group, self.agree_size, self.device, stats,
                              finite=False if self._bad_round else finite,
                              extra=self.sharding.spread(head) if sharded else head)
        self._bad_round = False
        self.last_round_stats = stats
        if sharded:
            verdict = verdict._replace(extra=self.sharding.slot(verdict.extra, head.numel()))
        return verdict

    def _round_chunks(self, sizes: list[int]) -> list[list[int]]:
        """Parameter indices per chunk of at most :attr:`round_chunk` elements (one chunk of all of them
        when the aggregation does not decide each tensor alone)."""
        if not self.aggregation.per_tensor:
            return [list(range(len(sizes)))]
        return comm.runs(sizes, self.round_chunk) or [[]]

    def _pseudo_gradient(self, began: str, idx: Optional[list[int]] = None) -> tuple[Tensor, Tensor]:
        """(Δ_i, v_i = Δ_i + e_i) flat fp32: this worker's progress since ``state[p][began]``, over the
        parameters ``idx`` (default: all)."""
        params = self.params if idx is None else [self.params[i] for i in idx]
        states = [self.local_state[p] for p in params]
        delta = torch.cat([(s[began].float() - p.float()).reshape(-1) for s, p in zip(states, params)])
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

    def _keep_residuals(self, v: Tensor, sent: Optional[Tensor], sizes: list[int],
                        idx: Optional[list[int]] = None) -> None:
        """e_i ← v_i − C(v_i), per parameter of ``idx`` (default: all; nothing without error feedback:
        ``sent`` None)."""
        if sent is None or not self.error_feedback:
            return
        params = self.params if idx is None else [self.params[i] for i in idx]
        for p, r, c in zip(params, v.split(sizes), sent.split(sizes)):
            torch.sub(r, c, out=self.local_state[p]["residual"].view(-1))

    def _outer_step(self, d: list[Tensor], signed: bool, replicas: bool = True,
                    idx: Optional[list[int]] = None) -> None:
        """θ_s ← decayed θ_s, then the outer rule by d, for the parameters ``idx`` (default: all; d in
        their order); every replica ← θ_s (``replicas``). ``signed``: d holds u."""
        entries = [(g, p) for g in self.param_groups for p in g["params"]]
        for k, i in enumerate(range(len(entries)) if idx is None else idx):
            group, p = entries[i]
            p = self._local(p)  # FSDP2: the local shard
            lr, wd = group["lr"], group["outer_weight_decay"]
            s = self.local_state[p]
            start = s["start"]
            if wd != 0:
                start.mul_(1.0 - self.rule.lr * lr * wd)
            self.rule.step(start, d[k].view_as(p), s, lr=lr, signed=signed)
            if replicas:
                p.copy_(start)

    def _nonfinite(self, bad_ranks: int) -> None:
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradients or parameters in round {self.rounds} on {bad_ranks} rank(s); "
                "pass nonfinite='skip' to drop such rounds")
        for p in self.params:  # every rank drops the round's local progress
            p.copy_(self.local_state[p]["start"])
            if self.delay:
                self.local_state[p]["origin"].copy_(p)
        self.skipped_rounds += 1
