"""Loss scaling (fp16 mixed precision) that every rank agrees on.

``torch.amp.GradScaler.step(opt)`` skips ``opt.step()`` on a rank whose own gradients hold
an Inf; under a vote the other ranks then wait in a collective that rank never joins, and
the ranks' scales drift apart. Lion Cub's optimizers declare
``_step_supports_amp_scaling``, so the scaler always calls their ``step`` (on every rank)
and hands itself over as ``grad_scaler``. The step then

1. unscales the gradients (``scaler.unscale_(opt)`` unless the user already did): the
   scaler's per-device found-inf flags are now this rank's;
2. adds this rank's flag to the step's one agreement all-reduce (with the non-finite
   gradient count): the ranks learn together whether any of them overflowed;
3. writes the agreed flag into the scaler's per-device found-inf tensors, so
   ``scaler.update()`` backs off (or grows) every rank's scale alike;
4. skips on every rank when any overflowed (the scaler's business: not an error, whatever
   ``nonfinite`` says), and steps on every rank otherwise.

Nothing here reads a device value on the host: the flags stay tensors until the step's
one read. Recipe (fp16 on older GPUs; bf16 autocast needs no scaler)::

    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.step(opt)          # every rank: unscale, agree, skip or step together
    scaler.update()           # the same scale everywhere

The scaler's ``step`` passes itself as a keyword argument, a contract torch has marked as
going away (it warns ``FutureWarning`` each step); that warning is silenced here for the
optimizers of this package, whose ``step`` uses the scaler on purpose.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

__all__ = ["unscale", "record_agreed"]

warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def _state(opt, scaler) -> dict:
    return scaler._per_optimizer_states[id(opt)]


def unscale(opt, scaler, params: list[Tensor]) -> Optional[Tensor]:
    """Unscale ``opt``'s gradients with ``scaler`` (unless done) and return this rank's
    found-inf as a 1-element tensor on the scaler's device (no host read); None without a
    scaler or when the scaler is disabled."""
    if scaler is None or not scaler.is_enabled():
        return None
    from torch.amp.grad_scaler import OptState

    if _state(opt, scaler)["stage"] is OptState.READY:
        scaler.unscale_(opt)
    flags = list(_state(opt, scaler)["found_inf_per_device"].values())
    if not flags:
        return None
    device = flags[0].device
    total = flags[0].reshape(1).clone()
    for f in flags[1:]:
        total.add_(f.to(device, non_blocking=True).reshape(1))
    return total


def record_agreed(opt, scaler, bad_ranks: int) -> None:
    """Write the agreed verdict (``bad_ranks`` > 0: some rank overflowed) into every
    per-device found-inf tensor of ``scaler`` for ``opt``: ``scaler.update()`` then moves
    every rank's scale the same way. A Python int already on the host: no sync."""
    if scaler is None or not scaler.is_enabled():
        return
    for f in _state(opt, scaler)["found_inf_per_device"].values():
        f.fill_(1.0 if bad_ranks else 0.0)
