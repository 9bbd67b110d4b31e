"""What users would pick instead of Lion Cub, behind one interface (issue 9).

Harness-level adapters, kept out of the library core: each is a short wrapper around
what PyTorch provides (DDP, its comm hooks, ``PeriodicModelAverager``) or, for DiLoCo,
SparseLoCo and DeMo, our own lines written from their papers. ``build(name, module, lr=...)``
makes one; see :class:`Adapter`.

    name                    what travels, per element per step      replicas identical
    adamw-ddp               fp32 gradients (DDP)                     every step
    adamw-bf16              bf16 gradients (DDP bf16 hook)           every step
    adamw-psgd-r1 / -r4     PowerSGD rank-1 / rank-4 factors         every step
    local-adamw-h10         fp32 parameters every 10 steps           after each average
    compute-adamw-h50       nothing (the loop's clock every 50       never: the race's compute-bound
                            steps, 8 bytes)                          step rate, not a method
    diloco-h10 / -h50       fp32 pseudo-gradient every H steps       after each outer step
    sparseloco-h10 / -h50   top-1.56% of an error-fed Δ per 4096-    after each outer step
                            chunk, 2-bit values + int16 indices
                            (all_gather) every H steps: 0.289/H bits
    demo                    DeMo: top-4 of 64 DCT components of the  every step
                            local momentum, fp32 + uint8 index
                            (all_gather), sign applied: 2.5 bits
    lion-ddp                fp32 gradients (DDP), then Lion          every step
    lioncub-pbit4           4-bit lanes of signs (LionCub)           every step
    lioncub-onebit          1-bit all_to_all + all_gather            every step
    ...-overlap             the same vote launched during backward   every step
    lcub-<vote>-h<H>-<outer><lr>[-ef][-adamw]
                            LocalCub: H inner steps (Lion; AdamW      after each outer step
                            with -adamw), then one vote on Δ (+e with
                            -ef); vote: onebit, gather, pbit4, pbit8l1,
                            grad, mean4/mean8 (lane sums as a quantized
                            mean), smean1/2/4/8 (the scatter mean in 1-8
                            bits, with -ef); outer: sgd, nest(erov), lion with
                            outer_lr <lr>, e.g. lcub-onebit-h10-nest2-ef;
                            H = auto: from the measured link,
                            auto50: the same, never below 50

Example (every rank, inside an initialised gloo group)::

    method = build("diloco-h10", GPT(cfg), lr=1e-3)
    for x, y in batches:
        method.backward(x, y)
        if method.step(lr=1e-3):   # True: replicas agree now
            evaluate(method.module)
"""
from __future__ import annotations

import re
from functools import partial

from torch import nn

from . import cub, ddp, demo, local, sparseloco
from .base import Adapter

__all__ = ["Adapter", "METHODS", "build", "family", "options"]

# name -> builder(module, *, lr, group, weight_decay) -> Adapter: an Adapter class, or a partial of one
METHODS = {
    "adamw-ddp": partial(ddp.AdamWDDP, compress="fp32"),
    "adamw-bf16": partial(ddp.AdamWDDP, compress="bf16"),
    "adamw-psgd-r1": partial(ddp.AdamWDDP, compress="powersgd", rank=1),
    "adamw-psgd-r4": partial(ddp.AdamWDDP, compress="powersgd", rank=4),
    "local-adamw-h10": partial(local.LocalSGD, H=10),
    "compute-adamw-h50": partial(local.ComputeOnly, H=50),  # no communication: the compute-bound step rate
    "diloco-h10": partial(local.DiLoCo, H=10),
    "diloco-h50": partial(local.DiLoCo, H=50),
    # Streaming DiLoCo's overlap (the fp32 exchange in flight during the next round), as LocalCub(delay=1)
    "streaming-diloco-h50": partial(local.DiLoCo, H=50, delay=1),
    "streaming-diloco-h200": partial(local.DiLoCo, H=200, delay=1),
    # with Streaming DiLoCo's fragments: F of them, one every 50/F steps, each applied 50/F steps after its launch
    "streaming-diloco-h50-f5": partial(local.DiLoCo, H=50, delay=1, fragments=5),
    "streaming-diloco-h50-f10": partial(local.DiLoCo, H=50, delay=1, fragments=10),
    "sparseloco-h10": partial(sparseloco.SparseLoCo, H=10),
    "sparseloco-h50": partial(sparseloco.SparseLoCo, H=50),
    "demo": demo.DeMo,
    "lion-ddp": ddp.LionDDP,
    "lioncub-pbit4": partial(cub.CubMethod, vote="pbit", bits=4),
    "lioncub-pbit4-overlap": partial(cub.CubMethod, vote="pbit", bits=4, overlap=True, bucket_mb=2.0),
    "lioncub-onebit": partial(cub.CubMethod, vote="onebit", bits=None),
    "lioncub-onebit-overlap": partial(cub.CubMethod, vote="onebit", bits=None, overlap=True, bucket_mb=2.0),
}


# lcub-<vote>-h<H>-<outer><outer_lr>[-ef][-adamw][-stream]: a LocalCub configuration by name (H: an int, or
# auto: local_steps='auto', H from the measured link; auto<N>: the same, never below N, min_local_steps=N)
# (-stream: delay=1, the round's agreement in flight during the next round; -stream-f<F>: in F fragments;
# -eager after either: eager=True, the outer step by the worker's own Δ standing in while the agreement flies)
# (-timed, last: Options(pace='timed'), each rank's own steps in the round's time, its Δ weighted by them)
_LOCAL = re.compile(r"lcub-(onebit|gather|pbit4|pbit8l1|mean4|mean8|smean1|smean2|smean4|smean8|grad)-h(\d+|auto\d*)-(sgd|nest|lion)(\d+(?:\.\d+)?)(-ef)?(-adamw)?"
                    r"(-stream(?:-f(\d+))?(-eager)?)?(-timed)?")
_LOCAL_VOTES = {"onebit": dict(vote="onebit"), "gather": dict(vote="gather"), "pbit4": dict(vote="pbit", bits=4),
                "pbit8l1": dict(vote="pbit", bits=8, quantizer="l1"), "grad": dict(vote="grad"),
                # the lanes' sums as a quantized mean of Δ (aggregate='mean'), 4- or 8-bit lanes
                "mean4": dict(vote="pbit", bits=4, quantizer="l1", aggregate="mean"),
                "mean8": dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean"),
                # the scatter mean: Δ's mean in 1-8 bits on onebit's all-to-all and all-gather (needs -ef)
                **{f"smean{b}": dict(vote="onebit", aggregate="mean", bits=b) for b in (1, 2, 4, 8)}}


def _local_builder(name: str):
    m = _LOCAL.fullmatch(name)
    if m is None:
        return None
    vote, H, outer, outer_lr, ef, adamw, stream, fragments, eager, timed = m.groups()
    floor = {"min_local_steps": int(H[4:])} if H.startswith("auto") and H != "auto" else {}
    return partial(cub.LocalCubMethod, H="auto" if H.startswith("auto") else int(H), **floor, outer={"nest": "nesterov"}.get(outer, outer),
                   outer_lr=float(outer_lr), error_feedback=ef is not None, inner="adamw" if adamw else "lion",
                   delay=1 if stream else 0, **({"fragments": int(fragments)} if fragments else {}),
                   **({"eager": True} if eager else {}), **({"pace": "timed"} if timed else {}), **_LOCAL_VOTES[vote])


def options(name: str) -> tuple[type, dict]:
    """(the adapter class, the keyword arguments) method ``name`` stands for, without building it:
    e.g. ``(CubMethod, {'vote': 'onebit', 'bits': None})`` for ``lioncub-onebit``."""
    builder = _builder(name)
    return (builder.func, dict(builder.keywords)) if isinstance(builder, partial) else (builder, {})


def family(name: str) -> str:
    """'adamw' or 'lion': the learning-rate grid method ``name`` is swept over, as its adapter
    class states it for the options the name stands for (:meth:`Adapter.family_for`; nothing
    is built). ``build(name, ...).family`` is the same."""
    cls, kw = options(name)
    return cls.family_for(**kw)


def build(name: str, module: nn.Module, *, lr: float, group=None, weight_decay: float = 0.0) -> Adapter:
    """The method ``name`` (one of ``METHODS``) training ``module`` on this rank."""
    builder = _builder(name)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    method = builder(module, lr=lr, group=group, weight_decay=weight_decay)
    method.name = name
    return method


def _builder(name: str):
    """The registry entry of ``name``, or the LocalCub configuration it spells; ValueError otherwise."""
    builder = METHODS.get(name) or _local_builder(name)
    if builder is None:
        raise ValueError(f"method must be one of {', '.join(METHODS)} or lcub-<vote>-h<H>-<outer><lr>[-ef][-adamw][-stream[-f<F>][-eager]][-timed]; "
                         f"got {name!r}")
    return builder
