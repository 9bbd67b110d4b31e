r"""``pbit``: values in w-bit lanes of bytes, one uint8 SUM all-reduce (docs/design.md §3).

Binary signs send {0, 1} per lane (zeros of c follow the tie rule, a tied count votes 0);
a quantizer's q ∈ [−s, s] travels offset to [0, 2s] (exact integer sums, ties → 0). The
engine's SUM adds lanes without carries while no lane sum exceeds 2^w − 1: binary signs need
P ≤ 2^w − 1, quantized 2s·P ≤ 2^w − 1 (:func:`pbit_levels`). Bytes per element per rank:
2(P−1)/P · w/8.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .. import comm, fused
from ..wire import kernels, packing
from ..quantize import QUANTIZERS, ROUNDED, multiplier, quantize, scale_norm
from .base import VoteMethod, binary_signs, decide

__all__ = ["PBit", "pbit_levels", "MEAN_CLIP"]

MEAN_CLIP = 4
""":meth:`PBit.lane_mean`: lanes cover ±4 mean magnitudes of a tensor (fewer with fewer levels)."""


def pbit_levels(world: int, bits: Optional[int], quantizer: Optional[str]) -> tuple[int, Optional[int]]:
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


class PBit(VoteMethod):
    name = "pbit"
    LANE_BITS = packing.LANE_BITS
    TAKES_QUANTIZER = True
    gamma = (1.6e-9, 0.0)  # fused 4-bit lanes; p, m updated straight from the lane sums
    auto_rank = 2

    @classmethod
    def has_tie_rule(cls, quantizer):
        return quantizer is None

    def configure(self, world, bits, quantizer) -> int:
        w, self.levels = pbit_levels(world, bits, quantizer)
        self.one_pass = quantizer is None  # a quantizer's scale needs the whole c first (VoteMethod may clear it)
        self.repeatable = quantizer is None or quantizer in ROUNDED  # linf draws, log / sign: torch ops
        return w

    def plan(self, n):
        return [("allreduce", -(-n * self.bits // 8))]

    def thresholds(self) -> tuple[int, int]:
        """u = (k > above) − (k < below) of the lane sums k: binary signs
        u = (2k > P) − (2k < P); quantized u = sign(k − P·s), P·s ≤ 127."""
        w = self.world
        return (w // 2, (w + 1) // 2) if self.levels is None else (w * self.levels,) * 2

    def encode(self, c, dst, step, generator=None, work=None, use_fused=False, sizes=None, residuals=None):
        n = c.numel()
        if self.levels is None:
            values = self.sign_values(c, step, generator, sizes, residuals)  # word-padded 0/1 bytes, [:n] are the values
        elif use_fused and self.quantizer in ROUNDED:  # round, clamp and lanes in one pass
            mult = multiplier(self.levels, scale_norm(c, self.quantizer, work=work))  # as quantize() does
            fused.quantize_lanes(c, mult, self.levels, self.bits, dst)
            return
        else:
            q = quantize(c, self.quantizer, levels=self.levels, generator=generator).values
            values = q.view(torch.uint8) + self.levels  # q + s in [0, 2s]: exact modulo 256
        dst.copy_(values[:n] if self.bits == 8 else kernels.pack_bytes(values, n, self.bits))

    def exchange(self, msg, m, step, group, stats) -> Tensor:
        comm.all_reduce(msg[:m], group, stats)  # lane sums, no carries
        return msg

    def decode(self, voted, offset, n, out):
        part = voted[offset:offset + self.part_nbytes(n)]
        return kernels.vote_lanes(part, n, self.bits, *self.thresholds(), out.dtype, out=out)

    @classmethod
    def partial_vote(cls, quantizer):  # binary lanes: an abstaining rank's 0 bits add no plus vote
        return quantizer is None

    def decode_for(self, voted, offset, n, out, count):
        if self.levels is not None:
            return super().decode_for(voted, offset, n, out, count)
        part = voted[offset:offset + self.part_nbytes(n)]  # u = (2k > C) − (2k < C) of the C that voted
        return kernels.vote_lanes(part, n, self.bits, count // 2, (count + 1) // 2, out.dtype, out=out)

    def apply_fused(self, params, exp_avgs, grads, part, hyper) -> bool:
        fused.apply_lanes(params, exp_avgs, grads, part, self.bits, *self.thresholds(), **hyper)
        return True

    def reference(self, cs, step, generators=None):
        if self.levels is None:
            count = sum(binary_signs(c, step).long() for c in cs)
            return decide(count, len(cs), step, ties="zero").long()
        gens = generators or [None] * len(cs)
        return torch.sign(sum(quantize(c, self.quantizer, levels=self.levels, generator=g).values.long()
                              for c, g in zip(cs, gens)))

    # ------------------------------------------------------------------ the lane mean
    @classmethod
    def round_mean(cls, quantizer):  # lanes whose SUM all-reduce adds L1-quantized values exactly
        return "lane_mean" if quantizer == "l1" else None

    def lane_mean(self, v: Tensor, sizes: list[int], norms: list[float], group, stats) -> tuple[Tensor, Tensor]:
        """The mean of the ranks' quantized ``v`` through summed lanes (``pbit`` with ``l1``;
        :class:`~lioncub.LocalCub`'s ``aggregate='mean'``). Collective.

        Per tensor t (``sizes``: element counts in order), one scale shared by the ranks:
        ``norms[t]`` = M_t, the ranks' mean of mean|v_i| over t, and the step
        ``unit_t = min(s, CLIP)·M_t / s``: s levels cover ±min(s, CLIP)·M_t (one level: a
        ternary q at ±M_t; more: clipping only beyond CLIP = 4 mean magnitudes).
        q_i = clamp(round(v_i/unit_t), −s, s) travels as q_i + s in w-bit lanes; the SUM
        all-reduce adds lanes without carries (2s·P ≤ 2^w − 1), so Σ_i q_i comes back exact.
        Returns (unit·Σ_i q_i / P, unit·q_i): the mean and this rank's C(v), flat fp32.

        The three halves (:meth:`lane_message`, the all-reduce, :meth:`lane_total`) are public so
        a caller may keep the all-reduce in flight (LocalCub's streaming rounds)."""
        units, q, msg = self.lane_message(v, sizes, norms)
        if msg is not None:
            comm.all_reduce(msg, group, stats)
        return self.lane_total(msg, q, sizes, units), self.lane_sent(q, sizes, units)

    def lane_message(self, v: Tensor, sizes: list[int], norms: list[float]) -> tuple[list[float], Tensor,
                                                                                      Optional[Tensor]]:
        """(units, q, the lanes to all-reduce: None for one rank) of :meth:`lane_mean`."""
        if self.quantizer != "l1":
            raise ValueError(f"lane_mean sums L1-quantized lanes: it needs quantizer='l1', got {self.quantizer!r}")
        levels = self.levels
        units = (torch.tensor(norms, dtype=torch.float64) * (min(levels, MEAN_CLIP) / levels)).tolist()  # host
        q = torch.empty_like(v)
        for qt, vt, unit in zip(q.split(sizes), v.split(sizes), units):
            if unit > 0:
                torch.round(vt * (1.0 / unit), out=qt).clamp_(-levels, levels)
            else:
                qt.zero_()
        msg = kernels.pack_bytes((q + levels).to(torch.uint8), v.numel(), self.bits) if self.world > 1 else None
        return units, q, msg

    def lane_total(self, lanes: Optional[Tensor], q: Union[Tensor, int], sizes: list[int], units: list[float],
                   count: Optional[int] = None) -> Tensor:
        """unit·Σ_i q_i / count from the all-reduced ``lanes`` (None: one rank, Σ = this q; with lanes, ``q``
        may be its element count, so that q need not be kept while they are in flight).
        ``count``: the ranks whose q is a contribution (default P; a rank that sends q = 0
        adds nothing to the sum, and a fault-tolerant round leaves it out of the mean)."""
        P = self.world
        if lanes is None:
            total = q.clone()
        else:
            n = q if isinstance(q, int) else q.numel()
            total = kernels.unpack_bytes(lanes, n, self.bits).to(torch.float32).sub_(float(P * self.levels))
        count = P if count is None else count
        for tt, unit in zip(total.split(sizes), units):
            tt.mul_(unit / count)
        return total

    @staticmethod
    def lane_sent(q: Tensor, sizes: list[int], units: list[float]) -> Tensor:
        """This rank's C(v) = unit·q_i (in place on ``q``)."""
        for qt, unit in zip(q.split(sizes), units):
            qt.mul_(unit)
        return q
