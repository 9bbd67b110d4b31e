r"""What every vote method is: :class:`VoteMethod`, and the tie rule the 1-bit methods share.

A vote method agrees on :math:`u = \mathrm{sign}(\sum_i q(c_i))` across P ranks
(docs/design.md §2–§3). One subclass per method, one module each (this package's
``__init__`` registers them by name). An instance is the method configured for one world
size; it owns everything about the method, so no caller switches on its name:

==========================  =====================================================
what it says / does         members
==========================  =====================================================
what travels                :attr:`bits` (wire bits per element), :meth:`part_nbytes`,
                            :meth:`message_nbytes`, :meth:`plan` (the collectives and
                            their bytes, for :mod:`lioncub.engine.cost`)
its arguments               :meth:`check_options` (bits, quantizer, tie rule) and the
                            constructor (world-size limits: lane overflow, int8 sums)
the vote                    :meth:`encode` → :meth:`exchange` → :meth:`decode`, and the
                            fused forms :meth:`encode_fused` / :meth:`apply_fused`
its price                   :attr:`gamma` (local seconds per element, ``a + b·P``) and
                            :attr:`auto_rank` (whether and in which order ``auto`` tries it)
its exact reference         :meth:`reference` (plain integer sums of all ranks' inputs)
==========================  =====================================================

A *message* is the bytes one exchange moves: the concatenated *parts* of several tensors
(:class:`~lioncub.LionCub` packs a step's buckets into as few messages as its
``message_mb`` allows)::

    encode(c_1 → part 1) … encode(c_k → part k)    local, per part
    exchange(message)                               the collective(s), once
    decode(part i → u_i)                            local, per part

:meth:`exchange` returns the *voted bytes*: a uint8 tensor whose last dimension runs over
the message's bytes, so a part at byte ``offset`` is ``voted[..., offset:offset + nb]``
for every method. Votes are per element, so where a part sits in the message does not
change it: one part alone is :func:`lioncub.majority_vote`, element for element.
"""
from __future__ import annotations

from typing import ClassVar, Optional, Union

import torch
from torch import Tensor

from .. import comm, fused
from ..wire import kernels
from ..comm import CommStats
from ..quantize import QUANTIZERS
from ..validate import check_choice, check_stochastic
from .feedback import (ERROR_FEEDBACK, SERVER_FEEDBACK, WORKER_FEEDBACK, add_residuals_, owner_state_what,
                       stochastic_sign_values, update_residuals_)

__all__ = ["VoteMethod", "PackedSigns", "TIE_RULES", "parity_step", "binary_signs", "decide", "check_sign_options"]

TIE_RULES = ("alternate", "plus", "minus", "hold")
"""Where a zero of c (and, for ``onebit``, a tied count) goes on the 1-bit paths. ``'hold'``
(``onebit`` only): a tied count repeats the element's previous vote, kept by its chunk owner;
zeros of c alternate."""


def parity_step(tie: str, step: int) -> int:
    """The step whose parity decides zeros and ties under rule ``tie``: ``step`` itself
    (``'alternate'``), 0 (``'plus'``: +1) or 1 (``'minus'``: −1). Every path that decides
    a zero or a tie (torch, fused loops, overlap, DDP hook) reads only ``step % 2``."""
    return step if tie in ("alternate", "hold") else 0 if tie == "plus" else 1


def binary_signs(c: Tensor, step: int) -> Tensor:
    """c > 0 as bool; exact zeros become +1 on even steps and -1 on odd steps."""
    return c >= 0 if step % 2 == 0 else c > 0


def decide(count_pos: Tensor, world: int, step: int, *, ties: str) -> Tensor:
    """Vote from the number of +1 voters: sign(2k - P); ties → 0 (``'zero'``) or → the
    step parity (``'parity'``: +1 on even steps, −1 on odd)."""
    d = 2 * count_pos.to(torch.int16) - world
    u = torch.sign(d).to(torch.int8)
    if ties == "parity":
        u[d == 0] = 1 if step % 2 == 0 else -1
    return u


def check_tie_rule(tie: str, has_rule: bool, vote: str, quantizer: Optional[str]) -> None:
    """Refuse an unknown rule, and a non-default rule where the vote has no tie choice."""
    if tie not in TIE_RULES:
        raise ValueError(f"tie must be one of {TIE_RULES}, got {tie!r}")
    if tie != "alternate" and not has_rule:
        paths = ", ".join(repr(cls.name) for cls in _methods(VoteMethod) if cls.has_tie_rule(None))
        raise ValueError(f"tie={tie!r} applies to the 1-bit paths only (vote {paths} with quantizer=None), "
                         f"got vote={vote!r}, quantizer={quantizer!r}")


def check_sign_options(vote: str, quantizer: Optional[str], error_feedback: str,
                       stochastic_signs: Union[bool, float]) -> None:
    """Refuse an unknown ``error_feedback`` / a ``stochastic_signs`` neither a bool nor a finite
    float > 0, and either where the message is not binary signs (the 1-bit paths of
    :func:`check_tie_rule`)."""
    check_choice("error_feedback", error_feedback, ERROR_FEEDBACK)
    check_stochastic("stochastic_signs", stochastic_signs)
    cls = next((c for c in _methods(VoteMethod) if c.name == vote), None)
    if (error_feedback != "none" or stochastic_signs) and not (cls and cls.has_tie_rule(quantizer)):
        paths = ", ".join(repr(c.name) for c in _methods(VoteMethod) if c.has_tie_rule(None))
        name = "error_feedback" if error_feedback != "none" else "stochastic_signs"
        raise ValueError(f"{name} applies to the binary-sign votes only (vote {paths} with quantizer=None), "
                         f"got vote={vote!r}, quantizer={quantizer!r}")
    if error_feedback in SERVER_FEEDBACK and not cls.CHUNK_OWNERS:
        owners = ", ".join(repr(c.name) for c in _methods(VoteMethod) if c.CHUNK_OWNERS)
        raise ValueError(f"error_feedback={error_feedback!r} needs chunk owners that count the votes (vote {owners}), "
                         f"got vote={vote!r}; 'worker' runs on every binary-sign vote")


def _methods(cls: type) -> list[type]:
    """Every method class defined below ``cls`` (those with a ``name``), depth first: the
    registered methods, found without importing the registry (which imports this module)."""
    found = []
    for sub in cls.__subclasses__():
        found += ([sub] if "name" in vars(sub) else []) + _methods(sub)
    return found


class VoteMethod:
    """One vote method configured for ``world`` ranks (subclasses: one per method).

    Args:
        world: ranks that vote (P).
        bits: lane width, for methods that have lanes (:attr:`LANE_BITS`); None picks one.
        quantizer: for methods that quantize (:attr:`TAKES_QUANTIZER`); None = binary signs.
        tie: :data:`TIE_RULES`; a non-default rule only where :meth:`has_tie_rule`.

    Raises ``ValueError`` naming the argument when the method cannot run exactly as asked.
    """

    name: ClassVar[str]
    """The registry key, the ``vote=`` / ``method=`` string users pass."""
    LANE_BITS: ClassVar[tuple[int, ...]] = ()
    """Lane widths ``bits=`` may take (empty: the method has no lanes and ignores ``bits``)."""
    TAKES_QUANTIZER: ClassVar[bool] = False
    """Whether ``quantizer=`` may name one of :data:`lioncub.quantize.QUANTIZERS` (else only None)."""
    CHUNK_OWNERS: ClassVar[bool] = False
    """Whether one rank counts each chunk's votes and sends the voted chunk on (so
    ``error_feedback='server'`` / ``'both'`` can keep a residual there)."""
    gamma: ClassVar[tuple[float, float]]
    """Local seconds per element on one rank, ``a + b·P`` (encode, count, decide, apply):
    what :mod:`lioncub.engine.auto` adds to the α-β time. Measured as its docstring says."""
    auto_rank: ClassVar[Optional[int]] = None
    """Position among ``vote='auto'``'s candidates (the earlier wins a tie); None: never picked."""
    one_pass: bool = True
    """Whether :meth:`encode_fused` serves this configuration (no stored ``c``)."""
    repeatable: bool = True
    """Whether encoding the same ``c`` twice gives the same bytes (no random draws), so the
    optimizer may encode before its has-grad / finite agreement and encode again after."""
    shared_momentum: ClassVar[bool] = False
    """Whether the method sends a compressed mean that every rank decodes alike and runs Lion on,
    with a momentum all ranks share (the 1-bit mean, :mod:`.mean`), rather than a vote of signs
    (its step: :func:`lioncub.engine.mean_step.mean_message`)."""

    def __init__(self, world: int, bits: Optional[int] = None, quantizer: Optional[str] = None,
                 tie: str = "alternate", *, error_feedback: str = "none",
                 stochastic_signs: Union[bool, float] = False):
        self.check_options(bits, quantizer, tie)
        check_sign_options(type(self).name, quantizer, error_feedback, stochastic_signs)
        self.world, self.quantizer, self.tie = world, quantizer, tie
        self.error_feedback, self.stochastic_signs = error_feedback, stochastic_signs
        self.levels: Optional[int] = None
        """Quantizer levels s (values in [−s, s]); None: binary signs."""
        self.bits = self.configure(world, bits, quantizer)
        """Wire bits per element."""
        self.feedback = error_feedback in WORKER_FEEDBACK
        """Whether each worker votes on ``c + e`` and keeps a residual ``e`` (:mod:`.feedback`)."""
        self.server_feedback = error_feedback in SERVER_FEEDBACK
        """Whether each chunk owner sends ``sign(a + r)`` and keeps a residual ``r`` (:mod:`.feedback`)."""
        if tie == "hold" and self.server_feedback:
            raise ValueError(f"tie='hold' and error_feedback={error_feedback!r} both decide the chunk owners' "
                             "ties (the held vote, the residual): choose one")
        self.owner_state: Optional[str] = ("residual" if self.server_feedback else "held" if tie == "hold"
                                           else None)
        """What each chunk owner keeps per element between steps: the server residual (fp32),
        its last voted bits (``tie='hold'``, packed), or nothing."""
        self.stochastic = bool(stochastic_signs)
        """Whether the signs are drawn, +1 with probability (1 + v/M)/2 (:mod:`.feedback`)."""
        self.stochastic_scale: Optional[float] = (None if isinstance(stochastic_signs, bool)
                                                  else float(stochastic_signs))
        """M = this·mean|v| per tensor (v/M clipped to [−1, 1]); None: M = max|v|."""
        if self.feedback or self.stochastic:  # the whole tensor before its first bit; no repeats
            self.one_pass = self.repeatable = False

    # ------------------------------------------------------------------ arguments
    @classmethod
    def has_tie_rule(cls, quantizer: Optional[str]) -> bool:
        """Whether a 1-bit encoding decides zeros (and maybe ties) by :data:`TIE_RULES`."""
        return False

    @classmethod
    def partial_vote(cls, quantizer: Optional[str]) -> bool:
        """Whether a vote on this method's one all-reduce can leave ranks out: a rank that abstains sends a message
        that adds nothing (:meth:`abstain_message`), and :meth:`decode_for` decides among the ``count`` that voted
        (what torchft's changing quorums need)."""
        return False

    def decode_for(self, voted: Tensor, offset: int, n: int, out: Tensor, count: int) -> Tensor:
        """:meth:`decode` when only ``count`` of the ranks voted (:meth:`partial_vote`)."""
        raise NotImplementedError(f"vote={self.name!r} cannot leave ranks out of a vote")

    @classmethod
    def round_mean(cls, quantizer: Optional[str]) -> Optional[str]:
        """The round aggregation (:data:`~lioncub.votes.rounds.ROUND_AGGREGATIONS`) a LocalCub round's
        ``aggregate='mean'`` runs on this method's collectives with ``quantizer``, or None (refused)."""
        return None

    @classmethod
    def check_options(cls, bits: Optional[int], quantizer: Optional[str], tie: str) -> None:
        """Refuse options the method does not take, before the world size is known."""
        if quantizer is not None and not cls.TAKES_QUANTIZER:
            raise ValueError(f"method={cls.name!r} takes no quantizer, got quantizer={quantizer!r}")
        if quantizer is not None and quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be None or one of {QUANTIZERS}, got {quantizer!r}")
        if bits is not None and cls.LANE_BITS and bits not in cls.LANE_BITS:
            raise ValueError(f"bits must be None or one of {cls.LANE_BITS} for vote {cls.name!r}, got {bits!r}")
        check_tie_rule(tie, cls.has_tie_rule(quantizer), cls.name, quantizer)
        if tie == "hold" and not cls.CHUNK_OWNERS:
            owners = ", ".join(repr(c.name) for c in _methods(VoteMethod) if c.CHUNK_OWNERS)
            raise ValueError(f"tie='hold' needs chunk owners that keep each element's last vote (vote {owners}), "
                             f"got vote={cls.name!r}")

    def backward_refusal(self, driver: str) -> Optional[str]:
        """Why ``driver`` (overlap, the DDP hook: each bucket encoded during backward, before the
        step's agreement, and exchanged alone) cannot run this configuration; None when it can."""
        if self.feedback or self.stochastic:
            return (f"{driver} encodes during backward, before the step's agreement: it cannot run with "
                    f"error_feedback={self.error_feedback!r} or stochastic_signs={self.stochastic_signs!r}; "
                    "use overlap=False without the DDP hook")
        if self.owner_state:
            return (f"{driver} exchanges each bucket alone: {owner_state_what(self.error_feedback, self.tie)} per "
                    "message of the plain step; use overlap=False without the DDP hook")
        return None

    def configure(self, world: int, bits: Optional[int], quantizer: Optional[str]) -> int:
        """Check the world-size limits, set :attr:`levels`; return the wire bits per element."""
        raise NotImplementedError

    @property
    def option_bits(self) -> Optional[int]:
        """The ``bits=`` value this configuration stands for (None: the method has no lanes)."""
        return self.bits if self.LANE_BITS else None

    # ------------------------------------------------------------------ sizes and price
    def parity(self, step: int) -> int:
        """The step whose parity sets zeros and ties (:func:`parity_step` of ``tie``)."""
        return parity_step(self.tie, step)

    def part_nbytes(self, n: int) -> int:
        """Bytes of one part of ``n`` elements."""
        return -(-n * self.bits // 8)

    def message_nbytes(self, m: int) -> int:
        """Bytes to allocate for a message of ``m`` bytes (padding past ``m`` must be zero)."""
        return m

    def elements(self, m: int) -> int:
        """The element count :func:`lioncub.engine.cost.predicted_bytes` prices like an ``m``-byte message."""
        return m * 8 // self.bits

    @property
    def one_allreduce(self) -> bool:
        """Whether the exchange is one SUM all-reduce of the message, in place (so a caller may keep it
        in flight: LocalCub's streaming rounds)."""
        return [kind for kind, _ in self.plan(1)] == ["allreduce"]

    def plan(self, n: int) -> list[tuple[str, int]]:
        """The collectives one vote of ``n`` elements issues: ``[(kind, bytes per rank)]``,
        kind in ``'allreduce'``, ``'all_gather'``, ``'all_to_all'`` (priced by :mod:`lioncub.engine.cost`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the vote
    def encode(self, c: Tensor, dst: Tensor, step: int, generator=None, work: Optional[Tensor] = None,
               use_fused: bool = False, sizes: Optional[list[int]] = None,
               residuals: Optional[list[Tensor]] = None) -> None:
        """Write this rank's part for the flat ``c`` into ``dst`` (uint8, ``part_nbytes``).
        ``work``: scratch of ``c``'s numel (fp32) for a quantizer's ``|c|``; ``use_fused``:
        ``c`` is contiguous fp32 that :mod:`lioncub.fused` takes; ``sizes``: the element counts
        of the tensors ``c`` is made of (None: one tensor); ``residuals``: with :attr:`feedback`,
        those tensors' error-feedback residuals (``c`` becomes ``v = c + e``, ``e`` is updated)."""
        raise NotImplementedError

    def sign_values(self, v: Tensor, step: int, generator=None, sizes: Optional[list[int]] = None,
                    residuals: Optional[list[Tensor]] = None) -> Tensor:
        """The binary signs of the flat ``v`` as word-padded 0/1 bytes (``[:n]``: +1 → 1):
        drawn per tensor (:attr:`stochastic`) or ``v ≥ 0`` / ``v > 0`` by the tie rule. With
        :attr:`feedback`: ``v ← v + e`` first and ``e ← v − s·σ`` after (:mod:`.feedback`)."""
        if self.feedback:
            add_residuals_(v, residuals)
        values = (stochastic_sign_values(v, step, generator, sizes, scale=self.stochastic_scale)
                  if self.stochastic else kernels.sign_bits(v, self.parity(step)))
        if self.feedback:
            update_residuals_(v, values, residuals)
        return values

    def exchange(self, msg: Tensor, m: int, step: int, group, stats: CommStats,
                 residual: Optional[Tensor] = None) -> Tensor:
        """The collective(s) on the first ``m`` bytes of ``msg`` (``message_nbytes(m)`` long);
        returns the voted bytes (see the module docstring). Collective: all ranks, same ``m``.
        ``residual``: with :attr:`server_feedback` (:attr:`CHUNK_OWNERS` methods only), this
        rank's server residual of the message (fp32, :meth:`owner_elements` long), updated."""
        raise NotImplementedError

    def owner_elements(self, m: int) -> int:
        """The length of this rank's server residual for an ``m``-byte message (its chunk's bits)."""
        raise NotImplementedError(f"vote {self.name!r} has no chunk owners")

    def decode(self, voted: Tensor, offset: int, n: int, out: Tensor) -> Tensor:
        """u of the part at byte ``offset`` (``n`` elements) into the flat ``out``."""
        raise NotImplementedError

    def encode_fused(self, exp_avgs: list[Tensor], grads: list[Tensor], beta1: list[float],
                     maximize: list[bool], dst: Tensor, step: int) -> bool:
        """:meth:`encode` of ``c = β1·m + (1-β1)·g`` in one fused pass (``c`` never stored;
        only when :attr:`one_pass`); returns whether the gradients read are all finite."""
        return fused.encode(exp_avgs, grads, beta1, maximize, dst, bits=self.bits, step=self.parity(step))

    def apply_fused(self, params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], part: Tensor,
                    hyper: dict) -> bool:
        """θ and m updated straight from the voted bytes ``part`` by a fused loop; False when
        the method has none (the caller decodes to int8 u and runs :func:`lioncub.fused.apply`)."""
        return False

    def encode_message(self, c: Tensor, step: int, stats: CommStats, generator=None) -> tuple[Tensor, int]:
        """This rank's message for the flat ``c`` alone: (the padded message, its first ``nb``
        bytes the part), timed as ``t_quantize_pack``. What :meth:`vote` exchanges (and a caller
        that keeps the exchange in flight, LocalCub's streaming rounds)."""
        t0 = comm.clock(stats)
        nb = self.part_nbytes(c.numel())
        msg = torch.empty(self.message_nbytes(nb), dtype=torch.uint8, device=c.device)
        msg[nb:].zero_()
        self.encode(c, msg[:nb], step, generator, use_fused=fused.usable([c]))
        stats.t_quantize_pack += comm.clock(stats) - t0
        return msg, nb

    def vote(self, c: Tensor, out: Tensor, step: int, group, stats: CommStats, generator=None) -> Tensor:
        """One part alone: encode, exchange, decode (``out`` may be ``c``; one tensor: no residual)."""
        n = c.numel()
        msg, nb = self.encode_message(c, step, stats, generator)
        voted = self.exchange(msg, nb, step, group, stats)
        t0 = comm.clock(stats)
        u = self.decode(voted, 0, n, out)
        stats.t_unpack_vote += comm.clock(stats) - t0
        return u

    # ------------------------------------------------------------------ the reference
    def reference(self, cs: list[Tensor], step: int, generators: Optional[list] = None) -> Tensor:
        """What the vote must return (int64 in {−1, 0, 1}, flat), from every rank's flat ``c``
        at once, by plain integer arithmetic; ``step`` is already :meth:`parity`'s."""
        raise NotImplementedError


class PackedSigns(VoteMethod):
    """A method whose message is packed sign bits, one per element (``c ≥ 0`` on even
    parity steps, ``c > 0`` on odd: a zero of c follows the tie rule). ``TIES``: what a
    tied count votes, ``'zero'`` or ``'parity'`` (the tie rule)."""

    TIES: ClassVar[str]

    @classmethod
    def has_tie_rule(cls, quantizer):
        return True

    def configure(self, world, bits, quantizer) -> int:
        return 1

    def encode(self, c, dst, step, generator=None, work=None, use_fused=False, sizes=None, residuals=None):
        dst.copy_(kernels.pack_bytes(self.sign_values(c, step, generator, sizes, residuals), c.numel(), 1))

    def reference(self, cs, step, generators=None):
        count = sum(binary_signs(c, step).long() for c in cs)
        return decide(count, len(cs), step, ties=self.TIES).long()
