r"""How the workers' pseudo-gradients become one round's outer step: the round aggregations.

A round of local steps (:class:`~lioncub.LocalCub`, its streaming rounds, :class:`~lioncub.ft.FTLocalCub`)
ends with every worker holding ``v_i = Δ_i + e_i`` (flat fp32) and every worker needing the same ``d``.
Each way of agreeing on ``d`` is one :class:`RoundAggregation` subclass, listed once in
:data:`ROUND_AGGREGATIONS`; the optimizers hold one object and never ask which it is:

===================  ===========================================  ==================================
name                 d                                            wire per element per rank
===================  ===========================================  ==================================
``'fp32_mean'``      ``(1/C)·Σ_i v_i`` (DiLoCo's pseudo-gradient)  2(P−1)/P · 32 bits, one all-reduce
``'sign_vote'``      ``u = sign(Σ_i q(v_i))``, any vote method     the vote method's (1–8 bits)
``'lane_mean'``      ``(1/C)·Σ_i unit·q_i`` (``pbit`` + ``l1``)    2(P−1)/P · w bits, one all-reduce
===================  ===========================================  ==================================

``C`` is the number of ranks whose ``v`` counts (P, or torchft's contributors: :attr:`partial`).

The contract, in the order a round uses it:

* :meth:`head` — per-tensor values every rank must know summed *before* its message is made
  (the lane mean's shared scale: ``mean|v_i|`` of each tensor, measured by the caller over whole
  tensors, :meth:`needs_scales`); they ride on the round's one small agreement
  (:func:`lioncub.engine.guard.agree`), so they cost no collective of their own.
* :meth:`launch` — encode this rank's message and start the exchange; returns an
  :class:`Agreement` (read now, or one round later for streaming rounds) and, when asked,
  ``C(v)``: this rank's message in the units of ``v``, what error feedback subtracts
  (``e ← v − C(v)``).
* the flags a caller plans with: :attr:`signed` (``d`` is a vote, scaled by the learning rate
  in the outer rule), :attr:`streams` (the exchange is one all-reduce, so it may stay in flight),
  :attr:`lossless` (nothing for error feedback to keep), :attr:`partial` (a rank may send
  nothing and be left out of the mean: what torchft needs).
"""
from __future__ import annotations

from typing import Callable, ClassVar, Optional

import torch
from torch import Tensor

from .. import comm
from ..comm import CommStats
from ..quantize import QUANTIZERS, STOCHASTIC, quantize
from .base import VoteMethod

__all__ = ["Agreement", "RoundAggregation", "Fp32Mean", "SignVote", "LaneMean", "ROUND_AGGREGATIONS",
           "round_aggregation", "round_class", "sent_value",
           "ROUND_AGGREGATES", "check_round_aggregate", "PARTIAL_NEEDS"]


class Agreement:
    """A round's agreement: its all-reduce in flight (or none: one rank, an empty vote, an exchange
    already complete) and ``read``, which turns the reduced buffer into the round's ``d``.
    :meth:`result` waits (once) and returns ``(d, signed)``; after it only ``d`` is kept."""

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


def sent_value(v: Tensor, sizes: list[int], method: VoteMethod, scales: Optional[Tensor] = None) -> Tensor:
    """C(v): this rank's contribution to ``method``'s vote in the units of ``v`` (flat, fp32).

    Binary votes send sign(v); its magnitude is taken as ``mean|v|`` of each tensor
    (``sizes``: the tensors' element counts, in order; ``scales``: their mean |v| when ``v`` holds
    only a slice of a tensor, as a round in chunks passes them). ``pbit`` with a quantizer sends
    q(v) with the scale of the whole flat ``v``, as :func:`~lioncub.majority_vote` does.
    """
    if method.levels is not None:  # a quantizer's values
        q = quantize(v, method.quantizer, levels=method.levels)
        return q.values.to(v.dtype) * q.scale
    out = torch.sign(v)
    for k, (o, x) in enumerate(zip(out.split(sizes), v.split(sizes))):
        o.mul_(x.abs().mean() if scales is None else scales[k].to(o.dtype))
    return out


class RoundAggregation:
    """One way a round's ``v_i`` become ``d`` (module docstring), configured for ``world`` ranks."""

    name: ClassVar[str]
    signed: ClassVar[bool] = False
    """Whether ``d`` is a vote ``u`` in {−1, 0, +1} (the outer rule scales it by η) rather than a
    value in the units of Δ."""
    partial: ClassVar[bool] = False
    """Whether a rank that sends zeros adds nothing and may be left out of the mean (``count``):
    the aggregations torchft's changing quorums can run."""
    lossless: ClassVar[bool] = False
    """Whether ``d`` is the exact mean (then error feedback has nothing to keep)."""

    def __init__(self, world: int, method: Optional[VoteMethod] = None):
        self.world, self.method = world, method

    @property
    def per_tensor(self) -> bool:
        """Whether ``d`` of a tensor depends on that tensor's ``v`` (and its :meth:`head`) alone, so that a
        round may run a few tensors at a time (LocalCub's ``round_chunk``)."""
        return True

    @property
    def streams(self) -> bool:
        """Whether the exchange is one all-reduce that may stay in flight (``delay=1``)."""
        return True

    def needs_scales(self, feedback: bool) -> bool:
        """Whether :meth:`head` or ``C(v)`` (with error ``feedback``) uses each tensor's mean |v|, which the
        caller measures over the whole tensor before a round in chunks (:func:`lioncub.optim.rounds.abs_means`)."""
        return False

    def head(self, scales: Optional[Tensor]) -> Optional[Tensor]:
        """This rank's per-tensor values (fp64) to be summed over the ranks before :meth:`launch`, from its
        per-tensor mean |v| (``scales``), or None when the aggregation needs none."""
        return None

    def launch(self, v: Tensor, sizes: list[int], *, head: list[float], count: int, step: int, generator,
               group, stats: CommStats, feedback: bool = False, scales: Optional[Tensor] = None
               ) -> tuple[Agreement, Optional[Tensor]]:
        """Encode ``v`` (flat fp32; may be overwritten) and start the exchange over ``group``.
        ``sizes``: the pieces of tensors ``v`` holds; ``head``: :meth:`head` summed over the ranks, one per
        piece; ``scales``: this rank's mean |v| of each piece's tensor (None: of the piece itself, when it is
        a whole tensor); ``count``: the ranks whose ``v`` counts; ``step``: the round (the tie rule's parity).
        Returns the agreement and, with ``feedback``, ``C(v)``. Collective: every rank of ``group``."""
        raise NotImplementedError


class Fp32Mean(RoundAggregation):
    """``d = (1/count)·Σ_i v_i`` in fp32: DiLoCo's outer pseudo-gradient (``vote='grad'``)."""

    name = "fp32_mean"
    partial = lossless = True

    def launch(self, v, sizes, *, head, count, step, generator, group, stats, feedback=False, scales=None):
        if self.world == 1:
            return Agreement.finished(v if count == 1 else v.div_(count), False), None
        return Agreement(comm.all_reduce_async(v, group, stats), lambda total: total.div_(count), False), None


class SignVote(RoundAggregation):
    """``d = u``, the majority vote of the ranks' ``v`` by a vote method (``'onebit'``, ``'pbit'``, ...)."""

    name = "sign_vote"
    signed = True

    @property
    def streams(self) -> bool:
        return self.method.one_allreduce

    @property
    def per_tensor(self) -> bool:  # a quantizer's scale is taken over the whole flat v (sent_value)
        return self.method.levels is None

    def needs_scales(self, feedback):
        return feedback and self.method.levels is None

    def launch(self, v, sizes, *, head, count, step, generator, group, stats, feedback=False, scales=None):
        method = self.method
        sent = sent_value(v, sizes, method, scales) if feedback else None
        if v.numel() == 0:
            return Agreement.finished(torch.zeros_like(v), True), sent
        if self.world == 1:  # no process group needed: the one rank's vote is its reference
            u = method.reference([v], method.parity(step), [generator]).to(v.dtype)
            return Agreement.finished(u, True), sent
        if not self.streams:  # several collectives: the vote completes here
            return Agreement.finished(method.vote(v, torch.empty_like(v), step, group, stats, generator), True), sent
        msg, nb = method.encode_message(v, step, stats, generator)
        pending = comm.all_reduce_async(msg[:nb], group, stats)  # the exchange is the SUM all-reduce, in place
        n, like = v.numel(), dict(dtype=v.dtype, device=v.device)  # (v itself is not kept while in flight)
        return Agreement(pending, lambda _: method.decode(msg, 0, n, torch.empty(n, **like)), True), sent


class LaneMean(RoundAggregation):
    """``d = (1/count)·Σ_i unit·q_i``: every rank quantizes ``v_i`` with one shared L1 scale per tensor
    (from :meth:`head`), ``pbit``'s lanes add the ``q_i`` exactly (:meth:`PBit.lane_message
    <lioncub.votes.pbit.PBit.lane_message>`). A 2–8-bit DiLoCo pseudo-gradient."""

    name = "lane_mean"
    partial = True

    def needs_scales(self, feedback):
        return True

    def head(self, scales):
        return scales if scales is not None and scales.numel() else None

    def launch(self, v, sizes, *, head, count, step, generator, group, stats, feedback=False, scales=None):
        lanes = self.method
        units, q, msg = lanes.lane_message(v, sizes, [x / count for x in head])
        if msg is None:
            agreement = Agreement.finished(lanes.lane_total(None, q, sizes, units, count=count), False)
        else:  # in flight: the lanes only (lane_total needs q's size, not q)
            n = q.numel()
            agreement = Agreement(comm.all_reduce_async(msg, group, stats),
                                  lambda summed: lanes.lane_total(summed, n, sizes, units, count=count), False)
        return agreement, lanes.lane_sent(q, sizes, units)


ROUND_AGGREGATIONS: dict[str, type[RoundAggregation]] = {cls.name: cls for cls in (Fp32Mean, SignVote, LaneMean)}
"""The table: every round aggregation by its name."""


ROUND_MEAN_NEEDS = "it needs vote='pbit' and quantizer='l1'"


def round_class(vote: str, aggregate: str = "vote") -> type[RoundAggregation]:
    """The aggregation a round of ``vote`` (a method's name, or ``'grad'``) and ``aggregate`` runs: the
    one place that decides it, from :data:`ROUND_AGGREGATIONS`."""
    return ROUND_AGGREGATIONS["fp32_mean" if vote == "grad" else "lane_mean" if aggregate == "mean" else "sign_vote"]


def round_aggregation(vote: str, method: Optional[VoteMethod], world: int, aggregate: str = "vote") -> RoundAggregation:
    """The aggregation object a LocalCub round runs (:func:`round_class`) for ``world`` ranks, on ``vote``'s
    method object (None for ``'grad'``)."""
    return round_class(vote, aggregate)(world, method)


def check_round_aggregate(aggregate: str, method_cls: Optional[type[VoteMethod]], vote: str,
                          quantizer: Optional[str], *, error_feedback: bool = False) -> None:
    """Refuse a round ``aggregate`` the vote cannot run (``'mean'`` needs lanes that sum exactly:
    :meth:`VoteMethod.takes_round_mean <lioncub.votes.base.VoteMethod.takes_round_mean>`), and error
    feedback where it has nothing to keep (a :attr:`~RoundAggregation.lossless` aggregation) or cannot
    replay the message (a quantizer that draws: ``C(v)`` is computed apart from the message)."""
    from ..validate import check_choice

    check_choice("aggregate", aggregate, ROUND_AGGREGATES)
    if aggregate == "mean" and not (method_cls is not None and method_cls.takes_round_mean(quantizer)):
        raise ValueError(f"aggregate='mean' sums L1-quantized lanes: {ROUND_MEAN_NEEDS}, "
                         f"got vote={vote!r}, quantizer={quantizer!r}")
    if error_feedback and round_class(vote, aggregate).lossless:
        raise ValueError(f"error_feedback needs a compressed vote: vote={vote!r} sends Δ exactly")
    if error_feedback and quantizer in STOCHASTIC:
        raise ValueError(f"error_feedback cannot replay the stochastic quantizer {quantizer!r}; use quantizer="
                         + ", ".join(repr(q) for q in QUANTIZERS if q not in STOCHASTIC))


ROUND_AGGREGATES = ("vote", "mean")
"""What LocalCub's ``aggregate=`` takes: ``'vote'`` (the method's majority vote; the fp32 mean for
``vote='grad'``) or ``'mean'`` (:class:`LaneMean`)."""

PARTIAL_NEEDS = "vote='grad', or vote='pbit' with quantizer='l1' and aggregate='mean'"
"""The round configurations whose sums a rank with nothing to send leaves unchanged (:attr:`RoundAggregation.partial`)."""
