r"""Quantizers for Lion's update vector (docs/design.md §4; the paper's §4). Pure functions.

Each quantizer maps a float tensor ``x`` to integers ``q`` in ``[-s, s]`` (``s`` =
``levels``) plus a scale, so that ``x ≈ q * scale``. Only the integers travel; the
vote is ``sign(Σ_i q_i)`` over workers, so the scale is reported for instruments and
dequantisation, not needed by the vote.

With :math:`M_p(x) = (\mathrm{mean}\,|x|^p)^{1/p}`:

* ``lp``  — :math:`Q_p(x) = \mathrm{clamp}(\mathrm{round}(s\,x / M_p(x)), -s, s)`;
  ``l1`` (p = 1) is the paper's choice: on heavy-tailed ``x`` it keeps most signs
  and acts like clipping of the outliers.
* ``l0``  — the limit p → 0: :math:`M_0` is the geometric mean of the non-zero
  :math:`|x|`.
* ``linf`` — :math:`M_\infty = \max|x|` with *stochastic* rounding
  (QSGD/TernGrad style, unbiased); needs a seeded ``torch.Generator`` for
  reproducible, resumable runs. Collapses most entries of heavy-tailed ``x`` to 0.
* ``log`` — :math:`\mathrm{sign}(x)\,2^{\mathrm{round}(\log_2 |x|/\max|x|)}` on
  ``L = floor(log2 s) + 1`` levels, as integers ``{0, ±1, ±2, …, ±2^{L-1}}``.
* ``sign`` — :math:`\mathrm{sign}(x)`, ``s = 1`` (zeros stay 0).

A norm of 0 (all-zero ``x``) quantizes to all zeros.

Example::

    >>> q, scale = quantize(torch.tensor([0.1, -2.0, 0.5]), "l1", levels=7)
    >>> q.tolist()
    [1, -7, 4]
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["QUANTIZERS", "NORM_P", "ROUNDED", "STOCHASTIC", "Quantized", "levels_for_bits", "lp_norm", "multiplier", "quantize",
           "scale_norm"]

QUANTIZERS = ("sign", "l1", "lp", "l0", "linf", "log")


NORM_P = {"l1": 1.0, "l0": 0.0, "linf": math.inf}
"""The normaliser's exponent per scaled quantizer (``lp``: its ``p``)."""

ROUNDED = ("l1", "l0", "lp")
"""Scaled quantizers that round to nearest by default (``linf`` rounds stochastically)."""
STOCHASTIC = ("linf",)
"""Quantizers that round stochastically by default (a draw from the caller's generator)."""


class Quantized(NamedTuple):
    values: Tensor  # int8, in [-levels, levels]
    scale: float  # x ≈ values * scale (off the CPU a 0-dim tensor on the device: no host read)


def levels_for_bits(bits: int) -> int:
    """Symmetric levels of a ``bits``-bit signed code: ``s = 2**(bits-1) - 1``."""
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int in [2, 8], got {bits!r}")
    return (1 << (bits - 1)) - 1


def norm_tensor(x: Tensor, p: float, work: Tensor | None = None) -> Tensor:
    """:func:`lp_norm` as a 0-dim fp32 tensor on ``x``'s device (no host read): what the
    quantizers use off the CPU, where reading it back would stall for the device. The same
    value as on the CPU except ``p=0`` off the CPU, which sums the logs over every element
    (zeros masked) rather than over the compacted non-zeros: another reduction order, so
    its last bits may differ from a CPU run's (every rank computes it the same way)."""
    x = x.detach().reshape(-1)
    if work is not None and x.dtype == torch.float32 and work.dtype == torch.float32 and work.numel() == x.numel():
        a = torch.abs(x, out=work.reshape(-1))
    else:
        a = x.abs().float()
    if a.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=a.device)
    if p == math.inf:
        return a.max()
    if p == 0:
        if a.device.type != "cpu":  # no data-dependent shape off the CPU (a[a > 0] syncs)
            keep = a > 0
            count = keep.sum()
            logs = torch.where(keep, torch.log(torch.where(keep, a, torch.ones_like(a))), torch.zeros_like(a))
            return torch.where(count > 0, torch.exp(logs.sum() / count.clamp_min(1)), torch.zeros((), device=a.device))
        nz = a[a > 0]
        return torch.exp(torch.log(nz).mean()) if nz.numel() else torch.zeros((), dtype=torch.float32)
    if p == 1:
        return a.mean()
    return a.pow(p).mean().pow(1.0 / p)


def lp_norm(x: Tensor, p: float, work: Tensor | None = None) -> float:
    """The normaliser :math:`M_p(x)`: p=inf is max|x|, p=0 the geometric mean of non-zero |x|.

    ``work``: a kept fp32 tensor of ``x``'s numel to hold ``|x|`` (for an fp32 ``x``; saves
    allocating it: the same values, so the same result). A host read: see :func:`norm_tensor`."""
    return float(norm_tensor(x, p, work))


def _round(y: Tensor, stochastic: bool, generator: torch.Generator | None) -> Tensor:
    if not stochastic:
        return torch.round(y)
    noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
    return torch.floor(y + noise)


def multiplier(levels: int, norm):
    """What a scaled quantizer multiplies ``x`` by before rounding: ``levels / norm``, or
    0.0 when ``norm`` is 0 or not finite (every code 0). ``norm`` a float, or a 0-dim tensor
    (the result is then a 0-dim fp32 tensor on its device, equal to the float's: a float32
    division is correctly rounded either way)."""
    if isinstance(norm, Tensor):
        norm = norm.float()
        ok = torch.isfinite(norm) & (norm != 0)
        # a true division (``levels / t`` would be t.reciprocal() * levels: two roundings)
        quotient = torch.div(torch.full_like(norm, float(levels)), torch.where(ok, norm, torch.ones_like(norm)))
        return torch.where(ok, quotient, torch.zeros_like(norm))
    return 0.0 if norm == 0.0 or not math.isfinite(norm) else levels / norm


def scale_norm(x: Tensor, method: str, p: float = 1.0, work: Tensor | None = None) -> float:
    """The normaliser a scaled quantizer (``l1``, ``l0``, ``lp`` with ``p``, ``linf``)
    divides ``x`` by: what :func:`quantize` uses, and the fused encode of :mod:`lioncub.votes.pbit`."""
    if x.device.type != "cpu":  # off the CPU: a 0-dim tensor on the device, never read back
        return norm_tensor(x, NORM_P.get(method, p), work)
    return lp_norm(x, NORM_P.get(method, p), work)


def _scaled(x: Tensor, levels: int, norm, stochastic: bool, generator) -> Quantized:
    mult = multiplier(levels, norm)
    if isinstance(mult, Tensor):  # off the CPU: no branch on the value (a zero mult gives zero codes)
        y = x.float() * mult
        q = _round(y, stochastic, generator).clamp_(-levels, levels)
        return Quantized(q.to(torch.int8), torch.where(mult != 0, norm.float() / levels, torch.zeros_like(mult)))
    if mult == 0.0:
        return Quantized(torch.zeros(x.shape, dtype=torch.int8, device=x.device), 0.0)
    y = x.float() * mult
    q = _round(y, stochastic, generator).clamp_(-levels, levels)
    return Quantized(q.to(torch.int8), norm / levels)


def _log(x: Tensor, levels: int) -> Quantized:
    top = int(math.floor(math.log2(levels)))  # largest code is 2**top <= levels
    if x.device.type != "cpu":  # the same codes, no host read of the norm
        norm = norm_tensor(x, math.inf)
        ok = torch.isfinite(norm) & (norm != 0)
        a = x.float().abs() / torch.where(ok, norm, torch.ones_like(norm))
        e = torch.round(torch.log2(a.clamp_min(1e-30))) + top
        mag = torch.where((e >= 0) & ok, torch.exp2(e.clamp_min(0)), torch.zeros_like(e))
        q = (torch.sign(x.float()) * mag).to(torch.int8)
        return Quantized(q, torch.where(ok, norm / (1 << top), torch.zeros_like(norm)))
    norm = lp_norm(x, math.inf)
    if norm == 0.0 or not math.isfinite(norm):
        return Quantized(torch.zeros(x.shape, dtype=torch.int8, device=x.device), 0.0)
    a = x.float().abs() / norm  # in [0, 1]
    e = torch.round(torch.log2(a.clamp_min(1e-30))) + top  # exponent code; < 0 means too small
    mag = torch.where(e >= 0, torch.exp2(e.clamp_min(0)), torch.zeros_like(e))
    q = (torch.sign(x.float()) * mag).to(torch.int8)
    return Quantized(q, norm / (1 << top))


def quantize(
    x: Tensor,
    method: str,
    *,
    levels: int | None = None,
    bits: int | None = None,
    p: float = 1.0,
    stochastic: bool | None = None,
    generator: torch.Generator | None = None,
) -> Quantized:
    """Quantize ``x`` to integers in ``[-levels, levels]``; see the module docstring.

    Give either ``levels`` (s, 1..127) or ``bits`` (s = 2**(bits-1) - 1). ``p`` is the
    exponent of ``method='lp'``. ``stochastic`` defaults to True for ``linf`` and False
    otherwise; ``generator`` seeds stochastic rounding.
    """
    if method not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {method!r}")
    if method == "sign":
        return Quantized(torch.sign(x).to(torch.int8), 1.0)
    if levels is None:
        if bits is None:
            raise ValueError(f"quantizer {method!r} needs levels or bits")
        levels = levels_for_bits(bits)
    if not isinstance(levels, int) or not 1 <= levels <= 127:
        raise ValueError(f"levels must be an int in [1, 127], got {levels!r}")
    if method == "log":
        return _log(x, levels)
    if method == "lp" and not (p >= 0):
        raise ValueError(f"p must be >= 0 for quantizer 'lp', got {p!r}")
    if stochastic is None:
        stochastic = method in STOCHASTIC
    return _scaled(x, levels, scale_norm(x, method, p), stochastic, generator)
