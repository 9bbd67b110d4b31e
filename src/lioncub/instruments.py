r"""Instruments for choosing a quantizer and a momentum-sync policy (the paper's Figs. 3, 4, 6).

Pure functions on tensors (the reference arithmetic, tested by hand)::

    update_distribution(c)    histogram of c / mean|c|, kurtosis E[z^4] (Gaussian 3, Laplace 6),
                              max|c| / mean|c|                                       (Fig. 3)
    sign_match(cs)            per quantizer and bit width, how the vote sign(Σ_i q(c_i)) compares
                              with the exact vote sign(Σ_i c_i): match / flip / zero rates (Fig. 4)
    tie_rate(cs)              fraction of coordinates with Σ_i sign(c_i) = 0
    momentum_std(ms)          per element std across workers (ddof 0); its max and rms  (Fig. 6)

Live versions take a :class:`~lioncub.LionCub` (its group and momenta) and optionally the
model (for parameter names). They are collectives: every rank calls them at the same
point, after ``backward()`` and before ``step()`` (``c`` needs the gradients). Their
traffic is not added to the optimizer's step accounting. :func:`analyze` runs them all.

=========================  ==========================================  ======================
live function              communication per call                      result
=========================  ==========================================  ======================
``live_distribution``      none (this rank's c)                        all + per layer
``live_tie_rate``          int8 all-reduce of every c                  all + per layer
``live_sign_match``        all-gather of ``max_elements`` sampled c    rows per quantizer
``live_momentum_std``      two float64 all-reduces of every momentum   per layer
=========================  ==========================================  ======================

Results are plain dicts/lists of floats (``json.dumps``-able); the JSON/CSV writers and the
plots of them live outside the core, in :mod:`lioncub.harness.report`.

Example (every rank)::

    loss.backward()
    record = lioncub.instruments.analyze(opt, model)      # before opt.step()
    opt.step()
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import comm
from .lion import interpolate
from .engine.momentum import label_params
from .quantize import quantize
from .validate import check_int
from .votes.api import reference_vote

__all__ = ["update_distribution", "sign_match", "tie_rate", "momentum_std", "update_vectors",
           "live_distribution", "live_tie_rate", "live_sign_match", "live_momentum_std", "analyze"]

DEFAULT_QUANTIZERS = ("sign", "l1", "l0", "linf", "log")
DEFAULT_BITS = (2, 4, 8)
DEFAULT_VOTES = ({"method": "onebit"}, {"method": "pbit"}, {"method": "pbit", "quantizer": "l1"})


# ----------------------------------------------------------------------------- pure
def update_distribution(c: Tensor, *, bins: int = 81, span: float = 10.0) -> dict:
    """Shape of ``c``: histogram of ``c / mean|c|`` on ``[-span, span]`` (outliers counted
    in the end bins), Pearson kurtosis ``E[z^4]`` with ``z = (c - mean)/std``, and
    ``max|c| / mean|c|``."""
    check_int("bins", bins, 1)
    x = c.detach().reshape(-1).double()
    if x.numel() == 0:
        raise ValueError("c is empty")
    mean_abs, max_abs = float(x.abs().mean()), float(x.abs().max())
    std = float(x.std(unbiased=False))
    kurt = float(((x - x.mean()) / std).pow(4).mean()) if std > 0 else float("nan")
    scaled = (x / mean_abs if mean_abs > 0 else x).clamp(-span, span)
    counts = torch.histc(scaled, bins=bins, min=-span, max=span)
    return {"n": x.numel(), "mean_abs": mean_abs, "max_abs": max_abs, "std": std, "kurtosis": kurt,
            "max_over_mean": max_abs / mean_abs if mean_abs > 0 else float("nan"),
            "zero_fraction": float((x == 0).double().mean()),
            "hist_edges": torch.linspace(-span, span, bins + 1).tolist(), "hist_counts": counts.tolist()}


def _rates(u: Tensor, exact: Tensor) -> dict:
    u, exact = u.reshape(-1).long(), exact.reshape(-1).long()
    return {"match": float((u == exact).double().mean()),
            "flip": float((u * exact == -1).double().mean()),
            "zero": float(((u == 0) & (exact != 0)).double().mean()),
            "spurious": float(((u != 0) & (exact == 0)).double().mean())}


def sign_match(cs: list[Tensor], *, quantizers=DEFAULT_QUANTIZERS, bits=DEFAULT_BITS,
               votes=DEFAULT_VOTES, step: int = 0, seed: int = 0) -> list[dict]:
    """Rows ``{name, quantizer, bits, match, flip, zero, spurious, kept}`` comparing a vote with ``sign(Σ c_i)``.

    ``match``: same sign (both 0 counts); ``flip``: opposite signs; ``zero``: the vote is 0
    where the exact vote is not; ``spurious``: the vote moves a coordinate whose exact vote is
    0 (e.g. a 1-bit wire sending ±1 for c = 0); the four sum to 1. ``kept``: per worker, the fraction of coordinates whose
    quantized value keeps the sign of ``c_i`` (mean over workers; None for wire votes). For each quantizer and bit width (``levels = 2**(bits-1)-1``;
    ``sign`` once, as 1 bit) the vote is ``sign(Σ_i quantize(c_i))``. ``votes`` adds what
    LionCub's wire methods return (:func:`~lioncub.votes.api.reference_vote` kwargs, at ``step``).
    Stochastic rounding (``linf``) uses a generator seeded ``seed + i`` for worker ``i``.
    """
    if len(cs) < 1 or any(c.shape != cs[0].shape for c in cs):
        raise ValueError("cs must be a non-empty list of same-shape tensors, one per worker")
    flat = [c.detach().reshape(-1).float() for c in cs]
    exact = torch.sign(sum(c.double() for c in flat))
    rows = []
    for q in quantizers:
        for b in ([1] if q == "sign" else bits):
            gens = [comm.make_generator(flat[0].device, seed + i) for i in range(len(flat))]  # on their device
            kw = {} if q == "sign" else {"bits": b}
            qs = [quantize(c, q, generator=g, **kw).values.long() for c, g in zip(flat, gens)]
            kept = sum(float((torch.sign(x) == torch.sign(c).long()).double().mean()) for x, c in zip(qs, flat))
            rows.append({"name": f"{q}-{b}bit", "quantizer": q, "bits": b,
                         **_rates(torch.sign(sum(qs)), exact), "kept": kept / len(flat)})
    for v in votes:
        gens = [comm.make_generator(flat[0].device, seed + i) for i in range(len(flat))]
        u = reference_vote(flat, step=step, generators=gens, **v)
        label = v["method"] + ("-" + v["quantizer"] if v.get("quantizer") else "")
        rows.append({"name": f"vote:{label}", "quantizer": v.get("quantizer"), "bits": v.get("bits"),
                     **_rates(u, exact), "kept": None})
    return rows


def tie_rate(cs: list[Tensor]) -> float:
    """Fraction of coordinates where the workers' signs cancel: ``Σ_i sign(c_i) = 0``."""
    total = sum(torch.sign(c.detach().reshape(-1)).long() for c in cs)
    return float((total == 0).double().mean())


def momentum_std(ms: list[Tensor]) -> dict:
    """Across-worker std per element (ddof 0): ``max_std`` (the paper's Fig. 6), ``rms_std``,
    ``rms_mean`` (size of the mean momentum) and ``relative = rms_std / rms(m)``."""
    m = torch.stack([x.detach().reshape(-1).double() for x in ms])  # (P, n)
    return _std_summary(m.mean(0), m.var(0, unbiased=False), m.square().mean(0))


def _std_summary(mean: Tensor, var: Tensor, second: Tensor) -> dict:
    std = var.clamp_min(0).sqrt()
    rms_m = float(second.mean().sqrt())
    return {"max_std": float(std.max()), "rms_std": float(var.clamp_min(0).mean().sqrt()),
            "rms_mean": float(mean.square().mean().sqrt()),
            "relative": float(var.clamp_min(0).mean().sqrt()) / rms_m if rms_m > 0 else 0.0}


# ----------------------------------------------------------------------------- live (collective)
def _params(optimizer) -> list[tuple[dict, Tensor]]:
    return [(g, p) for g in optimizer.param_groups for p in g["params"]]


def update_vectors(optimizer) -> list[Tensor]:
    """This rank's ``c = β1·m + (1-β1)·g`` for every parameter (zeros stand in for a missing
    gradient or momentum, as in LionCub). Local; call after ``backward()``, before ``step()``."""
    out = []
    for g, p in _params(optimizer):
        m = optimizer.state[p].get("exp_avg") if p in optimizer.state else None
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        m = m if m is not None else torch.zeros_like(p)
        out.append(interpolate([m], [grad], g["betas"][0], maximize=g.get("maximize", False))[0].detach())
    return out


def _names(optimizer, model) -> list[str]:
    return label_params([p for _, p in _params(optimizer)], model)


def _world(optimizer) -> int:
    return getattr(optimizer, "world_size", dist.get_world_size() if dist.is_initialized() else 1)


def live_distribution(optimizer, model=None, *, bins: int = 81) -> dict:
    """:func:`update_distribution` of this rank's c, whole model (``all``) and per layer (no histogram)."""
    cs = update_vectors(optimizer)
    layers = {}
    for name, c in zip(_names(optimizer, model), cs):
        d = update_distribution(c, bins=1)
        layers[name] = {k: d[k] for k in ("n", "kurtosis", "max_over_mean", "mean_abs")}
    return {"all": update_distribution(torch.cat([c.reshape(-1) for c in cs]), bins=bins), "layers": layers}


def live_tie_rate(optimizer, model=None) -> dict:
    """Exact tie rate of the vote, whole model and per layer: one int8 SUM all-reduce of the
    signs and their absolute values. ``all_zero``: the share of coordinates where every rank's
    c is exactly 0 (e.g. embedding rows no batch used) — ties too, but not disagreements;
    ``ties_nonzero``: the tie rate among the other coordinates."""
    if _world(optimizer) > 127:
        raise ValueError("live_tie_rate sums int8 signs and needs world size <= 127")
    cs = update_vectors(optimizer)
    signs = torch.cat([torch.sign(c.reshape(-1)).to(torch.int8) for c in cs])
    both = torch.cat([signs, signs.abs()])
    if _world(optimizer) > 1:
        comm.all_reduce(both, getattr(optimizer, "group", None))
    n = signs.numel()
    tied, silent = both[:n] == 0, both[n:] == 0
    voiced = int((~silent).sum())
    layers = {n: float(t.double().mean()) for n, t in zip(_names(optimizer, model), tied.split([c.numel() for c in cs]))}
    return {"all": float(tied.double().mean()), "all_zero": float(silent.double().mean()),
            "ties_nonzero": float((tied & ~silent).sum()) / voiced if voiced else 0.0, "layers": layers}


def live_sign_match(optimizer, *, max_elements: int = 65536, seed: int = 0, step: int | None = None, **kw) -> list[dict]:
    """:func:`sign_match` on every rank's c at ``max_elements`` coordinates drawn with a seed
    shared by all ranks (all of them if fewer): one all-gather. Every rank gets the same rows."""
    c = torch.cat([x.reshape(-1).float() for x in update_vectors(optimizer)])
    if c.numel() > max_elements:
        idx = torch.randperm(c.numel(), generator=comm.make_generator(c.device, seed), device=c.device)[:max_elements]
        c = c[idx]
    everyone = comm.all_gather(c, getattr(optimizer, "group", None)) if _world(optimizer) > 1 else c[None]
    step = getattr(optimizer, "steps", 0) if step is None else step
    return sign_match(list(everyone), seed=seed, step=step, **kw)


def live_momentum_std(optimizer, model=None) -> dict:
    """Per layer :func:`momentum_std` across ranks, exact: float64 all-reduce of m, then of (m - m̄)²."""
    group, world = getattr(optimizer, "group", None), _world(optimizer)
    ms = [optimizer.state[p]["exp_avg"] if "exp_avg" in optimizer.state.get(p, {}) else torch.zeros_like(p)
          for _, p in _params(optimizer)]
    m = torch.cat([x.reshape(-1).double() for x in ms])
    mean = m.clone()
    if world > 1:
        comm.all_reduce(mean, group)
    mean.div_(world)
    dev = (m - mean).square_()
    if world > 1:
        comm.all_reduce(dev, group)
    var = dev.div_(world)  # two passes: no cancellation, unlike E[m²] - E[m]²
    second = var + mean.square()
    sizes = [x.numel() for x in ms]
    return {n: _std_summary(a, v, s)
            for n, a, v, s in zip(_names(optimizer, model), mean.split(sizes), var.split(sizes), second.split(sizes))}


def analyze(optimizer, model=None, *, max_elements: int = 65536, seed: int = 0) -> dict:
    """All four live instruments in one record (collective; after backward, before step)."""
    return {"step": getattr(optimizer, "steps", None), "distribution": live_distribution(optimizer, model),
            "tie_rate": live_tie_rate(optimizer, model),
            "sign_match": live_sign_match(optimizer, max_elements=max_elements, seed=seed),
            "momentum_std": live_momentum_std(optimizer, model)}
