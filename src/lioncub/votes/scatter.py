r"""The code of a round's two-phase compressed mean (:class:`~lioncub.votes.rounds.ScatterMean`): values
to ``b``-bit codes and back, with a scale per piece of a tensor, and :class:`LevelCodec`, the
:class:`~lioncub.votes.twophase.Codec` its exchange (:mod:`lioncub.votes.twophase`) runs.

A ``b``-bit code holds one of the levels ``q`` (the value sent is ``unit·q``, ``M`` the mean magnitude):

* ``b = 1``: ``q = ±1``, the sign, at ``unit = M`` (the L1 scale of a sign).
* ``b = 2``: ``q ∈ {−3/2, −1/2, +1/2, +3/2}``, a sign and one magnitude bit, at ``unit = 1.25·M``
  (about the best uniform step of four levels for a normal distribution, ``σ ≈ 1.25·M``);
  ``q = clamp(floor(v / unit) + 1/2, −3/2, 3/2)``. (A ternary code, three levels with one code unused, has
  about twice its error on normal values: bench/README, "Rounds below 8 bits".)
* ``b ≥ 4``: ``q ∈ {−s, …, s}`` with ``s = 2^(b−1) − 1``, ``q = clamp(round(v / unit), −s, s)``,
  ``unit = min(s, CLIP)·M / s``: the levels cover ±min(s, CLIP) mean magnitudes
  (:data:`~lioncub.votes.pbit.MEAN_CLIP`, as the 8-bit lane mean's do).

A zero of ``v`` on the codes without a zero level (``b ≤ 2``) takes the round's parity (+ on even rounds),
as the 1-bit votes' zeros do. A code travels as ``q + (2^b − 1)/2`` (``b ≤ 2``) or ``q + s`` in ``b``-bit
lanes of bytes.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from ..wire import kernels
from .pbit import MEAN_CLIP
from .twophase import Codec

__all__ = ["SCATTER_BITS", "levels_of", "unit_of", "to_levels", "codes", "from_codes", "owner_span", "piece_scales",
           "LevelCodec"]

SCATTER_BITS = (1, 2, 4, 8)
"""The code widths a two-phase mean takes, bits per element in each of its two collectives."""


def levels_of(bits: int) -> float:
    """The largest level of a ``bits``-wide code: 1 (the sign), 3/2, or ``s = 2^(bits−1) − 1``."""
    return {1: 1.0, 2: 1.5}.get(bits, float((1 << (bits - 1)) - 1))


def _offset(bits: int) -> float:
    """What a level adds to become its code: ``(2^b − 1)/2`` for the codes without a zero level, else ``s``."""
    return (1 << bits) / 2 - 0.5 if bits <= 2 else levels_of(bits)


def unit_of(scale, bits: int):
    """The value of one level for the mean magnitude ``scale`` (a float or a tensor; module docstring)."""
    if bits <= 2:
        return scale if bits == 1 else scale * 1.25
    s = levels_of(bits)
    return scale * (min(s, MEAN_CLIP) / s)


def to_levels(v: Tensor, unit: Union[float, Tensor], bits: int, parity: int, out: Tensor) -> None:
    """``q`` of the flat ``v`` for a level of ``unit``, as fp32 into ``out`` (same size). ``unit``: a host float
    (``v`` times its reciprocal, as the lane mean quantizes) or a 0-dim fp32 tensor on ``v``'s device (``v`` over
    it, no host read; 0 only where ``v`` is all zeros). ``parity``: where a zero of ``v`` goes on the codes without
    a zero level (0: up, 1: down, as :func:`lioncub.wire.kernels.sign_bits`)."""
    if bits == 1:
        out.copy_(kernels.sign_bits(v, parity)[:v.numel()]).mul_(2).sub_(1)
        return
    s = levels_of(bits)
    if isinstance(unit, Tensor):
        torch.div(v, unit.clamp_min(torch.finfo(torch.float32).tiny), out=out)
    elif unit > 0:
        torch.mul(v, 1.0 / unit, out=out)
    else:
        out.zero_()
    if bits == 2:  # a sign and a magnitude bit: floor + 1/2, a zero by the parity
        out.floor_().add_(0.5).masked_fill_(v == 0, -0.5 if parity else 0.5)
    else:
        out.round_()
    out.clamp_(-s, s)


def codes(q: Tensor, bits: int, length: int) -> Tensor:
    """The fp32 levels ``q`` packed as ``bits``-wide codes, zero-padded to ``length`` elements (the padding
    decodes to level ``−s``, which no reader takes)."""
    values = torch.zeros(length, dtype=torch.uint8, device=q.device)
    values[:q.numel()].copy_((q + 1).div_(2) if bits == 1 else q + _offset(bits))
    return kernels.pack_bytes(values, length, bits)


def from_codes(packed: Tensor, n: int, bits: int, out: Optional[Tensor] = None) -> Tensor:
    """The first ``n`` levels of ``packed`` codes as fp32 (into ``out`` when given)."""
    values = kernels.unpack_bytes(packed, n, bits)
    values = values.to(torch.float32) if out is None else out.copy_(values)
    return values.mul_(2).sub_(1) if bits == 1 else values.sub_(_offset(bits))


def owner_span(n: int, world: int, bits: int) -> int:
    """Elements of a message of ``n`` that each rank owns in the two-phase mean: ``ceil(n / P)`` rounded up to a
    whole byte of codes."""
    per = 8 // bits
    share = -(-n // world)
    return -(-share // per) * per


def piece_scales(values: Tensor, spans: list[tuple[int, int, int]], count: int, device) -> Tensor:
    """Each of ``count`` tensors' mean |values| over its span ``(tensor, lo, hi)`` of the flat ``values``
    (fp32; 0 for a tensor with no span)."""
    out = torch.zeros(count, dtype=torch.float32, device=device)
    for t, lo, hi in spans:
        out[t] = values[lo:hi].abs().mean()
    return out


class LevelCodec(Codec):
    """The scatter mean's code (:class:`~lioncub.votes.rounds.ScatterMean`): ``bits``-wide levels; the ranks'
    levels summed exactly and scaled by each tensor's shared unit (``units``, over ``count`` ranks); the owner's
    unit from its mean |x| over each piece. ``parity``: where a zero goes on the codes without a zero level."""

    def __init__(self, bits: int, parity: int, units: list[float], count: int):
        self.bits, self.parity, self.units, self.count = bits, parity, units, count

    def owner_sum(self, codes, scales, mine, h):
        P, E = codes.shape[0], codes.shape[1] * 8 // self.bits
        total = from_codes(codes.reshape(-1), P * E, self.bits).view(P, E).sum(0)
        x = torch.zeros(E, dtype=torch.float32, device=codes.device)
        for t, lo, hi in mine:
            torch.mul(total[lo:hi], self.units[t] / self.count, out=x[lo:hi])
        return x

    def scales(self, x, mine, count, h):
        return unit_of(piece_scales(x, mine, count, x.device), self.bits)

    def levels(self, x, scales, mine):
        w = torch.zeros_like(x)
        for t, lo, hi in mine:
            to_levels(x[lo:hi], scales[t], self.bits, self.parity, w[lo:hi])
        return w, codes(w, self.bits, x.numel())

    def unpack(self, packed, n, out):
        return from_codes(packed, n, self.bits, out)
