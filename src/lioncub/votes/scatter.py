r"""The arithmetic of a round's two-phase compressed mean (:class:`~lioncub.votes.rounds.ScatterMean`): values
to ``b``-bit codes and back, with a scale per piece of a tensor.

A ``b``-bit code holds one of the levels ``q``:

* ``b = 1``: ``q = ±1``, the sign (a zero takes the round's parity, as the 1-bit votes' zeros do);
  the step of a level is the scale itself, ``unit = M``.
* ``b ≥ 2``: ``q ∈ {−s, …, s}`` with ``s = 2^(b−1) − 1`` (``b = 2``: ternary, one of the four codes unused),
  ``q = clamp(round(v / unit), −s, s)``, ``unit = min(s, CLIP)·M / s``: the levels cover ±min(s, CLIP)
  mean magnitudes ``M`` (:data:`~lioncub.votes.pbit.MEAN_CLIP`, as the 8-bit lane mean's do).

A code travels as ``q + s`` (``b = 1``: 0 for −1, 1 for +1) in ``b``-bit lanes of bytes.
"""
from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from ..wire import kernels
from .pbit import MEAN_CLIP

__all__ = ["SCATTER_BITS", "levels_of", "unit_of", "to_levels", "codes", "from_codes", "owner_span", "spans_in",
           "piece_scales"]

SCATTER_BITS = (1, 2, 4, 8)
"""The code widths a two-phase mean takes, bits per element in each of its two collectives."""


def levels_of(bits: int) -> int:
    """``s``, the largest level of a ``bits``-wide code (1 for the sign)."""
    return 1 if bits == 1 else (1 << (bits - 1)) - 1


def unit_of(scale, bits: int):
    """The value of one level for the mean magnitude ``scale`` (a float or a tensor; module docstring)."""
    s = levels_of(bits)
    return scale if bits == 1 else scale * (min(s, MEAN_CLIP) / s)


def to_levels(v: Tensor, unit: Union[float, Tensor], bits: int, parity: int, out: Tensor) -> None:
    """``q`` of the flat ``v`` for a level of ``unit``, as fp32 into ``out`` (same size). ``unit``: a host float
    (``v`` times its reciprocal, as the lane mean quantizes) or a 0-dim fp32 tensor on ``v``'s device (``v`` over
    it, no host read; 0 only where ``v`` is all zeros). ``parity``: where a zero of ``v`` goes on the sign code
    (0: +1, 1: −1, as :func:`lioncub.wire.kernels.sign_bits`)."""
    if bits == 1:
        out.copy_(kernels.sign_bits(v, parity)[:v.numel()]).mul_(2).sub_(1)
        return
    s = levels_of(bits)
    if isinstance(unit, Tensor):
        torch.div(v, unit.clamp_min(torch.finfo(torch.float32).tiny), out=out).round_().clamp_(-s, s)
    elif unit > 0:
        torch.round(v * (1.0 / unit), out=out).clamp_(-s, s)
    else:
        out.zero_()


def codes(q: Tensor, bits: int, length: int) -> Tensor:
    """The fp32 levels ``q`` packed as ``bits``-wide codes, zero-padded to ``length`` elements (the padding
    decodes to level ``−s``, which no reader takes)."""
    s = levels_of(bits)
    values = torch.zeros(length, dtype=torch.uint8, device=q.device)
    values[:q.numel()].copy_((q + 1).div_(2) if bits == 1 else q + s)
    return kernels.pack_bytes(values, length, bits)


def from_codes(packed: Tensor, n: int, bits: int) -> Tensor:
    """The first ``n`` levels of ``packed`` codes as fp32."""
    values = kernels.unpack_bytes(packed, n, bits).to(torch.float32)
    return values.mul_(2).sub_(1) if bits == 1 else values.sub_(levels_of(bits))


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


def spans_in(sizes: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(tensor, start, end)`` of each of the consecutive pieces of ``sizes`` that overlap the element range
    ``[lo, hi)``, relative to ``lo``."""
    out, start = [], 0
    for t, size in enumerate(sizes):
        a, b = max(start, lo), min(start + size, hi)
        if a < b:
            out.append((t, a - lo, b - lo))
        start += size
    return out

