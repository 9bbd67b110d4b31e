r"""``aggregate='mean'`` on ``onebit``: a 1-bit compressed mean of the gradients, then Lion's own
step on a momentum every rank shares (docs/votes.md, "The 1-bit mean").

A majority vote of the signs of ``c_i = β1·m_i + (1−β1)·g_i`` follows the median of the workers'
signs; Lion steps by the sign of their sum, and where the workers split the two differ (docs/results.md,
part B). This aggregate sends the same bits (one per element in each of ``onebit``'s two
collectives) but makes them carry a magnitude over time, with error feedback on both sides
(EF-SignSGD on the workers, dist-EF-SGDM's second residual on the chunk owners), and keeps the
sign for the very end: every rank decodes the same estimate ĝ of the mean gradient and runs
exact Lion on it. The momentum is therefore the same on every rank (it is updated only from ĝ),
and what a rank compresses is only what the others do not know, its gradient's innovation over
that shared momentum. Per step, per tensor ``t`` of the message and per chunk ``j`` (the
element range rank j owns)::

    δ_i = g_i − m                         (−g_i with maximize) the innovation; m is shared
    v_i = δ_i + e_i                       e_i: rank i's residual
    σ_i = sign(v_i), α_i = mean_t |v_i|   e_i ← v_i − α_i·σ_i          (so e_i + α_i·σ_i = v_i)
      all_to_all: chunk j of σ_i (1 bit per element) and rank i's T scales α_i → rank j
    a   = (1/P)·Σ_i α_i·σ_i               on chunk j's owner, per element
    s   = a + r                           r: the owner's residual of its chunk
    τ = sign(s), β = mean_piece |s|       a piece: one tensor's elements in chunk j
    r   ← s − β·τ                         (so r + β·τ = s)
      all_gather: τ (1 bit per element) and the owner's T scales β (0 where t is not in chunk j)
    ĝ   = m + β·τ                         the same on every rank
    u = sign(β1·m + (1−β1)·ĝ),  θ ← θ·(1 − ηλ) − η·u,  m ← β2·m + (1−β2)·ĝ       (Lion on ĝ)

After ``restart`` steps (``mean_restart``, default 50) ``m`` and both residuals are set to zero on
every rank, ``h`` kept: what the first steps left there was compressed while ``h`` was still flat.

Zeros of ``v`` and ``s`` follow the tie rule's parity; with the residuals they are as good as either
sign. The sums of what was sent follow the sums of what was meant within a residual, so
``Σ_t ĝ_t`` follows ``Σ_t mean_i g_i``: the momentum, an average over ~1/(1−β2) steps, sees the
compression error only as the difference of two residuals. The bytes per rank and step are
``onebit``'s, ``(P−1)·(N/P)`` in each collective, plus ``4·T`` per chunk in each (the scales: O(1)
per tensor). The state beside Lion's momentum: one residual per parameter element (``ef_residual``,
local) and the owner's fp32 residual of its chunk (as ``error_feedback='server'``: saved in
``state_dict``, not resharded).

The two collectives, the owner's stage between them and the decode are the two-phase compressed mean's
(:class:`~lioncub.votes.twophase.TwoPhase`, shared with a round's scatter mean); what is the 1-bit mean's own is
its :class:`SignCodec` (the owner's α-weighted sum, the fit of β to ``h``), the workers' encode with their
residuals (:meth:`OneBitMean.encode_mean`) and ``h`` (:meth:`OneBitMean.adapt_shape_`).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import CommStats
from ..wire import kernels
from .feedback import add_residuals_
from .onebit import OneBit
from .twophase import Codec, TwoPhase

__all__ = ["OneBitMean", "SignCodec", "AGGREGATES", "NORMS", "MEAN_DEFAULTS", "mean_fingerprint",
           "saved_fingerprint", "make_step_method"]

AGGREGATES = ("vote", "mean")
"""What ``aggregate=`` takes on :class:`~lioncub.LionCub`: the majority vote of the signs (the
default), or the 1-bit compressed mean of the gradients with Lion's step on a shared momentum."""


ADAPT_DEFAULT = 1.25
RANGE_DEFAULT = 30.0
NORMS = ("arithmetic", "geometric")
"""What ``mean_norm=`` takes: which mean of a tensor's shared magnitudes ``h`` is held at 1 (the
first is the default)."""
NORM_DEFAULT = NORMS[0]
RESTART_DEFAULT = 50


class SignCodec(Codec):
    """The 1-bit mean's code (:class:`~lioncub.votes.twophase.Codec`): signs; each rank's scaled by its own ``α``
    of the tensor (sent with its codes), their sum times ``h`` over ``P`` on the owner; the owner's scale the
    least-squares fit ``Σ|s|·h / Σh²`` of each piece; ``parity``: where a zero goes; ``shape``: ``h`` over the
    message's elements (module docstring)."""

    def __init__(self, parity: int, shape: Tensor):
        self.parity, self.shape = parity, shape

    def owner_sum(self, codes, scales, mine, h):
        P, E = codes.shape[0], 8 * codes.shape[1]
        a = torch.zeros(E, dtype=torch.float32, device=codes.device)
        signs = torch.empty(E, dtype=torch.float32, device=codes.device)
        for i in range(P):
            kernels.unpack_pm1(codes[i], E, torch.float32, out=signs)
            for t, lo, hi in mine:
                a[lo:hi].addcmul_(signs[lo:hi], scales[i, t])
        return a.mul_(h).div_(P)  # padding: 0

    def scales(self, x, mine, count, h):
        betas = torch.zeros(count, dtype=torch.float32, device=x.device)
        for t, lo, hi in mine:
            ht = h[lo:hi]
            betas[t] = torch.dot(x[lo:hi].abs(), ht).div_(torch.dot(ht, ht))
        return betas

    def levels(self, x, scales, mine):
        bits = kernels.sign_bits(x, self.parity)
        w = bits[:x.numel()].to(torch.float32).mul_(2).sub_(1)  # (before the packing, which reuses bits)
        return w, kernels.pack_bytes(bits, x.numel(), 1)

    def unpack(self, packed, n, out):
        return kernels.unpack_pm1(packed, n, torch.float32, out=out)


class OneBitMean(OneBit):
    """``onebit``'s collectives carrying the 1-bit compressed mean (module docstring). Used through
    :class:`~lioncub.LionCub` (``vote='onebit', aggregate='mean'``), whose step calls
    :meth:`encode_mean` and :meth:`exchange_mean` per message, then decodes each part with the exchange."""

    shared_momentum = True
    ADAPT = ADAPT_DEFAULT
    """γ: a repeated sign grows an element's shared magnitude ``h`` by this factor, a flip shrinks it."""
    SHAPE_RANGE = RANGE_DEFAULT
    """R: ``h`` stays in [1/R, R] (mean 1 over each tensor)."""
    NORM = NORM_DEFAULT
    """Which mean of each tensor's ``h`` is held at 1: ``'arithmetic'`` (the default), or
    ``'geometric'``, which centres the range [1/R, R] on the typical element in log scale (a few
    large ``h`` then do not pull the rest towards 1/R; it trained no better: docs/results.md)."""

    RESTART = RESTART_DEFAULT
    """The step (completed steps) at which the shared momentum and both residuals restart from zero,
    the magnitudes ``h`` kept (0: never). What the first steps put there was sent while ``h`` was
    still flat (all 1 at first), the regime where the compression is worst."""

    def __init__(self, world: int, tie: str = "alternate", *, adapt: float = ADAPT_DEFAULT,
                 shape_range: float = RANGE_DEFAULT, norm: str = NORM_DEFAULT, restart: int = RESTART_DEFAULT):
        if tie == "hold":
            raise ValueError("tie='hold' repeats a voted sign; aggregate='mean' votes none (its zeros follow the "
                             "tie rule's parity): use tie='alternate', 'plus' or 'minus'")
        super().__init__(world, None, None, tie)
        if norm not in NORMS:
            raise ValueError(f"mean_norm must be one of {NORMS}, got {norm!r}")
        self.adapt, self.shape_range, self.norm, self.restart = float(adapt), float(shape_range), norm, int(restart)
        self.owner_state = "residual"
        self.one_pass = self.repeatable = False  # a residual changes at every encode

    def backward_refusal(self, driver: str) -> Optional[str]:
        return (f"{driver} encodes during backward, before the step's agreement: aggregate='mean' updates its "
                "residuals at every encode; use overlap=False without the DDP hook")

    # ------------------------------------------------------------------ the worker
    def encode_mean(self, v: Tensor, dst: Tensor, step: int, sizes: list[int], residuals: list[Tensor],
                    shape: Tensor) -> Tensor:
        """Pack ``σ = sign(v + e)`` of the flat fp32 innovation ``v`` (overwritten by ``v + e``) into
        ``dst`` and update the residuals ``e ← v − α·h·σ``; returns the scales ``α`` (fp32, one per
        tensor of ``sizes``: the least-squares fit Σ|v|·h / Σh², 0 for an empty tensor). ``shape``:
        the flat per-element magnitudes ``h`` every rank shares (:meth:`adapt_shape_`)."""
        n = v.numel()
        add_residuals_(v, residuals)
        bits = kernels.sign_bits(v, self.parity(step))
        alphas = torch.zeros(len(sizes), dtype=torch.float32, device=v.device)
        for k, (vt, bt, e, ht) in enumerate(zip(v.split(sizes), bits[:n].split(sizes), residuals,
                                               shape.split(sizes))):
            if not vt.numel():
                continue
            alpha = torch.dot(vt.abs(), ht).div_(torch.dot(ht, ht))
            alphas[k] = alpha
            e.copy_(torch.sub(vt, bt.to(torch.float32).mul_(2).sub_(1).mul_(ht).mul_(alpha)).view_as(e))
        dst.copy_(kernels.pack_bytes(bits, n, 1))
        return alphas

    # ------------------------------------------------------------------ the collectives and the owner
    def exchange_mean(self, msg: Tensor, m: int, alphas: Tensor, tensors: list[tuple[int, int]], step: int,
                      group, stats: CommStats, residual: Tensor, shape: Tensor) -> tuple[TwoPhase, tuple]:
        """The two collectives of a message (``msg``: ``message_nbytes(m)`` bytes; ``alphas``: the T
        scales of ``tensors``, ``(start, numel)`` in message elements; ``shape``: their ``h``), this rank's
        chunk re-compressed in between (``residual``: its fp32 owner residual, updated): the two-phase mean
        (:class:`~lioncub.votes.twophase.TwoPhase`) with :class:`SignCodec`, waited at once. Returns the exchange
        and its gathered ``(τ, β)`` (:meth:`TwoPhase.split <lioncub.votes.twophase.TwoPhase.split>`), which
        :meth:`TwoPhase.decode <lioncub.votes.twophase.TwoPhase.decode>` turns into ``β·h·τ`` part by part."""
        two = TwoPhase(SignCodec(self.parity(step), shape), self.world, self.owner_elements(m), tensors)
        agreement = two.launch(msg, alphas, residual, dist.get_rank(group), group, stats, two.split, timed=stats)
        return two, agreement.result(stats)[0]

    def adapt_shape_(self, signed: Tensor, tau: Tensor) -> None:
        """One tensor's shared magnitudes after a step, in place: ``signed`` holds ``h·τ_prev``
        (``h`` > 0; all +1 at first), ``tau`` the step's decoded signs (±1, or 0·… where β = 0: its
        sign is taken as +1). A sign that repeats grows ``h`` by γ, one that flips shrinks it by γ
        (adaptive delta modulation: a run of equal signs says the residual outgrows the step);
        then ``h`` is rescaled to mean 1 over the tensor (its geometric mean, exp of the mean of
        log h, or its arithmetic mean: :attr:`NORM`) and clipped to [1/R, R]."""
        if self.adapt == 1.0 or not signed.numel():
            return
        up = (signed >= 0) == (tau >= 0)
        h = signed.abs().mul_(torch.where(up, self.adapt, 1.0 / self.adapt))
        centre = h.log().mean().exp() if self.norm == "geometric" else h.mean()
        h.div_(centre).clamp_(1.0 / self.shape_range, self.shape_range)
        torch.where(tau >= 0, h, h.neg(), out=signed)


MEAN_DEFAULTS = dict(mean_adapt=ADAPT_DEFAULT, mean_range=RANGE_DEFAULT, mean_norm=NORM_DEFAULT,
                     mean_restart=RESTART_DEFAULT)
"""``aggregate='mean'``'s own settings and their defaults (any other aggregate refuses a change)."""

SAVED_BEFORE = {"mean_norm": "arithmetic", "mean_restart": 0}
"""Fingerprint settings added after checkpoints of ``aggregate='mean'`` were first saved, with the
value those checkpoints ran with (:func:`saved_fingerprint`)."""


def make_step_method(vote: str, world: int, bits: Optional[int], quantizer: Optional[str], tie: str, *,
                     aggregate: str, error_feedback: str, stochastic_signs: Union[bool, float], **mean):
    """The every-step method object: :class:`OneBitMean` for ``aggregate='mean'``, else ``vote``'s."""
    if aggregate == "mean":
        return OneBitMean(world, tie, adapt=mean["mean_adapt"], shape_range=mean["mean_range"],
                          norm=mean["mean_norm"], restart=mean["mean_restart"])
    from . import make

    return make(vote, world, bits, quantizer, tie, error_feedback=error_feedback, stochastic_signs=stochastic_signs)


def mean_fingerprint(aggregate: str, **mean) -> dict:
    """The ``mean_*`` settings a checkpoint must match (none unless ``aggregate='mean'``)."""
    return dict(mean) if aggregate == "mean" else {}


def saved_fingerprint(config: dict) -> dict:
    """A checkpoint's saved fingerprint, with the settings it predates filled in as it ran them
    (an ``aggregate='mean'`` checkpoint without ``mean_norm`` held h's arithmetic mean at 1)."""
    if config.get("aggregate") != "mean":
        return config
    return {**SAVED_BEFORE, **config}
