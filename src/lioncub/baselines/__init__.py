"""What users would pick instead of Lion Cub, behind one interface (issue 9).

Harness-level adapters, kept out of the library core: each is a short wrapper around
what PyTorch provides (DDP, its comm hooks, ``PeriodicModelAverager``) or, for DiLoCo,
our own few lines. ``build(name, module, lr=...)`` makes one; see :class:`Adapter`.

    name                    what travels, per element per step      replicas identical
    adamw-ddp               fp32 gradients (DDP)                     every step
    adamw-bf16              bf16 gradients (DDP bf16 hook)           every step
    adamw-psgd-r1 / -r4     PowerSGD rank-1 / rank-4 factors         every step
    local-adamw-h10         fp32 parameters every 10 steps           after each average
    diloco-h10 / -h50       fp32 pseudo-gradient every H steps       after each outer step
    lion-ddp                fp32 gradients (DDP), then Lion          every step
    lioncub-pbit4           4-bit lanes of signs (LionCub)           every step
    lioncub-onebit          1-bit all_to_all + all_gather            every step
    ...-overlap             the same vote launched during backward   every step

Example (every rank, inside an initialised gloo group)::

    method = build("diloco-h10", GPT(cfg), lr=1e-3)
    for x, y in batches:
        method.backward(x, y)
        if method.step(lr=1e-3):   # True: replicas agree now
            evaluate(method.module)
"""
from __future__ import annotations

from functools import partial

from torch import nn

from . import cub, ddp, local
from .base import Adapter

__all__ = ["Adapter", "METHODS", "build", "family"]

# name -> builder(module, *, lr, group, weight_decay) -> Adapter
METHODS = {
    "adamw-ddp": partial(ddp.adamw, compress="fp32"),
    "adamw-bf16": partial(ddp.adamw, compress="bf16"),
    "adamw-psgd-r1": partial(ddp.adamw, compress="powersgd", rank=1),
    "adamw-psgd-r4": partial(ddp.adamw, compress="powersgd", rank=4),
    "local-adamw-h10": partial(local.LocalSGD, H=10),
    "diloco-h10": partial(local.DiLoCo, H=10),
    "diloco-h50": partial(local.DiLoCo, H=50),
    "lion-ddp": ddp.lion,
    "lioncub-pbit4": partial(cub.CubMethod, vote="pbit", bits=4),
    "lioncub-pbit4-overlap": partial(cub.CubMethod, vote="pbit", bits=4, overlap=True, bucket_mb=2.0),
    "lioncub-onebit": partial(cub.CubMethod, vote="onebit", bits=None),
    "lioncub-onebit-overlap": partial(cub.CubMethod, vote="onebit", bits=None, overlap=True, bucket_mb=2.0),
}


def family(name: str) -> str:
    """'adamw' or 'lion': the learning-rate grid a method is swept over."""
    _check(name)
    return "lion" if name.startswith(("lion-", "lioncub-")) else "adamw"


def build(name: str, module: nn.Module, *, lr: float, group=None, weight_decay: float = 0.0) -> Adapter:
    """The method ``name`` (one of ``METHODS``) training ``module`` on this rank."""
    _check(name)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    method = METHODS[name](module, lr=lr, group=group, weight_decay=weight_decay)
    method.name, method.family = name, family(name)
    return method


def _check(name: str) -> None:
    if name not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {name!r}")
