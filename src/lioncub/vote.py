r"""The majority vote: every rank passes its update vector :math:`c_i`, every rank gets
the same :math:`u = \mathrm{sign}(\sum_i q(c_i)) \in \{-1, 0, +1\}` (docs/design.md §2–§3).

Each method is a composition of separate stages (docs/design.md §12)::

    encode (quantize → lane values / sign bits) → pack → collective → unpack → decide

========================  =====================================  ===========================
method                    what travels                           zeros and ties
========================  =====================================  ===========================
``sign_allreduce``        int8 signs, SUM all-reduce             exact: ties → 0 (P ≤ 127)
``gather``                packed sign bits, all-gather           zeros of c → ±1 by step
                                                                 parity; ties → 0
``onebit``                packed sign bits: all-to-all, each     zeros and ties → ±1 by step
                          rank votes its chunk, all-gather       parity (+1 even, −1 odd)
``pbit`` (binary)         {0,1} in w-bit lanes, SUM all-reduce   zeros → parity; ties → 0
``pbit`` + quantizer      q ∈ [−s, s] offset to [0, 2s] in       exact integer sums; ties → 0
                          w-bit lanes, SUM all-reduce
========================  =====================================  ===========================

The alternating parity rule is the paper's: a fixed tie rule biases every tied
coordinate one way and diverges (its Fig. 10). ``tie=`` (:data:`TIE_RULES`) chooses the
rule on the paths that have one (``gather``, ``onebit``, binary ``pbit``): ``'alternate'``
(the default, the parity above), ``'plus'`` (always +1) or ``'minus'`` (always −1); on
``onebit`` it decides zeros and ties, on ``gather`` and binary ``pbit`` the zeros of c
(their ties stay 0). The other methods have no such choice and refuse a non-default rule. :func:`reference_vote` computes
what every method must return from all ranks' inputs in full precision; the
multi-process tests compare the two element for element.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from . import comm, fused, kernels, packing
from .comm import CommStats
from .quantize import QUANTIZERS, ROUNDED, multiplier, quantize, scale_norm

__all__ = ["VOTE_METHODS", "TIE_RULES", "VoteCodec", "majority_vote", "reference_vote", "pbit_levels"]

VOTE_METHODS = ("sign_allreduce", "gather", "onebit", "pbit")
TIE_RULES = ("alternate", "plus", "minus")
"""Where a zero of c (and, for ``onebit``, a tied count) goes on the 1-bit paths."""


def check_tie(tie: str, method: str, quantizer: str | None = None) -> None:
    """Refuse an unknown rule, and a non-default rule where the method has no tie choice."""
    if tie not in TIE_RULES:
        raise ValueError(f"tie must be one of {TIE_RULES}, got {tie!r}")
    if tie != "alternate" and (method not in ("gather", "onebit", "pbit") or quantizer is not None):
        raise ValueError(f"tie={tie!r} applies to the 1-bit paths only (vote 'gather', 'onebit', 'pbit' "
                         f"with quantizer=None), got vote={method!r}, quantizer={quantizer!r}")


def parity_step(tie: str, step: int) -> int:
    """The step whose parity decides zeros and ties under rule ``tie``: ``step`` itself
    (``'alternate'``), 0 (``'plus'``: +1) or 1 (``'minus'``: −1). Every path that decides
    a zero or a tie (torch, fused C loops, overlap, DDP hook) reads only ``step % 2``."""
    return step if tie == "alternate" else 0 if tie == "plus" else 1


# ----------------------------------------------------------------------------- encode / decide
def _parity_positive(step: int) -> bool:
    """The sign a zero or a tie becomes on a 1-bit wire: +1 on even steps, -1 on odd."""
    return step % 2 == 0


def binary_signs(c: Tensor, step: int) -> Tensor:
    """c > 0 as bool; exact zeros become +1 on even steps and -1 on odd steps."""
    if _parity_positive(step):
        return c >= 0
    return c > 0


def decide(count_pos: Tensor, world: int, step: int, *, ties: str) -> Tensor:
    """Vote from the number of +1 voters: sign(2k - P); ties → 0 or → the step parity."""
    d = 2 * count_pos.to(torch.int16) - world
    u = torch.sign(d).to(torch.int8)
    if ties == "parity":
        u[d == 0] = 1 if _parity_positive(step) else -1
    return u


def pbit_levels(world: int, bits: int | None, quantizer: str | None) -> tuple[int, int | None]:
    """Lane width ``w`` and quantizer levels ``s`` (None = binary signs) for ``pbit``.

    Binary signs and ``'sign'`` pick the smallest lane that cannot overflow when
    ``bits`` is None. Other quantizers default to 8-bit lanes and take the most
    levels the lane allows: ``s = floor((2**w - 1) / (2P))``.
    """
    if quantizer is not None and quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer must be None or one of {QUANTIZERS}, got {quantizer!r}")
    if bits is not None and bits not in packing.LANE_BITS:
        raise ValueError(f"bits must be None or one of {packing.LANE_BITS} for vote 'pbit', got {bits!r}")
    if quantizer in (None, "sign"):
        levels = None if quantizer is None else 1
        w = packing.lane_bits_for(world, levels) if bits is None else bits
        if packing.max_lane_value(world, levels) > (1 << w) - 1:
            raise ValueError(
                f"bits={w} lanes overflow with {world} workers for quantizer={quantizer!r} "
                f"(need bits >= {packing.lane_bits_for(world, levels)})"
            )
        return w, levels
    w = 8 if bits is None else bits
    s = ((1 << w) - 1) // (2 * world)
    if s < 1:
        raise ValueError(
            f"bits={w} lanes leave no quantization level for {world} workers "
            f"(need 2*s*P <= {(1 << w) - 1}); use more bits or quantizer=None"
        )
    return w, min(s, 127)


def _encode_pbit(c: Tensor, world: int, step: int, levels: int | None, quantizer, generator) -> Tensor:
    """Per-rank lane values in [0, 2s] (or {0, 1} for binary signs)."""
    if levels is None:
        return kernels.sign_bits(c, step)  # word-padded 0/1 bytes, [:n] are the values
    q = quantize(c, quantizer, levels=levels, generator=generator).values
    return q.view(torch.uint8) + levels  # q + s in [0, 2s]: exact modulo 256


# ----------------------------------------------------------------------------- messages
class VoteCodec:
    """One vote method for one world size, split into the three stages a message needs.

    A *message* is the bytes one exchange moves: the concatenated *parts* of several
    tensors (:class:`~lioncub.LionCub` packs all the buckets of a step into as few
    messages as its ``message_mb`` allows, so the ranks meet once per message rather
    than once per bucket)::

        encode(c_1 → part 1) … encode(c_k → part k)    local, per part
        exchange(message)                               the collective(s), once
        decode(part i → u_i)                            local, per part

    A part takes :meth:`part_nbytes` bytes: ``n`` int8 signs, ``⌈n/8⌉`` bytes of sign
    bits, or ``⌈n·w/8⌉`` bytes of ``w``-bit lanes. Votes are per element, so where a
    part sits in the message does not change it: one part alone is
    :func:`majority_vote`, element for element.
    """

    def __init__(self, method: str, world: int, bits: int | None = None, quantizer: str | None = None,
                 tie: str = "alternate"):
        if method not in VOTE_METHODS:
            raise ValueError(f"method must be one of {VOTE_METHODS}, got {method!r}")
        if quantizer is not None and method != "pbit":
            raise ValueError(f"quantizer is only used by method='pbit', got method={method!r}")
        check_tie(tie, method, quantizer)
        self.tie = tie
        if method == "sign_allreduce" and world > 127:
            raise ValueError(f"method='sign_allreduce' sums int8 signs and needs world size <= 127, got {world}")
        self.method, self.world, self.quantizer = method, world, quantizer
        self.levels = None
        if method == "pbit":
            self.bits, self.levels = pbit_levels(world, bits, quantizer)
        else:
            self.bits = 8 if method == "sign_allreduce" else 1  # wire bits per element

    def parity(self, step: int) -> int:
        """The step whose parity sets zeros and ties (:func:`parity_step` of ``tie``)."""
        return parity_step(self.tie, step)

    def part_nbytes(self, n: int) -> int:
        return -(-n * self.bits // 8)

    def message_nbytes(self, m: int) -> int:
        """Bytes to allocate for a message of ``m`` bytes (onebit: P equal chunks; the
        padding must be zero)."""
        return -(-m // self.world) * self.world if self.method == "onebit" else m

    def elements(self, m: int) -> int:
        """The element count :func:`lioncub.cost.predicted_bytes` prices like an ``m``-byte message."""
        return m * 8 // self.bits

    def encode(self, c: Tensor, dst: Tensor, step: int, generator=None, work: Tensor | None = None) -> None:
        """Write this rank's part for the flat ``c`` into ``dst`` (uint8, ``part_nbytes``).
        ``work``: kept scratch of ``c``'s numel (fp32) for a quantizer's ``|c|``."""
        n, step = c.numel(), self.parity(step)
        if self.method == "sign_allreduce":
            dst.view(torch.int8).copy_(torch.sign(c))
        elif self.method in ("gather", "onebit"):
            dst.copy_(kernels.pack_bytes(kernels.sign_bits(c, step), n, 1))
        elif self.quantizer in ROUNDED and fused.usable([c]):  # round, clamp and lanes in one pass
            mult = multiplier(self.levels, scale_norm(c, self.quantizer, work=work))  # as quantize() does
            fused.quantize_lanes(c, mult, self.levels, self.bits, dst)
        else:
            values = _encode_pbit(c, self.world, step, self.levels, self.quantizer, generator)
            dst.copy_(values[:n] if self.bits == 8 else kernels.pack_bytes(values, n, self.bits))

    def exchange(self, msg: Tensor, m: int, step: int, group, stats: CommStats):
        """The collective(s) on the first ``m`` bytes of ``msg`` (``message_nbytes(m)``
        long); returns what :meth:`decode` reads. Collective: all ranks, same ``m``."""
        if self.method in ("sign_allreduce", "pbit"):
            comm.all_reduce(msg[:m], group, stats)  # int8 sums / lane sums, no carries
            return msg
        if self.method == "gather":
            everyone = comm.all_gather(msg[:m], group, stats)  # (P, m)
            t0 = time.perf_counter()
            gt, eq = kernels.vote_bits(everyone, self.world)  # packed masks 2k > P, 2k = P
            lt = gt | eq
            lt.bitwise_not_()  # 2k < P
            stats.t_unpack_vote += time.perf_counter() - t0
            return gt.view(torch.uint8), lt.view(torch.uint8)
        # onebit: rank j votes chunk j of everyone's bits, then everyone gathers the chunks
        mine = comm.all_to_all(msg[:self.message_nbytes(m)], group, stats)
        t0 = time.perf_counter()
        voted = kernels.majority_bits(mine.view(self.world, -1), self.world, self.parity(step))  # packed words
        stats.t_unpack_vote += time.perf_counter() - t0
        return comm.all_gather(voted, group, stats).reshape(-1)

    def decode(self, voted, offset: int, n: int, out: Tensor) -> Tensor:
        """u of the part at byte ``offset`` (``n`` elements) into the flat ``out``."""
        nb = self.part_nbytes(n)
        if self.method == "sign_allreduce":
            return out.copy_(voted[offset:offset + nb].view(torch.int8).sign())
        if self.method == "gather":
            gt, lt = voted
            return kernels.spread_votes(gt[offset:offset + nb], lt[offset:offset + nb], n, out.dtype, out=out)
        if self.method == "onebit":
            return kernels.unpack_pm1(voted[offset:offset + nb], n, out.dtype, out=out)  # straight into out
        return kernels.vote_lanes(voted[offset:offset + nb], n, self.bits, *self.thresholds(), out.dtype, out=out)

    def thresholds(self) -> tuple[int, int]:
        """``pbit``: u = (k > above) − (k < below) of the lane sums k (no lane exceeds
        2**w − 1): binary signs u = (2k > P) − (2k < P); quantized u = sign(k − P·s), P·s ≤ 127."""
        w = self.world
        return (w // 2, (w + 1) // 2) if self.levels is None else (w * self.levels,) * 2

    def vote(self, c: Tensor, out: Tensor, step: int, group, stats: CommStats, generator=None) -> Tensor:
        """One part alone: encode, exchange, decode (``out`` may be ``c``)."""
        n = c.numel()
        t0 = time.perf_counter()
        nb = self.part_nbytes(n)
        msg = torch.empty(self.message_nbytes(nb), dtype=torch.uint8, device=c.device)
        msg[nb:].zero_()
        self.encode(c, msg[:nb], step, generator)
        stats.t_quantize_pack += time.perf_counter() - t0
        voted = self.exchange(msg, nb, step, group, stats)
        t0 = time.perf_counter()
        u = self.decode(voted, 0, n, out)
        stats.t_unpack_vote += time.perf_counter() - t0
        return u


def majority_vote(
    c: Tensor,
    *,
    method: str,
    bits: int | None = None,
    quantizer: str | None = None,
    step: int = 0,
    tie: str = "alternate",
    group=None,
    stats: CommStats | None = None,
    generator: torch.Generator | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Agree on ``u = sign(Σ_i q(c_i))`` across the ranks of ``group``.

    Every rank passes ``c`` of the same shape and gets the same ``u`` (same shape
    and dtype as ``c``, values in {-1, 0, +1}). ``step`` sets the tie/zero parity of
    the 1-bit paths, ``tie`` their rule (:data:`TIE_RULES`; ``'alternate'``: +1 on even
    steps, −1 on odd; ``'plus'``/``'minus'``: always +1/−1); ``bits``/``quantizer`` configure ``pbit`` (see
    :func:`pbit_levels`); ``generator`` seeds stochastic quantizers (``linf``);
    ``stats`` accumulates bytes and time; ``out`` (a contiguous tensor of ``c``'s
    shape and dtype, ``c`` itself allowed) receives ``u`` instead of a new tensor.
    Collective: all ranks must call it.

    Example (under ``torchrun --nproc-per-node 4``)::

        u = lioncub.majority_vote(torch.randn(1000), method="onebit", step=0)
    """
    if method not in VOTE_METHODS:
        raise ValueError(f"method must be one of {VOTE_METHODS}, got {method!r}")
    if not torch.is_floating_point(c):
        raise TypeError(f"c must be a floating-point tensor, got {c.dtype}")
    if quantizer is not None and method != "pbit":
        raise ValueError(f"quantizer is only used by method='pbit', got method={method!r}")
    check_tie(tie, method, quantizer)
    if out is not None and (out.shape != c.shape or out.dtype != c.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous tensor of c's shape {tuple(c.shape)} and dtype {c.dtype}, "
                         f"got shape {tuple(out.shape)}, dtype {out.dtype}, contiguous={out.is_contiguous()}")
    world = dist.get_world_size(group)
    if method == "sign_allreduce" and world > 127:
        raise ValueError(f"method='sign_allreduce' sums int8 signs and needs world size <= 127, got {world}")
    stats = CommStats() if stats is None else stats
    flat = c.detach().reshape(-1)
    out_flat = None if out is None else out.view(-1)
    if method == "pbit":
        pbit_levels(world, bits, quantizer)  # validate before the empty short-cut
    if flat.numel() == 0:
        return torch.zeros_like(c) if out is None else out
    u = torch.empty_like(flat) if out_flat is None else out_flat
    VoteCodec(method, world, bits, quantizer, tie).vote(flat, u, step, group, stats, generator)
    return out if out is not None else u.view(c.shape)


def reference_vote(
    cs: list[Tensor],
    *,
    method: str,
    bits: int | None = None,
    quantizer: str | None = None,
    step: int = 0,
    tie: str = "alternate",
    generators: list[torch.Generator | None] | None = None,
) -> Tensor:
    """What :func:`majority_vote` must return, computed from every rank's ``c`` at once.

    Plain integer arithmetic, no packing and no collectives: the exact reference.
    ``generators[i]`` must be in the state rank ``i``'s generator had. ``tie``: as
    :func:`majority_vote` (zeros of c and, for ``onebit``, tied counts).
    """
    if method in VOTE_METHODS:
        check_tie(tie, method, quantizer)
    step = parity_step(tie, step)
    world = len(cs)
    flat = [c.detach().reshape(-1) for c in cs]
    if method == "sign_allreduce":
        total = sum(torch.sign(c).long() for c in flat)
        return torch.sign(total).view(cs[0].shape).to(cs[0].dtype)
    if method in ("gather", "onebit") or (method == "pbit" and quantizer is None):
        if method == "pbit":
            pbit_levels(world, bits, quantizer)
        count = sum(binary_signs(c, step).long() for c in flat)
        u = decide(count, world, step, ties="parity" if method == "onebit" else "zero")
        return u.view(cs[0].shape).to(cs[0].dtype)
    if method == "pbit":
        _, levels = pbit_levels(world, bits, quantizer)
        gens = generators or [None] * world
        total = sum(quantize(c, quantizer, levels=levels, generator=g).values.long() for c, g in zip(flat, gens))
        return torch.sign(total).view(cs[0].shape).to(cs[0].dtype)
    raise ValueError(f"method must be one of {VOTE_METHODS}, got {method!r}")
