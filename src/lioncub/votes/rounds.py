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
``'scatter_mean'``   the mean of ``q_i``, re-quantized by each     2(P−1)/P · b bits (b = 1, 2, 4, 8):
                     span's owner (``onebit``; both residuals)     all-to-all, then all-gather
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
  in the outer rule), :attr:`streams` (the exchange's collectives are launched asynchronously, so it may
  stay in flight),
  :attr:`lossless` (nothing for error feedback to keep), :attr:`partial` (a rank may send
  nothing and be left out of the mean: what torchft needs).
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm
from ..comm import CommStats
from ..quantize import quantize
from .base import VoteMethod
from .registry import METHODS
from .scatter import SCATTER_BITS, LevelCodec, codes, owner_span, to_levels, unit_of
from .twophase import Agreement, TwoPhase

__all__ = ["Agreement", "RoundAggregation", "Fp32Mean", "SignVote", "LaneMean", "ROUND_AGGREGATIONS",
           "ScatterMean", "round_aggregation", "round_class", "round_bits", "round_partial", "sent_value",
           "ROUND_AGGREGATES", "PARTIAL_NEEDS"]


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
    takes_bits: ClassVar[bool] = False
    """Whether the aggregation has a code width of its own (``bits``), rather than the vote method's lanes."""

    def __init__(self, world: int, method: Optional[VoteMethod] = None):
        self.world, self.method = world, method

    @property
    def per_tensor(self) -> bool:
        """Whether ``d`` of a tensor depends on that tensor's ``v`` (and its :meth:`head`) alone, so that a
        round may run a few tensors at a time (LocalCub's ``round_chunk``)."""
        return True

    @property
    def streams(self) -> bool:
        """Whether the exchange's collectives are launched asynchronously, so that it may stay in flight
        (``delay=1``): one all-reduce, or stages that :meth:`Agreement.advance` launches as they come."""
        return True

    def needs_scales(self, feedback: bool) -> bool:
        """Whether :meth:`head` or ``C(v)`` (with error ``feedback``) uses each tensor's mean |v|, which the
        caller measures over the whole tensor before a round in chunks (:func:`lioncub.optim.rounds.abs_means`)."""
        return False

    def plan(self, n: int, tensors: int) -> list[tuple[str, int]]:
        """The collectives the exchange of a message of ``n`` elements of ``tensors`` tensors issues (beside the
        round's one agreement): ``[(kind, bytes per rank)]``, priced by :mod:`lioncub.engine.cost`."""
        return self.method.plan(n)

    @classmethod
    def partial_for(cls, method_cls: Optional[type[VoteMethod]], quantizer: Optional[str]) -> bool:
        """:attr:`partial` for a round on ``method_cls``'s messages with ``quantizer``, before any object is made."""
        return cls.partial

    def owner_elements(self, n: int) -> int:
        """Elements of state this rank keeps from round to round for a message of ``n`` elements (an owner's
        residual, passed to :meth:`launch` as ``owner``); 0 for none."""
        return 0

    def head(self, scales: Optional[Tensor]) -> Optional[Tensor]:
        """This rank's per-tensor values (fp64) to be summed over the ranks before :meth:`launch`, from its
        per-tensor mean |v| (``scales``), or None when the aggregation needs none."""
        return None

    def launch(self, v: Tensor, sizes: list[int], *, head: list[float], count: int, step: int, generator,
               group, stats: CommStats, feedback: bool = False, scales: Optional[Tensor] = None,
               owner: Optional[Tensor] = None, abstain: bool = False) -> tuple[Agreement, Optional[Tensor]]:
        """Encode ``v`` (flat fp32; may be overwritten) and start the exchange over ``group``.
        ``sizes``: the pieces of tensors ``v`` holds; ``head``: :meth:`head` summed over the ranks, one per
        piece; ``scales``: this rank's mean |v| of each piece's tensor (None: of the piece itself, when it is
        a whole tensor); ``count``: the ranks whose ``v`` counts; ``step``: the round (the tie rule's parity);
        ``owner``: this rank's state of :meth:`owner_elements` for the message (updated in place, on the
        device or on the host: read and written with non_blocking copies); ``abstain``:
        this rank has nothing to contribute (``v`` is zeros) and is not among the ``count``: a :attr:`partial`
        aggregation sends what adds nothing.
        Returns the agreement and, with ``feedback``, ``C(v)``. Collective: every rank of ``group``."""
        raise NotImplementedError


class Fp32Mean(RoundAggregation):
    """``d = (1/count)·Σ_i v_i`` in fp32: DiLoCo's outer pseudo-gradient (``vote='grad'``)."""

    name = "fp32_mean"
    partial = lossless = True

    def plan(self, n, tensors):
        return [("allreduce", 4 * n)]

    def launch(self, v, sizes, *, head, count, step, generator, group, stats, feedback=False, scales=None,
               owner=None, abstain=False):
        if self.world == 1:
            return Agreement.finished(v if count == 1 else v.div_(count), False), None
        return Agreement(comm.all_reduce_async(v, group, stats), lambda total: total.div_(count), False), None


class SignVote(RoundAggregation):
    """``d = u``, the majority vote of the ranks' ``v`` by a vote method (``'onebit'``, ``'pbit'``, ...)."""

    name = "sign_vote"
    signed = True

    @property
    def partial(self) -> bool:
        """One all-reduce whose abstaining ranks add nothing (``sign_allreduce``; ``pbit``'s binary lanes, the vote
        then decided among the ``count`` that voted)."""
        return self.partial_for(type(self.method), self.method.quantizer)

    @classmethod
    def partial_for(cls, method_cls, quantizer):
        return method_cls is not None and method_cls.partial_vote(quantizer)

    @property
    def streams(self) -> bool:
        return self.method.one_allreduce

    @property
    def per_tensor(self) -> bool:  # a quantizer's scale is taken over the whole flat v (sent_value)
        return self.method.levels is None

    def needs_scales(self, feedback):
        return feedback and self.method.levels is None

    def launch(self, v, sizes, *, head, count, step, generator, group, stats, feedback=False, scales=None,
               owner=None, abstain=False):
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
        if abstain:  # adds nothing to the sum: no plus vote in binary lanes, sign 0 in sign_allreduce's int8
            msg[:nb].zero_()
        pending = comm.all_reduce_async(msg[:nb], group, stats)  # the exchange is the SUM all-reduce, in place
        n, like = v.numel(), dict(dtype=v.dtype, device=v.device)  # (v itself is not kept while in flight)
        if count == self.world:
            return Agreement(pending, lambda _: method.decode(msg, 0, n, torch.empty(n, **like)), True), sent
        return Agreement(pending, lambda _: method.decode_for(msg, 0, n, torch.empty(n, **like), count), True), sent


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

    def launch(self, v, sizes, *, head, count, step, generator, group, stats, feedback=False, scales=None,
               owner=None, abstain=False):
        lanes = self.method
        units, q, msg = lanes.lane_message(v, sizes, [x / count for x in head])
        if msg is None:
            agreement = Agreement.finished(lanes.lane_total(None, q, sizes, units, count=count), False)
        else:  # in flight: the lanes only (lane_total needs q's size, not q)
            n = q.numel()
            agreement = Agreement(comm.all_reduce_async(msg, group, stats),
                                  lambda summed: lanes.lane_total(summed, n, sizes, units, count=count), False)
        return agreement, lanes.lane_sent(q, sizes, units)


class ScatterMean(RoundAggregation):
    r"""``d``: the ranks' mean of ``v_i`` compressed to ``bits`` (1, 2, 4 or 8) per element in each of two
    collectives, with error feedback on both sides (the 1-bit mean's shape, :mod:`lioncub.votes.mean`, for
    a round). Rank j owns the j-th of P equal spans of the message (:func:`~lioncub.votes.scatter.owner_span`)::

        q_i = levels(v_i; unit_t)             unit_t from M_t, the ranks' mean of mean|v_i| of tensor t (head)
        C(v_i) = unit_t·q_i                   the worker's error feedback: e_i ← v_i − C(v_i)
          all_to_all: span j of every q_i (b bits an element) → rank j
        a = unit_t·Σ_i q_i / P                on span j's owner, exact sums of levels
        x = a + r;  w = levels(x; unit'_t)    unit'_t from mean|x| over tensor t's part of the span
        r ← x − unit'_t·w                     the owner's residual of its span (server error feedback)
          all_gather: every owner's w (b bits an element) and its unit'_t (fp32, one per tensor)
        d = unit'_t·w                         the same on every rank

    Levels (:mod:`lioncub.votes.scatter`): ``b = 1`` the sign at ±unit, ``b ≥ 2`` ``2^(b−1) − 1`` levels a side.
    Bytes per rank: ``2(P−1)/P·b/8`` per element, what an all-reduce of ``b``-bit lanes would send, for any P
    (lanes of summed levels need wider lanes as P grows). The exchange is the two-phase mean's
    (:class:`~lioncub.votes.twophase.TwoPhase`, with :class:`~lioncub.votes.scatter.LevelCodec`): two collectives,
    each launched asynchronously (the all-gather as a second stage of the :class:`Agreement`, so a streaming round
    keeps both in flight); every rank must send (not :attr:`partial`)."""

    name = "scatter_mean"
    BITS = SCATTER_BITS
    takes_bits = True

    def __init__(self, world: int, method: Optional[VoteMethod] = None, bits: int = 1):
        super().__init__(world, method)
        self.bits = bits

    def needs_scales(self, feedback):
        return True

    def head(self, scales):
        return scales if scales is not None and scales.numel() else None

    def owner_elements(self, n: int) -> int:
        """The owner's residual for a message of ``n`` elements (its span)."""
        return owner_span(n, self.world, self.bits)

    def plan(self, n, tensors):
        span_bytes = owner_span(n, self.world, self.bits) * self.bits // 8
        return [("all_to_all", self.world * span_bytes), ("all_gather", span_bytes + 4 * tensors)]

    def launch(self, v, sizes, *, head, count, step, generator, group, stats, feedback=False, scales=None,
               owner=None, abstain=False):
        bits, P, n = self.bits, self.world, v.numel()
        if n == 0:  # (every rank's chunk is the same: none of them exchanges)
            return Agreement.finished(torch.zeros_like(v), False), torch.zeros_like(v)
        parity = step % 2
        E = owner_span(n, P, bits)
        if owner is None or owner.numel() != E:
            raise ValueError(f"owner: the scatter mean needs this rank's residual of {E} elements for a message of {n}")
        units = [unit_of(h / count, bits) for h in head]
        q = torch.zeros(n, dtype=torch.float32, device=v.device)
        tensors, offset = [], 0  # (start, numel) of each piece
        for size, unit in zip(sizes, units):
            to_levels(v[offset:offset + size], unit, bits, parity, q[offset:offset + size])
            tensors.append((offset, size))
            offset += size
        msg = codes(q, bits, P * E)
        for unit, qt in zip(units, q.split(sizes)):  # q becomes C(v_i) (the message holds its codes)
            qt.mul_(unit)
        me = dist.get_rank(group) if P > 1 else 0
        two = TwoPhase(LevelCodec(bits, parity, units, count), P, E, tensors)

        def decode(gathered: Tensor) -> Tensor:
            """d from every owner's levels and units: the same on every rank."""
            return two.decode(two.split(gathered), 0, n, torch.empty(n, dtype=torch.float32, device=v.device))

        return two.launch(msg, None, owner, me, group, stats, decode, alone=P == 1), q


ROUND_AGGREGATIONS: dict[str, type[RoundAggregation]] = {cls.name: cls for cls in (Fp32Mean, SignVote, LaneMean,
                                                                                   ScatterMean)}
"""The table: every round aggregation by its name."""


def round_class(vote: str, aggregate: str = "vote", quantizer: Optional[str] = None) -> type[RoundAggregation]:
    """The aggregation a round of ``vote`` (a method's name, or ``'grad'``) and ``aggregate`` runs: the
    one place that decides it, from :data:`ROUND_AGGREGATIONS` (``'mean'``: the method's
    :meth:`~lioncub.votes.base.VoteMethod.round_mean`)."""
    if vote == "grad":
        return Fp32Mean
    if aggregate == "mean":
        method = METHODS.get(vote)
        return ROUND_AGGREGATIONS[(method and method.round_mean(quantizer)) or LaneMean.name]
    return SignVote


def round_aggregation(vote: str, method: Optional[VoteMethod], world: int, aggregate: str = "vote",
                      bits: Optional[int] = None) -> RoundAggregation:
    """The aggregation object a LocalCub round runs (:func:`round_class`) for ``world`` ranks, on ``vote``'s
    method object (None for ``'grad'``); ``bits``: the code width of an aggregation that takes one."""
    cls = round_class(vote, aggregate, None if method is None else method.quantizer)
    return cls(world, method, bits) if cls.takes_bits else cls(world, method)


def round_partial(vote: str, aggregate: str = "vote", quantizer: Optional[str] = None) -> bool:
    """Whether a round of ``vote`` and ``aggregate`` can leave ranks out (:attr:`RoundAggregation.partial`): what
    torchft's changing quorums need."""
    return round_class(vote, aggregate, quantizer).partial_for(METHODS.get(vote), quantizer)


def round_bits(vote: str, aggregate: str, quantizer: Optional[str], bits: Optional[int]) -> Optional[int]:
    """The code width ``bits`` names for the round's own aggregation (1 when None), or None when ``bits``
    is the vote method's lane width (:attr:`RoundAggregation.takes_bits`). Refuses a width it does not take."""
    from ..validate import check_choice

    if vote not in ("grad", "auto") and round_class(vote, aggregate, quantizer).takes_bits:
        return check_choice("bits", 1 if bits is None else bits, ScatterMean.BITS)
    return None


ROUND_AGGREGATES = ("vote", "mean")
"""What LocalCub's ``aggregate=`` takes: ``'vote'`` (the method's majority vote; the fp32 mean for
``vote='grad'``) or ``'mean'`` (:class:`LaneMean`)."""

PARTIAL_NEEDS = ("vote='grad', vote='sign_allreduce', vote='pbit' without a quantizer (binary lanes), or vote='pbit' with "
                 "quantizer='l1' and aggregate='mean'")
"""The round configurations whose sums a rank with nothing to send leaves unchanged (:attr:`RoundAggregation.partial`)."""
