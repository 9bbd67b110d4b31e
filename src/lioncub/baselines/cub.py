"""Lion Cub as a race method: :class:`lioncub.LionCub` with a compressed vote.

``vote``/``bits`` pick the vote (default: 4-bit packed lanes, the paper's "4-bit Lion
Cub"); ``overlap=True`` launches each bucket's vote from backward hooks
(:mod:`lioncub.engine.overlap`), with buckets of ``bucket_mb`` MiB so that there is more than
one bucket to overlap. Replicas stay identical after every step (every rank applies
the same voted sign); momenta stay local.
"""
from __future__ import annotations

from torch import nn

from .. import votes
from ..optim.lioncub import LionCub
from ..optim.localcub import LocalCub
from ..optim.flags import round_kwargs, step_kwargs
from .base import Adapter, set_lr
from .ddp import BETAS

__all__ = ["CubMethod", "LocalCubMethod"]


class CubMethod(Adapter):
    family = "lion"

    def __init__(self, module: nn.Module, *, lr: float, vote: str = "pbit", bits: int | None = 4,
                 overlap: bool = False, bucket_mb: float = 25.0, group=None, weight_decay: float = 0.0):
        super().__init__(module, group=group)
        method = votes.METHODS.get(vote)  # None: 'grad' or 'auto', which LionCub checks itself
        lanes = method is not None and bool(method.LANE_BITS)  # bits go only to a vote with lanes
        kw = dict(bits=bits) if lanes else {}
        self.opt = LionCub(module.parameters(), lr=lr, betas=BETAS, weight_decay=weight_decay, **step_kwargs(dict(
            vote=vote, overlap=overlap, bucket_mb=bucket_mb, process_group=group, model=module, **kw)))
        self.name = f"lioncub-{vote}{bits if lanes else ''}" + ("-overlap" if overlap else "")


class LocalCubMethod(Adapter):
    """:class:`lioncub.LocalCub`: ``H`` inner steps alone, then one voted outer step.
    ``synced`` only at the end of a round (replicas identical there). Its family is its inner
    optimizer, ``'lion'`` or ``'adamw'``."""

    @classmethod
    def family_for(cls, *, inner: str = "lion", **options) -> str:
        return inner

    def __init__(self, module: nn.Module, *, lr: float, H: int, vote: str = "onebit", bits: int | None = None,
                 quantizer: str | None = None, outer: str = "nesterov", outer_lr: float = 1.0,
                 outer_momentum: float = 0.9, error_feedback: bool = False, aggregate: str = "vote",
                 inner="lion", delay: int = 0, fragments: int = 1, group=None, weight_decay: float = 0.0,
                 min_local_steps: int | None = None, eager: bool = False, pace: str | None = None):
        super().__init__(module, group=group)
        self.family = self.family_for(inner=inner)
        self.opt = LocalCub(module.parameters(), lr=lr, betas=BETAS, weight_decay=weight_decay, **round_kwargs(dict(
            local_steps=H, inner=inner, vote=vote, bits=bits, quantizer=quantizer, outer=outer, outer_lr=outer_lr,
            outer_momentum=outer_momentum, error_feedback=error_feedback, delay=delay, fragments=fragments,
            aggregate=aggregate, process_group=group, model=module, eager=eager,
            **({"min_local_steps": min_local_steps} if min_local_steps is not None else {}),
            **({"pace": pace} if pace is not None else {}))))

    def step(self, lr: float) -> bool:
        set_lr(self.opt, lr)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return self.opt.synced

    def evaluation(self):
        """The agreed start θ_s in the module (the same on every rank; with ``delay=1`` each
        replica otherwise holds θ_s plus its own round in flight)."""
        return self.opt.agreed()
