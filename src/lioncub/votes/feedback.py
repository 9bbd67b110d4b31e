r"""What a binary-sign message can carry beyond ``sign(c)``: error feedback and stochastic signs.

The 1-bit votes (``onebit``, ``gather``, ``pbit`` with binary signs) send one sign per
element; a majority vote of signs tracks the median of the workers' ``c_i``, Lion the sign
of their sum. Three mechanisms put the dropped magnitudes back into the message: two on the
worker, per tensor ``t``, and one on ``onebit``'s chunk owners (docs/votes.md):

* **error feedback** (``error_feedback='worker'``, EF-SignSGD): the worker votes on
  ``v_i = c_i + e_i`` and keeps what its message did not say::

      σ_i = sign(v_i) ∈ {−1, +1}         (zeros follow the tie rule)
      s_i = mean_t |v_i|                 (one scale per tensor, kept local)
      e_i ← v_i − s_i·σ_i                (so  e_i + s_i·σ_i = v_i)

  The scale does not travel: Lion's update is ``u = sign(vote)``, whose magnitude every
  rank discards, and the vote counts signs, so a scale would change nothing the others
  compute. It sets only what the residual keeps. Over steps a worker's ``s_i·σ_i``
  averages to its ``c_i``, so a worker with a small ``c_i`` flips its vote in proportion
  and the count follows ``Σ_i c_i / s_i``, the sum, not the median.
* **server error feedback** (``error_feedback='server'``, or ``'both'`` with the worker's;
  ``onebit`` only, dist-EF-SGDM): the rank that owns chunk ``j`` of the message counts its
  ``k`` votes for +1 of each element and re-compresses the voted value with a residual::

      a = (2k − P)/P                     the mean of the P workers' signs, in [−1, 1]
      s = a + r                          r: this owner's residual of chunk j
      σ = sign(s) ∈ {−1, +1}             zeros follow the tie rule; this is what is gathered
      r ← s − σ                          (so  r + σ = s; exact in fp32 for P a power of 2)

  ``a`` is the voted value in the units of Lion's update: each worker's sign is the step it
  would take alone, so ``a`` is their average step. The scale of ``C(s) = σ`` is 1, not a
  mean ``|s|``: 1 is the magnitude every rank applies (``θ ← θ − η·σ``), so ``r`` is exactly
  the averaged step not yet taken, and ``Σ_t σ_t`` follows ``Σ_t a_t`` within ``|r| ≤ 1``
  (``|a| ≤ 1`` keeps ``|s| ≤ 2`` and so ``|r| ≤ 1``: a sigma-delta loop). A mean over the
  chunk would make an element's step depend on which rank owns it and on its neighbours in
  the message, and would count the padding's votes (all −1) in its mean. With scale 1 the
  rule is per element, nothing but the bits travels, and the padding's residual stays 0.
  Without a residual (the first step) ``σ`` is the plain majority, ties included.
* **stochastic signs** (``stochastic_signs=True``, Jin et al. 2020): ``σ_i = +1`` with
  probability ``(1 + v_i/M_i)/2``, ``M_i = max_t |v_i|`` (a tensor of zeros: 1/2), drawn
  from the optimizer's device generator, so ``E[σ_i] = v_i/M_i``. ``stochastic_signs=k`` (a
  float > 0) scales to a typical magnitude instead, ``M_i = k·mean_t |v_i|`` with ``v_i/M_i``
  clipped to [−1, 1]: elements above ``M_i`` send their sign, the rest a coin biased by
  ``v_i/M_i`` (less variance than ``max``, some bias on the clipped ones). As fp32 arithmetic:
  ``σ = +1`` where ``r < (v/M + 1)·0.5``, ``r`` the generator's ``torch.rand`` of the
  bucket's length (one draw per element, in bucket order).

The server residual changes only the owner's count (the workers' encode is as without it).
The two worker-side mechanisms compose (error feedback on a stochastic sign keeps
``v − s·σ`` of the drawn σ). Both read the whole tensor before its first bit, so such buckets
skip the fused one-pass encode (``c`` is computed, then encoded by torch ops; the fused apply
still runs), and neither
repeats: a draw advances the generator, a residual changes. The step therefore encodes
only after its has-grad / finite agreement (never ahead), and overlap / the DDP hook,
which encode during backward before that agreement, are refused.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..wire import kernels

__all__ = ["ERROR_FEEDBACK", "WORKER_FEEDBACK", "SERVER_FEEDBACK", "stochastic_sign_values", "add_residuals_",
           "update_residuals_", "server_signs_", "owner_state_what"]

ERROR_FEEDBACK = ("none", "worker", "server", "both")
"""What ``error_feedback=`` takes: no residual, each worker's residual of its scaled sign, each
chunk owner's residual of its voted sign (``onebit``), or both residuals."""
WORKER_FEEDBACK = ("worker", "both")
"""The ``error_feedback`` values that keep a worker residual (``state[p]['ef_residual']``)."""
SERVER_FEEDBACK = ("server", "both")
"""The ``error_feedback`` values that keep a server residual on the chunk owners."""


def _tensors(v: Tensor, sizes: Optional[Sequence[int]]) -> tuple[Tensor, ...]:
    """The flat ``v`` split into its tensors (``sizes``; None: one tensor)."""
    return (v,) if sizes is None else v.split(list(sizes))


def stochastic_sign_values(v: Tensor, step: int, generator, sizes: Optional[Sequence[int]] = None,
                           scale: Optional[float] = None) -> Tensor:
    """σ = +1 with probability (1 + v/M)/2 per tensor, as the word-padded 0/1 bytes of
    :func:`lioncub.wire.kernels.sign_bits` (``[:v.numel()]`` are the signs; ``step`` sizes the
    buffer only: a draw needs no tie rule). One ``torch.rand`` of ``v``'s length from ``generator``.
    ``scale``: None, M = max|v|; k > 0, M = k·mean|v| and v/M clipped to [−1, 1]."""
    n = v.numel()
    buf = kernels.sign_bits(v[:0], step, length=n)  # zeroed, word-padded
    draws = torch.rand(n, generator=generator, device=v.device, dtype=torch.float32)
    for vt, rt, bt in zip(_tensors(v, sizes), _tensors(draws, sizes), _tensors(buf[:n].view(torch.bool), sizes)):
        if not vt.numel():
            continue
        top = vt.abs().amax() if scale is None else vt.abs().mean().mul_(scale)
        ratio = vt / top.clamp_min(torch.finfo(torch.float32).tiny)  # a tensor of zeros: 0, p = 1/2
        if scale is not None:
            ratio.clamp_(-1.0, 1.0)
        torch.lt(rt, ratio.add_(1).mul_(0.5), out=bt)
    return buf


def add_residuals_(v: Tensor, residuals: Sequence[Tensor]) -> Tensor:
    """v ← c + e: each tensor's residual added to its piece of the flat ``v``, in place."""
    for vt, e in zip(v.split([e.numel() for e in residuals]), residuals):
        vt.add_(e.reshape(-1))
    return v


def update_residuals_(v: Tensor, signs: Tensor, residuals: Sequence[Tensor]) -> None:
    """e ← v − s·σ per tensor, s = mean|v| of the tensor, σ = 2·signs − 1 (``signs``: the
    0/1 bytes the message packs, ``[:v.numel()]``)."""
    sizes = [e.numel() for e in residuals]
    for vt, bt, e in zip(v.split(sizes), signs[:v.numel()].split(sizes), residuals):
        sent = bt.to(torch.float32).mul_(2).sub_(1).mul_(vt.abs().mean())  # s·σ
        e.copy_(torch.sub(vt, sent).view_as(e))


def server_signs_(rows: Tensor, world: int, residual: Tensor, step: int) -> Tensor:
    """A chunk owner's voted bits with server error feedback, packed; ``residual`` updated.

    ``rows``: (P, C) uint8, row i rank i's packed signs of this chunk; ``residual``: (8C,)
    fp32, ``r``; ``step``: the tie rule's parity. ``a = (2k − P)/P``, ``s = a + r``,
    ``σ = sign(s)``, ``r ← s − σ`` (module docstring). Returns σ as C bytes (bit set: +1)."""
    n = rows.numel() // world * 8
    k = kernels.unpack_bytes(rows.reshape(-1), world * n, 1).view(world, n).sum(0, dtype=torch.float32)
    s = k.mul_(2).sub_(world).div_(world).add_(residual)  # (8C,): a + r
    bits = kernels.sign_bits(s, step)
    torch.sub(s, bits[:n].to(torch.float32).mul_(2).sub_(1), out=residual)  # r ← s − σ
    return kernels.pack_bytes(bits, n, 1)


def owner_state_what(error_feedback: str, tie: str, aggregate: str = "vote") -> Optional[str]:
    """What the chunk owners keep between steps under these settings, in words (None: nothing): the
    1-bit mean's residuals (``aggregate='mean'``), the server residuals, or ``tie='hold'``'s last votes.
    One wording for every refusal that names it (resharding a checkpoint, overlap, the DDP hook)."""
    if aggregate == "mean":
        return "aggregate='mean' keeps the chunk owners' residuals"
    if error_feedback in SERVER_FEEDBACK:
        return f"error_feedback={error_feedback!r} keeps the chunk owners' residuals"
    if tie == "hold":
        return "tie='hold' keeps the chunk owners' last votes"
    return None
