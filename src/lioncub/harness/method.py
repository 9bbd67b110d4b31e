"""The harness's one optimizer factory (``make_optimizer``) and the method the loop drives (``make_method``).

``make_optimizer(config, groups, model)`` builds what ``config`` names: ``LionCub`` (every step),
``LocalCub`` (``local_steps > 1``), ``NodeCub`` (``nodes > 1``), or plain ``Lion`` / ``AdamW`` after
an fp32 gradient all-reduce that :class:`OptimizerMethod` does (what DDP computes). ``lioncub train``,
the convergence study (bench/study.py) and the race's Lion Cub rows (bench/race.py) all build theirs
here, so a figure is what a user's run with the same settings does.

:class:`OptimizerMethod` puts such an optimizer behind the calls of :class:`lioncub.baselines.Adapter`
(``backward``, ``step(lr) -> synced``, ``evaluation()``) for :class:`~lioncub.harness.loop.Loop`.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import Lion, LionCub, LocalCub, comm, node_groups, votes
from ..optim.nodecub import NodeCub
from ..baselines.base import Adapter
from .config import TrainConfig, library_arguments

__all__ = ["vote_method", "lane_options", "make_optimizer", "OptimizerMethod", "make_method", "batch_loss"]


def vote_method(config: TrainConfig):
    """The class of the run's vote method (:func:`lioncub.votes.lookup`), or None: no vote method
    (``--optimizer lion|adamw``, ``--vote grad`` or ``auto``)."""
    if config.optimizer != "lioncub" or config.vote not in votes.METHODS:
        return None
    return votes.lookup(config.vote)


def lane_options(config: TrainConfig) -> dict:
    """The ``bits`` / ``quantizer`` arguments the run's vote method takes (its ``LANE_BITS`` /
    ``TAKES_QUANTIZER``), as the engine's flat settings (the fault-tolerant harness's)."""
    method = vote_method(config)
    out = {}
    if method is not None and (method.LANE_BITS or config.round_bits is not None):  # lanes, or the scatter mean's codes
        out["bits"] = config.bits
    if method is not None and method.TAKES_QUANTIZER:
        out["quantizer"] = config.quantizer
    return out


def make_optimizer(config: TrainConfig, groups: list[dict], model=None):
    """lioncub -> LocalCub with local steps, the node layout's optimizer with nodes, else LionCub, each from
    :func:`~lioncub.harness.config.library_arguments`; lion -> Lion; adamw -> AdamW (the last two step on
    gradients :class:`OptimizerMethod` has all-reduced).

    ``model`` lets LionCub name parameters in its errors and find the ``io`` layers."""
    if config.optimizer == "lioncub":
        kind, kwargs = library_arguments(config)
        if kind == "localcub":
            return LocalCub(groups, lr=config.lr, betas=config.betas, model=model, **kwargs)
        if kind == "nodecub":
            layout = node_groups(dist.get_world_size() // config.nodes)
            return NodeCub(groups, lr=config.lr, betas=config.betas, layout=layout, model=model, **kwargs)
        return LionCub(groups, lr=config.lr, betas=config.betas, model=model, **kwargs)
    if config.optimizer == "lion":
        return Lion(groups, lr=config.lr, betas=config.betas)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)


def batch_loss(model, x, y, is_gpt: bool):
    """(loss, correct count) of one batch: the GPT's own loss (correct: None), or an image model's
    cross-entropy in fp32 and how many of its arg-max predictions hit."""
    if is_gpt:
        return model(x, y)[1], None
    logits = model(x)
    return F.cross_entropy(logits.float(), y), (logits.argmax(-1) == y).sum()


def _allreduce_grads(params: list[torch.Tensor], world: int) -> tuple[float, float]:
    """Average gradients with one fp32 SUM allreduce (on the gradients' device); returns
    (seconds, ring-model bytes sent)."""
    grads = [p.grad for p in params if p.grad is not None]
    t0 = time.perf_counter()
    flat = torch.cat([g.reshape(-1) for g in grads]).float()
    comm.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return time.perf_counter() - t0, 2 * (world - 1) / world * flat.numel() * 4


class OptimizerMethod(Adapter):
    """An optimizer of :func:`make_optimizer` as a loop's method.

    ``step(lr)`` sets each group's lr to ``lr`` times its share of the peak (``config.lr``; exactly ``lr``
    for a group at the peak), all-reduces the gradients first where the optimizer does not communicate
    (``lion``, ``adamw``), steps, and clears the gradients. Synced: every step, or at the end of every
    round of ``local_steps``. After a step: ``traffic`` (bytes sent and received, collectives, skipped
    steps) and ``t_vote`` (seconds of the vote or the all-reduce)."""

    family = "lion"

    def __init__(self, config: TrainConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, *, start: int = 0,
                 autocast=contextlib.nullcontext):
        super().__init__(model)
        self.config, self.opt, self.autocast = config, opt, autocast
        self.family = "adamw" if config.optimizer == "adamw" or config.inner == "adamw" else "lion"
        self.shares = [g["lr"] / config.lr for g in opt.param_groups]
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.steps, self.traffic, self.t_vote = start, {}, 0.0

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            loss, _ = batch_loss(self.module, x, y, self.config.is_gpt)
        loss.backward()
        return loss.detach()  # no host read here: the loop's caller reads it when it logs

    def step(self, lr: float) -> bool:
        for g, share in zip(self.opt.param_groups, self.shares):
            g["lr"] = lr * share
        opt = self.opt
        if self.config.optimizer == "lioncub":
            opt.step()
            s = opt.last_step_stats
            self.t_vote = s.t_quantize_pack + s.t_collective + s.t_unpack_vote
            self.traffic = {"bytes_sent": s.bytes_sent, "bytes_recv": s.bytes_recv, "n_collectives": s.n_collectives,
                            "skipped_steps": opt.skipped_rounds if isinstance(opt, LocalCub) else opt.skipped_steps}
        else:
            self.t_vote, sent = _allreduce_grads(self.params, self.world)
            opt.step()
            self.traffic = {"bytes_sent": sent, "bytes_recv": sent, "n_collectives": 1}
        opt.zero_grad(set_to_none=True)
        self.steps += 1
        return opt.synced if isinstance(opt, LocalCub) else True

    def evaluation(self):
        """LocalCub: the agreed start θ_s in the module (:meth:`lioncub.LocalCub.agreed`)."""
        return self.opt.agreed() if isinstance(self.opt, LocalCub) else contextlib.nullcontext()


def make_method(config: TrainConfig, model: torch.nn.Module, groups: list[dict], **kw) -> OptimizerMethod:
    """:func:`make_optimizer` for ``model``'s ``groups`` behind :class:`OptimizerMethod` (``kw``: its
    ``start`` and ``autocast``)."""
    return OptimizerMethod(config, model, make_optimizer(config, groups, model), **kw)
