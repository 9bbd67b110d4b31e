r"""The outer rules of :class:`~lioncub.LocalCub`: how the agreed update moves the round's start.

A round ends with the same agreed ``d`` on every rank (the vote ``u``, or a mean of the ranks'
pseudo-gradients); an outer rule turns it into the new start :math:`\theta_s`. Each rule is a
small object (its hyper-parameters) with a per-parameter state it creates, so a new rule is one
class here plus one entry in :data:`OUTER_RULES`; :class:`~lioncub.LocalCub` applies the
decoupled weight decay before the rule and copies the new start into the replica after it.

With α = ``outer_lr`` and η the group's lr (``signed``: ``d`` holds the vote u, the step is η·u;
else ``d`` is already in parameter units)::

    sgd       θ_s ← θ_s − α·d'                                     d' = η·u or d
    nesterov  b ← μ·b + d';  θ_s ← θ_s − α·(d' + μ·b)               μ = momentum
    lion      c = β1·M + (1−β1)·d';  θ_s ← θ_s − α·η·sign(c);  M ← β2·M + (1−β2)·d'
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from ..validate import check_fraction, check_hyperparameters, check_number

__all__ = ["OuterRule", "OuterSGD", "OuterNesterov", "OuterLion", "OUTER_RULES", "make_outer"]


class OuterRule:
    """One outer rule: ``lr`` is α (dimensionless); :meth:`init_state` adds the rule's
    per-parameter tensors to a parameter's optimizer state; :meth:`step` moves ``start``."""

    name: ClassVar[str]
    state_keys: ClassVar[tuple[str, ...]] = ()
    """The per-parameter state entries the rule keeps (fp32, the parameter's shape)."""

    def __init__(self, lr: float):
        self.lr = check_number("outer_lr", lr)

    @classmethod
    def from_args(cls, lr: float, momentum: float, betas: tuple[float, float]) -> "OuterRule":
        """The rule from :class:`~lioncub.LocalCub`'s arguments (each rule takes what it uses)."""
        return cls(lr)

    def init_state(self, p: Tensor, state: dict, **where) -> None:
        """Zeros for each of :attr:`state_keys` in ``state``, shaped as ``p``; ``where``: ``zeros_like``'s
        ``device`` and ``pin_memory`` when the state lives elsewhere than ``p`` (LocalCub's ``outer_state``)."""
        for key in self.state_keys:
            state[key] = torch.zeros_like(p, dtype=torch.float32, **where)

    def step(self, start: Tensor, d: Tensor, state: dict, *, lr: float, signed: bool) -> None:
        """``start`` ← the rule's update by ``d`` (in place); ``lr``: the group's η."""
        raise NotImplementedError


class OuterSGD(OuterRule):
    name = "sgd"

    def step(self, start, d, state, *, lr, signed):
        # signed with α = 1: exactly LionCub's p.add_(u, alpha=-lr)
        start.add_(d, alpha=-self.lr * lr if signed else -self.lr)


class OuterNesterov(OuterRule):
    name = "nesterov"
    state_keys = ("outer_m",)

    def __init__(self, lr: float, momentum: float = 0.9):
        super().__init__(lr)
        self.momentum = check_fraction("outer_momentum", momentum)

    @classmethod
    def from_args(cls, lr, momentum, betas):
        return cls(lr, momentum)

    def step(self, start, d, state, *, lr, signed):
        d = d * lr if signed else d
        mu, b = self.momentum, state["outer_m"]
        b.mul_(mu).add_(d)
        start.add_(d.add(b, alpha=mu), alpha=-self.lr)


class OuterLion(OuterRule):
    name = "lion"
    state_keys = ("outer_m",)

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.99)):
        super().__init__(lr)
        check_hyperparameters(1.0, betas, 0.0)
        self.betas = (float(betas[0]), float(betas[1]))

    @classmethod
    def from_args(cls, lr, momentum, betas):
        return cls(lr, betas)

    def step(self, start, d, state, *, lr, signed):
        d = d * lr if signed else d
        b1, b2 = self.betas
        m = state["outer_m"]
        c = m.mul(b1).add_(d, alpha=1 - b1)
        start.add_(c.sign_(), alpha=-self.lr * lr)
        m.mul_(b2).add_(d, alpha=1 - b2)


OUTER_RULES: dict[str, type[OuterRule]] = {cls.name: cls for cls in (OuterSGD, OuterNesterov, OuterLion)}
"""The registry: ``outer=`` names a rule here."""


def make_outer(name: str, *, lr: float, momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.99)) -> OuterRule:
    """The rule ``name`` with its hyper-parameters. Every hyper-parameter is checked whatever
    the rule (a bad value is a typo even where the rule ignores it)."""
    cls = OUTER_RULES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"outer must be one of {tuple(OUTER_RULES)}, got {name!r}")
    check_fraction("outer_momentum", momentum)
    check_hyperparameters(1.0, betas, 0.0)
    return cls.from_args(lr, momentum, betas)
