"""The one interface every race method implements (:class:`Adapter`).

A method owns the rank's local replica (``module``) and its optimizer(s); the
runner (``bench/race.py``, the tests) only calls::

    loss = method.backward(x, y)   # forward + backward of this rank's batch
    synced = method.step(lr)       # update; True when every replica now holds the same parameters

``synced`` marks the points where the model is the one model all workers agree on:
every step for the data-parallel methods (DDP, Lion Cub), every ``H`` steps for
local SGD and DiLoCo. The runner evaluates and decides to stop only there, so a
local method is judged on the consensus model, never on one worker's drifted copy.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .. import comm

__all__ = ["Adapter", "broadcast_module", "set_lr"]


class Adapter:
    """Base class: ``module`` (the local replica) and the two calls above."""

    name: str = "?"
    family: str = "?"
    """'adamw' or 'lion': which learning-rate grid the method sweeps. A class states its own;
    one whose family depends on its options sets it per instance (:meth:`family_for`)."""
    @property
    def uneven_steps(self) -> bool:
        """Whether the ranks' step counts differ between sync points (an optimizer ``opt`` with
        ``Options(pace='timed')``): a loop then decides only at sync points, never at a step index
        (:class:`lioncub.harness.loop.Loop` refuses ``steps``)."""
        return getattr(getattr(self, "opt", None), "pace", "slowest") == "timed"

    def __init__(self, module: nn.Module, *, group=None):
        self.module = module
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.steps = 0

    @classmethod
    def family_for(cls, **options) -> str:
        """The :attr:`family` of this method built with keyword arguments ``options``, known
        before building it (the runner picks the learning rates first)."""
        return cls.family

    def forward_module(self) -> nn.Module:
        """What ``backward`` runs the batch through (a DDP wrapper where there is one)."""
        return self.module

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        _, loss = self.forward_module()(x, y)
        loss.backward()
        return float(loss.detach())

    def evaluation(self):
        """Context manager around an evaluation at a sync point: the module holds the model the
        ranks agree on inside it. The replicas themselves by default; a streaming method puts its
        agreed start in (and its own values back after)."""
        return contextlib.nullcontext()

    def step(self, lr: float) -> bool:
        """One optimizer step at ``lr``; True when the replicas agree afterwards.

        The default serves methods that synchronise every step (``self.opt`` all-reduces or
        votes inside backward/step); local methods override it.
        """
        set_lr(self.opt, lr)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return True


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


@torch.no_grad()
def broadcast_module(module: nn.Module, group=None) -> None:
    """Start every replica from ``group``'s first rank's parameters (what DDP and LionCub do on
    construction), one broadcast per parameter on its own device."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    for p in module.parameters():
        comm.broadcast(p.data, group, src=0)  # src: a group rank
