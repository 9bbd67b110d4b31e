r"""Local methods: workers train alone for ``H`` steps, then agree on one model.

``local_sgd`` (post-local SGD with AdamW): every rank runs AdamW on its own shard;
after every ``H``-th step the parameters are averaged (one flat fp32 all-reduce, through
PyTorch's ``PeriodicModelAverager``); AdamW's moments stay local.

``DiLoCo`` (Douillard et al. 2023, arXiv 2311.08105), from the paper, on LocalCub's rounds::

    θ_g                      # global parameters, identical on every rank
    repeat:
        θ_i ← θ_g; H steps of AdamW on rank i's shard            # inner loop, no communication
        Δ   = mean_i(θ_g - θ_i)                                  # outer "pseudo-gradient", one fp32 all-reduce
        θ_g ← NesterovSGD(θ_g, Δ; lr=0.7, momentum=0.9)          # outer step, same on every rank

The inner AdamW moments persist across rounds (as in the paper). Both send 32 bits
per element once every ``H`` steps, i.e. 32/H bits per element per step.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from ..validate import check_int
from .base import Adapter, broadcast_module, set_lr
from .cub import LocalCubMethod
from .ddp import BETAS

__all__ = ["LocalSGD", "DiLoCo", "Rounds", "ComputeOnly"]


def check_period(H) -> int:
    """``H``, the steps between synchronisations, an int >= 1."""
    return check_int("H", H, 1, what="steps between synchronisations")


class LocalSGD(Adapter):
    """AdamW on each rank, parameters averaged after every ``H``-th step."""

    family = "adamw"

    def __init__(self, module: nn.Module, *, lr: float, H: int, group=None, weight_decay: float = 0.0):
        super().__init__(module, group=group)
        self.H = check_period(H)
        self.name = f"local-adamw-h{H}"
        broadcast_module(module, group)
        self.opt = torch.optim.AdamW(module.parameters(), lr=lr, betas=BETAS, weight_decay=weight_decay)
        # warmup_steps=H-1: average after steps H, 2H, ... (the averager counts from 0)
        self.averager = PeriodicModelAverager(period=H, warmup_steps=H - 1,
                                              process_group=group if group is not None else dist.group.WORLD)

    def step(self, lr: float) -> bool:
        set_lr(self.opt, lr)
        self.opt.step()
        self.steps += 1
        if self.world > 1:  # before zero_grad: the averager skips parameters whose grad is None
            self.averager.average_parameters(self.module.parameters())
        self.opt.zero_grad(set_to_none=True)
        return self.steps % self.H == 0


class ComputeOnly(Adapter):
    """AdamW on each rank and no communication at all: a race's compute-bound step rate, measured as every other
    row is (the same loop, host and budget, in the same invocation). ``step`` returns True every ``H`` steps only
    so that the loop agrees on the clock there (8 bytes); the replicas never agree, so the row's loss is no
    method's: it is the denominator of the others' step rates."""

    family = "adamw"

    def __init__(self, module: nn.Module, *, lr: float, H: int = 50, group=None, weight_decay: float = 0.0):
        super().__init__(module, group=group)
        self.H = check_period(H)
        broadcast_module(module, group)
        self.opt = torch.optim.AdamW(module.parameters(), lr=lr, betas=BETAS, weight_decay=weight_decay)

    def step(self, lr: float) -> bool:
        super().step(lr)  # (the every-step default: set the lr, step, clear the gradients, count)
        return self.steps % self.H == 0


class Rounds(Adapter):
    """A round: ``H`` steps of ``self.inner`` alone, then ``self.outer_step()`` (which makes the replicas agree)."""

    H: int
    inner: torch.optim.Optimizer

    def step(self, lr: float) -> bool:
        set_lr(self.inner, lr)
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.steps += 1
        if self.steps % self.H:
            return False
        self.outer_step()
        return True

    def outer_step(self) -> None:
        raise NotImplementedError


def _inner_adamw(groups: list[dict], *, weight_decay: float) -> torch.optim.AdamW:
    """DiLoCo's inner optimizer: AdamW with the weight decay inside it (as in the paper)."""
    return torch.optim.AdamW([dict(g, weight_decay=weight_decay) for g in groups], betas=BETAS)


class DiLoCo(LocalCubMethod):
    """Inner AdamW for ``H`` steps, outer Nesterov step on the averaged pseudo-gradient.

    It runs on :class:`~lioncub.LocalCub`'s round loop: ``vote='grad'`` (the fp32 mean of
    Δ, one all-reduce), ``outer='nesterov'`` (PyTorch's ``SGD(nesterov=True)`` rule, the
    same arithmetic op for op: tests/test_baselines.py compares the two bit for bit), and
    the inner AdamW with the weight decay inside it, as the paper has it. ``delay=1`` is
    Streaming DiLoCo's overlap: the fp32 exchange of round k in flight during round k+1, its
    outer step applied one round late (LocalCub's streaming rounds, docs/local_steps.md); the
    name becomes ``streaming-diloco-h<H>``. ``fragments=F`` adds Streaming DiLoCo's fragments (LocalCub's
    ``fragments``: a slice of the model per sub-round, staggered every H/F steps, each outer step applied H/F
    steps after its launch; ``-f<F>`` in the name). Where the paper mixes the received fragment with the local one
    (θ ← α·θ_local + (1−α)·θ_global), LocalCub carries the worker's progress since the launch onto the agreed
    start (α-free); the values travel in fp32, not the paper's 4-bit floats."""

    family = "adamw"

    @classmethod
    def family_for(cls, **options) -> str:
        return cls.family

    def __init__(self, module: nn.Module, *, lr: float, H: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, delay: int = 0, fragments: int = 1, group=None,
                 weight_decay: float = 0.0):
        super().__init__(module, lr=lr, H=check_period(H), vote="grad", outer="nesterov", outer_lr=outer_lr,
                         outer_momentum=outer_momentum, inner=partial(_inner_adamw, weight_decay=weight_decay),
                         delay=delay, fragments=fragments, group=group)
        self.H = H
        self.name = ("streaming-" if delay else "") + f"diloco-h{H}" + (f"-f{fragments}" if fragments > 1 else "")
