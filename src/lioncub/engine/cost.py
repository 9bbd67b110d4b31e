r"""The α-β cost model of the vote methods (docs/design.md §3, §6), as small pure functions.

For ``n`` elements on ``P`` workers, with α the per-message latency (s) and β the
seconds per bit of one full-duplex link, the ring collectives cost::

    allreduce  of B bytes            2(P-1)·α + 2(P-1)/P · 8B · β   sends 2(P-1)/P · B
    all_gather of B bytes per rank    (P-1)·α +  (P-1)   · 8B · β   sends  (P-1)   · B
    all_to_all of B bytes per rank    (P-1)·α +  (P-1)/P · 8B · β   sends  (P-1)/P · B

and every method is a fixed composition of them, which the method object states
(:meth:`lioncub.votes.VoteMethod.plan`), within world-size limits of its own
(:func:`method_valid`). :func:`methods` lists the methods, ``grad`` (the plain gradient
all-reduce) and those of the registry :data:`lioncub.votes.METHODS`, each with what it sends
in its own words. ``P == 1`` sends nothing and costs nothing. The binary votes' error feedback
(the workers' and ``onebit``'s chunk owners') and stochastic signs (:mod:`lioncub.votes.feedback`)
keep their scales and residuals local: the same bytes, priced as the plain method. The same functions serve run time
(:func:`lioncub.engine.auto.choose_vote` adds each method's local cost to :func:`predicted_time`,
with α and β from :func:`calibrate`) and benchmark reports.

Example::

    >>> from lioncub.engine.cost import methods, predicted_bytes, predicted_time
    >>> methods()['sign_allreduce']
    'int8 signs, one SUM all-reduce; u = sign of the sum.'
    >>> predicted_bytes('onebit', 10**6, 4)['bytes_sent']
    187500.0
    >>> predicted_time('onebit', 10**6, 4, alpha=5e-5, beta=1e-9) < predicted_time('pbit', 10**6, 4, 5e-5, 1e-9)
    True
"""
from __future__ import annotations

import math
import sys
from typing import Sequence

from .. import votes
from ..quantize import QUANTIZERS
from ..validate import check_int

VOTE_METHODS = votes.VOTE_METHODS
METHODS = ("grad",) + VOTE_METHODS
GRAD_DTYPES = {"fp32": 4, "bf16": 2}
GRAD_PLAN = "one all-reduce of the gradients: n·4 (fp32) or n·2 (bf16) bytes."
DEFAULT_PROBE_SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
PROBE_STOP_S = 0.5
"""``calibrate``'s default ``max_probe_s``: larger probes are skipped once one takes longer than this."""

__all__ = [
    "METHODS",
    "VOTE_METHODS",
    "methods",
    "predicted_bytes",
    "predicted_time",
    "collective_time",
    "method_valid",
    "calibrate",
    "fit_alpha_beta",
]


def methods() -> dict[str, str]:
    """Each method this model prices → what it sends: ``grad`` (:data:`GRAD_PLAN`), then the
    vote methods in registry order, each by the first paragraph of its own docstring (the
    class's, else its module's) without a leading ``name``: label. A method added to
    :data:`lioncub.votes.METHODS` is listed here with no edit to this module."""
    return {"grad": GRAD_PLAN, **{name: _summary(cls) for name, cls in votes.METHODS.items()}}


def _summary(cls: type[votes.VoteMethod]) -> str:
    """The first paragraph of the docstring of ``cls`` (else of its module) as one line."""
    doc = cls.__doc__ or sys.modules[cls.__module__].__doc__ or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    return first.removeprefix(f"``{cls.name}``: ")


def _check_common(method: str, n: int, world_size: int) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    check_int("n", n, 0)
    check_int("world_size", world_size, 1)


def method_valid(method: str, world_size: int, *, bits: int | None = None, quantizer=None) -> bool:
    """Whether ``method`` (lane width ``bits``, ``quantizer``) is exact for ``world_size``.

    The vote method's own checks decide (:class:`lioncub.votes.VoteMethod`: e.g.
    sign_allreduce sums int8 signs, P <= 127; pbit needs 2s·P <= 2^w - 1; only pbit takes a
    quantizer); ``grad`` is valid everywhere. Malformed ``bits``/``quantizer`` raise ValueError.
    """
    _check_common(method, 0, world_size)
    if quantizer is not None and quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer must be None or one of {QUANTIZERS}; got {quantizer!r}")
    if method == "grad":
        return True
    cls = votes.lookup(method)
    if bits is not None and cls.LANE_BITS and bits not in cls.LANE_BITS:
        raise ValueError(f"bits must be None or one of {cls.LANE_BITS} for method {method!r}; got {bits!r}")
    try:
        cls(world_size, bits, quantizer)
    except ValueError:  # beyond the method's limits for this world size
        return False
    return True


def _plan(method, n, world_size, bits, grad_dtype, quantizer):
    """The collectives ``method`` issues: list of (kind, bytes) and the lane width used."""
    _check_common(method, n, world_size)
    if method == "grad":
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype must be one of {tuple(GRAD_DTYPES)}; got {grad_dtype!r}")
        return [("allreduce", n * GRAD_DTYPES[grad_dtype])], None
    if not method_valid(method, world_size, bits=bits, quantizer=quantizer):
        raise ValueError(
            f"method={method!r} (bits={bits}, quantizer={quantizer!r}) is not valid for world_size={world_size}"
        )
    vote = votes.make(method, world_size, bits, quantizer)
    return vote.plan(n), vote.option_bits


def _sent(kind: str, nbytes: int, P: int) -> float:
    if P == 1:
        return 0.0
    if kind == "allreduce":
        return 2 * (P - 1) / P * nbytes
    if kind == "all_gather":
        return float((P - 1) * nbytes)
    return (P - 1) / P * nbytes  # all_to_all: B bytes in total per rank


def collective_time(kind: str, nbytes: int, world_size: int, alpha: float, beta: float) -> float:
    """Ring time of one collective: kind in ('allreduce', 'all_gather', 'all_to_all')."""
    if kind not in ("allreduce", "all_gather", "all_to_all"):
        raise ValueError(f"kind must be 'allreduce', 'all_gather' or 'all_to_all'; got {kind!r}")
    P = world_size
    if P == 1:
        return 0.0
    messages = 2 * (P - 1) if kind == "allreduce" else P - 1
    return messages * alpha + _sent(kind, nbytes, P) * 8 * beta


def predicted_bytes(method: str, n: int, world_size: int, *, bits: int | None = None,
                    grad_dtype: str = "fp32", quantizer=None) -> dict:
    """Bytes one worker sends (= receives) per step, and how many collectives it issues.

    Returns ``{'bytes_sent', 'bytes_recv', 'n_collectives', 'payload_bytes', 'bits'}``;
    ``payload_bytes`` lists the tensor size in bytes handed to each collective and
    ``bits`` the lane width used (pbit only). ``P == 1`` sends zero bytes but still
    issues the collectives (as :func:`lioncub.votes.api.majority_vote` does); ``n == 0``
    issues none.
    """
    plan, w = _plan(method, n, world_size, bits, grad_dtype, quantizer)
    if n == 0:
        plan = []  # the vote short-cuts empty tensors
    sent = sum(_sent(kind, b, world_size) for kind, b in plan)
    return {
        "bytes_sent": float(sent),
        "bytes_recv": float(sent),
        "n_collectives": len(plan),
        "payload_bytes": [b for _, b in plan],
        "bits": w,
    }


def predicted_time(method: str, n: int, world_size: int, alpha: float, beta: float, *,
                   bits: int | None = None, grad_dtype: str = "fp32", quantizer=None,
                   gamma: float = 0.0) -> float:
    """Seconds per step spent communicating (plus ``gamma``·n of local pack/vote work).

    ``gamma`` (s per element) models quantize/pack/unpack/vote; it applies to the
    vote methods only, never to the plain gradient allreduce.
    """
    for name, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0; got {v!r}")
    plan, _ = _plan(method, n, world_size, bits, grad_dtype, quantizer)
    t = sum(collective_time(kind, b, world_size, alpha, beta) for kind, b in plan)
    if method != "grad":
        t += gamma * n
    return t


def fit_alpha_beta(nbytes: Sequence[int], seconds: Sequence[float], world_size: int) -> tuple[float, float]:
    """Least-squares fit of allreduce times t = 2(P-1)α + 2(P-1)/P·8B·β; returns (α, β).

    Both are clamped to a tiny positive floor so callers always get usable numbers.
    """
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError("nbytes and seconds must have equal length with >= 2 distinct sizes")
    P = world_size
    if P == 1:
        return 0.0, 0.0
    k = len(nbytes)
    mx, my = sum(nbytes) / k, sum(seconds) / k
    sxx = sum((x - mx) ** 2 for x in nbytes)
    slope = sum((x - mx) * (y - my) for x, y in zip(nbytes, seconds)) / sxx
    intercept = my - slope * mx
    alpha = max(intercept / (2 * (P - 1)), 1e-9)
    beta = max(slope / (2 * (P - 1) / P * 8), 1e-15)
    return alpha, beta


def calibrate(group=None, sizes: Sequence[int] = DEFAULT_PROBE_SIZES, *, repeats: int = 3,
              warmup: int = 1, device=None, max_probe_s: float = PROBE_STOP_S) -> tuple[float, float]:
    """Measure (α, β) on a live process group with uint8 SUM allreduces of ``sizes`` bytes.

    The sizes run smallest first, each ``warmup`` + ``repeats`` times after a barrier; a rank
    keeps its median, and a MAX allreduce makes every rank hold the same (slowest-rank) time, so
    all ranks fit identical (α, β) and hence pick the same method. Once a size's agreed time passes
    ``max_probe_s`` (after at least two sizes) the larger sizes are skipped, on every rank alike: on
    a slow link they would take minutes (16 MiB at 10 Mbit/s: ~20 s an all-reduce, five times over)
    and add nothing to the fit that a probe of half a second has not. Collective: every rank of
    ``group`` must call it. One rank: returns (0.0, 0.0).

    ``device``: where the probe buffers live (the optimizer's communication device;
    default CPU). On CUDA each timed all-reduce is bracketed by device synchronises, so
    the times are of finished transfers, not of NCCL's launch. One host read per size (set-up).
    """
    import torch
    import torch.distributed as dist

    from .. import comm

    if len(set(sizes)) < 2 or any(int(s) < 1 for s in sizes):
        raise ValueError(f"sizes must hold >= 2 distinct positive byte counts; got {sizes!r}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0; got {repeats}, {warmup}")
    if not max_probe_s >= 0:
        raise ValueError(f"max_probe_s must be >= 0 seconds; got {max_probe_s!r}")
    P = dist.get_world_size(group)
    if P == 1:
        return 0.0, 0.0
    device = torch.device("cpu") if device is None else torch.device(device)
    timed = comm.CommStats()
    timed.sync = device  # comm.clock synchronises a CUDA device before reading the clock
    probed, times = [], []
    for size in sorted({int(s) for s in sizes}):
        buf = torch.zeros(size, dtype=torch.uint8, device=device)
        runs = []
        for i in range(warmup + repeats):
            comm.barrier(group, device)
            t0 = comm.clock(timed)
            comm.all_reduce(buf, group)
            if i >= warmup:
                runs.append(comm.clock(timed) - t0)
        agreed = torch.tensor([sorted(runs)[len(runs) // 2]], dtype=torch.float64).to(device)
        comm.all_reduce(agreed, group, op="max")
        probed.append(size)
        times.append(float(agreed.item()))  # the same on every rank: every rank stops at the same size
        if len(times) >= 2 and times[-1] > max_probe_s:
            break
    return fit_alpha_beta(probed, times, P)
