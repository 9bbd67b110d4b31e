r"""``vote='auto'``: pick the cheapest exact vote for this world size and network (docs/design.md §6).

For a step that votes on buckets of ``n_b`` elements, each candidate ``(method, bits)``
costs::

    T(method) = Σ_b [ comm(method, n_b, P; α, β)  +  γ(method, P) · n_b ]

where ``comm`` is the ring α-β time of :func:`lioncub.engine.cost.predicted_time` (γ = 0) and
``γ(method, P) = a + b·P`` seconds per element is the local work the vote does on one
rank: quantize + pack before the collective, unpack + count + decide after it. The
``b·P`` term is ``gather``'s: every rank unpacks and counts all P ranks' bits.

The default constants (:data:`DEFAULT_GAMMA`) were measured with
``bench/step_time.py`` (4 gloo workers, 1 thread each, on a 2-core host, 28.7M
parameters, fp32, with the fused loops of :mod:`lioncub.fused`; the 1 Gbit/s runs of
bench/results/step_time_rerun1.json, step_time_rerun2.json and step_time_rerun3.json): the
per-step ``t_quantize_pack + t_unpack_vote`` of each method divided by the elements
voted, the median of the three runs (each run has all methods, so their ratios are
comparable; run to run one method's figure moves by up to ±40%). 2 workers share each
core: a dedicated core is ~2x faster; without a C compiler the torch path is 3-10x slower.
They are host-specific; pass
``gamma={...}`` (same keys) to use your own, e.g. from your own run of the bench.
Only binary-sign votes are candidates: multi-level quantizers change the algorithm,
not only its cost, so ``auto`` never picks one.

Example::

    >>> from lioncub.engine.auto import choose_vote
    >>> choose_vote([25_000_000], 4, alpha=1e-4, beta=1e-9)       # 1 Gbit/s
    ('onebit', None)
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from .. import votes
from .cost import method_valid, predicted_time

__all__ = ["AUTO_CANDIDATES", "DEFAULT_GAMMA", "gamma_for", "vote_costs", "choose_vote", "agree_on_vote",
           "check_auto_args"]

AUTO_CANDIDATES = votes.AUTO_CANDIDATES
"""Methods ``auto`` considers (those with an ``auto_rank``), in tie-break order (the earlier wins a tie)."""

DEFAULT_GAMMA: dict[str, tuple[float, float]] = {name: votes.METHODS[name].gamma for name in AUTO_CANDIDATES}
"""method: (a, b) -> gamma = a + b·P seconds per element on one rank (each method's ``gamma``)."""


def check_auto_args(vote: str, alpha, beta, gamma) -> None:
    """An optimizer's check of ``alpha`` / ``beta`` / ``gamma``: for ``vote='auto'`` only,
    and ``alpha`` with ``beta`` (a known link) or neither (measured by calibration)."""
    if vote != "auto" and (alpha is not None or beta is not None or gamma is not None):
        raise ValueError(f"alpha, beta and gamma apply to vote='auto' only, got vote={vote!r}")
    if (alpha is None) != (beta is None):
        raise ValueError("give both alpha and beta (skips the probe), or neither (calibrate)")


def gamma_for(method: str, world_size: int, gamma: Mapping | None = None) -> float:
    """Seconds per element of ``method``'s local work on ``world_size`` ranks.

    ``gamma`` overrides :data:`DEFAULT_GAMMA` per method with a number (per element)
    or an ``(a, b)`` pair (``a + b·P``).
    """
    table = dict(DEFAULT_GAMMA)
    if gamma is not None:
        unknown = set(gamma) - set(AUTO_CANDIDATES)
        if unknown:
            raise ValueError(f"gamma keys must be among {AUTO_CANDIDATES}; got {sorted(unknown)}")
        table.update(gamma)
    value = table[method]
    a, b = (value, 0.0) if isinstance(value, (int, float)) else value
    g = a + b * world_size
    if not (math.isfinite(g) and a >= 0 and b >= 0):
        raise ValueError(f"gamma for {method!r} must be finite and >= 0; got {value!r}")
    return float(g)


def _bits(method: str, world_size: int) -> int | None:
    """The ``bits`` a candidate runs with by default (its lane width; None without lanes)."""
    return votes.make(method, world_size).option_bits


def vote_costs(bucket_sizes: Sequence[int], world_size: int, alpha: float, beta: float, *,
               gamma: Mapping | None = None,
               candidates: Sequence[str] = AUTO_CANDIDATES) -> dict[tuple[str, int | None], dict]:
    """Predicted per-step seconds of every valid candidate: ``{(method, bits): {...}}``.

    Each value holds ``comm_s`` (α-β time), ``local_s`` (γ·n) and ``total_s``.
    """
    sizes = [int(n) for n in bucket_sizes]
    if any(n < 0 for n in sizes):
        raise ValueError(f"bucket_sizes must be >= 0; got {bucket_sizes!r}")
    out = {}
    for method in candidates:
        if method not in AUTO_CANDIDATES:
            raise ValueError(f"candidates must be among {AUTO_CANDIDATES}; got {method!r}")
        if not method_valid(method, world_size):
            continue
        bits = _bits(method, world_size)
        comm = sum(predicted_time(method, n, world_size, alpha, beta, bits=bits) for n in sizes)
        local = 0.0 if world_size == 1 else gamma_for(method, world_size, gamma) * sum(sizes)
        out[(method, bits)] = {"comm_s": comm, "local_s": local, "total_s": comm + local}
    return out


def choose_vote(bucket_sizes: Sequence[int], world_size: int, alpha: float, beta: float, *,
                gamma: Mapping | None = None,
                candidates: Sequence[str] = AUTO_CANDIDATES) -> tuple[str, int | None]:
    """The cheapest valid ``(method, bits)`` for one step over ``bucket_sizes``.

    Deterministic in its arguments, so ranks that agree on (α, β) agree on the
    method. Ties (e.g. one rank, where nothing travels) go to the earlier candidate.
    """
    costs = vote_costs(bucket_sizes, world_size, alpha, beta, gamma=gamma, candidates=candidates)
    if not costs:
        raise ValueError(f"no candidate in {tuple(candidates)} is valid for world_size={world_size}")
    best = min(costs.values(), key=lambda c: c["total_s"])["total_s"]
    return next(k for k, c in costs.items() if c["total_s"] == best)


def agree_on_vote(bucket_sizes: Sequence[int], world_size: int, group, alpha, beta, *,
                  gamma: Mapping | None = None, device=None) -> tuple[str, int | None, tuple[float, float]]:
    """:func:`choose_vote` on every rank, with (α, β) measured by :func:`lioncub.engine.cost.calibrate`
    when both are None; rank 0's pick is broadcast, so every rank runs the same method even
    if their inputs differ. ``device``: the optimizer's communication device (the probe's
    and the broadcast's tensors live there; default CPU). Returns ``(method, bits, (alpha,
    beta))``. Collective; set-up only (one host read)."""
    import torch

    from .cost import calibrate

    device = torch.device("cpu") if device is None else torch.device(device)
    if alpha is None:
        alpha, beta = (0.0, 0.0) if world_size == 1 else calibrate(group, device=device)
    method, bits = choose_vote(bucket_sizes, world_size, alpha, beta, gamma=gamma)
    if world_size > 1:
        method, bits = first_pick(method, world_size, group, device)
    return method, bits, (float(alpha), float(beta))


def first_pick(method: str, world_size: int, group, device) -> tuple[str, int | None]:
    """The pick of ``group``'s first rank, on every rank of ``group`` (one int64 broadcast on ``device``, one
    host read; set-up only): ``(method, bits)``, the bits valid for ``world_size`` voters. NodeCub runs it
    over the whole world after each cross-node group's own pick, so that the ranks of one node, whose
    groups timed their links apart, run one method."""
    import torch

    from .. import comm

    pick = torch.tensor([AUTO_CANDIDATES.index(method)], dtype=torch.int64).to(device)
    comm.broadcast(pick, group)
    method = AUTO_CANDIDATES[int(pick.item())]
    return method, _bits(method, world_size)
