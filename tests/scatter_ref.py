"""A float64 reference of one scatter mean (LocalCub's ``vote='onebit', aggregate='mean'``), written from
:class:`lioncub.votes.rounds.ScatterMean`'s and :mod:`lioncub.votes.scatter`'s docstrings, never by calling them.

One message of P ranks: each rank's ``v`` (its pieces of tensors, ``sizes`` elements each, in order), every
owner's residual of its span; out come ``d`` (the same on every rank), each rank's ``C(v)`` (what its worker
residual subtracts) and the owners' residuals, updated. Test helper only: it knows nothing of chunks, fragments
or shards; a caller cuts its model into messages as the docstrings say and calls :func:`scatter_mean` once per
message."""
from __future__ import annotations

import math

import torch

CLIP = 4
"""The levels of ``b >= 4`` bits cover ± this many mean magnitudes (``MEAN_CLIP``)."""


def top_level(bits: int) -> float:
    """The largest level of a ``bits``-wide code: the sign 1, 3/2 at 2 bits, else 2^(b−1) − 1."""
    if bits == 1:
        return 1.0
    return 1.5 if bits == 2 else float(2 ** (bits - 1) - 1)


def level_unit(mean_abs: float, bits: int) -> float:
    """The value of one level for a mean magnitude ``mean_abs``: M at 1 bit, 1.25·M at 2, min(s, CLIP)·M/s."""
    if bits == 1:
        return mean_abs
    if bits == 2:
        return 1.25 * mean_abs
    s = top_level(bits)
    return mean_abs * min(s, CLIP) / s


def levels(x: torch.Tensor, unit: float, bits: int, parity: int) -> torch.Tensor:
    """The levels of ``x`` (float64) at ``unit``: the sign at 1 bit; floor(x/unit) + 1/2 clamped to ±3/2 at 2;
    round(x/unit) clamped to ±s above. Without a zero level (b <= 2) a zero goes up on even rounds, down on odd."""
    zero_goes = -1.0 if parity % 2 else 1.0
    if bits == 1:
        return torch.where(x == 0, zero_goes, torch.sign(x)).double()
    if unit <= 0:
        return torch.zeros_like(x, dtype=torch.float64)
    s = top_level(bits)
    if bits == 2:
        return torch.where(x == 0, zero_goes * 0.5, torch.floor(x / unit) + 0.5).clamp(-s, s).double()
    return torch.round(x / unit).clamp(-s, s).double()


def owner_span(n: int, world: int, bits: int) -> int:
    """Elements of an ``n``-element message each of ``world`` ranks owns: ceil(n / P), up to a whole byte of codes."""
    per = 8 // bits
    return math.ceil(math.ceil(n / world) / per) * per


def _pieces(sizes: list[int]) -> list[tuple[int, int]]:
    """Each tensor's (start, end) in the flat message."""
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


def scatter_mean(vs: list[torch.Tensor], sizes: list[int], owners: list[torch.Tensor], bits: int,
                 parity: int) -> tuple[torch.Tensor, list[torch.Tensor], list[float]]:
    """One scatter mean over ``len(vs)`` ranks, in float64.

    ``vs``: each rank's flat v; ``owners``: each rank's residual of its span (float64, :func:`owner_span`
    elements), replaced in the list by its new value. Returns ``(d, C, units)``: d, each rank's C(v) = unit_t·q,
    and every positive unit used (the workers' and the owners'), for a caller's tolerance."""
    P, n = len(vs), sum(sizes)
    pieces = _pieces(sizes)
    worker_units = []
    for lo, hi in pieces:  # unit_t from M_t: the ranks' mean of each rank's mean |v| over tensor t
        M = sum(float(v[lo:hi].abs().mean()) if hi > lo else 0.0 for v in vs) / P
        worker_units.append(level_unit(M, bits))
    qs = [torch.cat([levels(v[lo:hi], u, bits, parity) for (lo, hi), u in zip(pieces, worker_units)])
          if n else torch.zeros(0, dtype=torch.float64) for v in vs]
    sent = [torch.cat([q[lo:hi] * u for (lo, hi), u in zip(pieces, worker_units)]) if n else q for q in qs]
    mean = sum(sent) / P if n else torch.zeros(0, dtype=torch.float64)  # unit_t·Σ_i q_i / P
    E = owner_span(n, P, bits)
    d = torch.zeros(n, dtype=torch.float64)
    used = [u for u in worker_units if u > 0]
    for j in range(P):  # owner j: the j-th span of the message
        a, b = j * E, min(n, (j + 1) * E)
        x = owners[j].clone()
        if b > a:
            x[:b - a] += mean[a:b]
        for lo, hi in pieces:  # tensor t's part of the span, re-quantized at its own unit'
            lo, hi = max(lo, a), min(hi, b)
            if hi <= lo:
                continue
            part = x[lo - a:hi - a]
            u2 = level_unit(float(part.abs().mean()), bits)
            w = levels(part, u2, bits, parity)
            d[lo:hi] = u2 * w
            x[lo - a:hi - a] = part - u2 * w
            used += [u2] if u2 > 0 else []
        owners[j] = x
    return d, sent, used
