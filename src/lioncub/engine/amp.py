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
going away (it warns ``FutureWarning`` each step); importing ``lioncub`` silences that one
warning, process-wide (a filter cannot tell whose optimizer the scaler steps). When torch
moves to its newer contract (``opt.grad_scale`` and ``opt.found_inf`` set before ``step``),
the step still unscales and agrees on the skip (:func:`unscale`). Not with ``overlap=True`` or
the DDP hook: their votes are encoded during backward, from the scaled gradients, so the step
refuses a scaler there (use bf16 autocast).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

__all__ = ["scaling", "unscale", "record_agreed"]

# Process-wide (a warnings filter cannot tell whose optimizer the scaler steps): only this one
# message of torch's GradScaler, about the keyword contract these optimizers use on purpose.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def _state(opt, scaler) -> dict:
    return scaler._per_optimizer_states[id(opt)]


def scaling(opt, scaler) -> bool:
    """Whether this step runs under loss scaling: a scaler handed over (``grad_scaler=``), or
    the attributes of torch's newer contract (``opt.found_inf``) set by ``GradScaler.step``."""
    if scaler is not None:
        return scaler.is_enabled()
    return getattr(opt, "found_inf", None) is not None


def unscale(opt, scaler, params: list[Tensor]) -> Optional[Tensor]:
    """Unscale ``opt``'s gradients (unless done) and return this rank's found-inf as a
    1-element tensor on the scaler's device (no host read); None without loss scaling.

    With the scaler handed over: ``scaler.unscale_(opt)`` fills the scaler's per-device
    found-inf tensors. Under torch's newer contract (``opt.grad_scale`` / ``opt.found_inf``
    set on the optimizer, no scaler passed): the gradients are divided by ``grad_scale``
    here and ``found_inf`` is taken as it is; the skip is still agreed, but the verdict cannot
    reach the scaler's own tensors, so its scales may then drift apart across ranks."""
    if scaler is None:
        found = getattr(opt, "found_inf", None)
        if found is None:
            return None
        scale = getattr(opt, "grad_scale", None)
        grads = [p.grad for p in params if p.grad is not None]
        if scale is not None and grads:
            torch._foreach_mul_(grads, scale.double().reciprocal().float())
        return found.detach().float().reshape(1)
    if not scaler.is_enabled():
        return None
    from torch.amp.grad_scaler import OptState

    if _state(opt, scaler)["stage"] is OptState.READY:
        scaler.unscale_(opt)
    per_device = _state(opt, scaler)["found_inf_per_device"]
    if not per_device:  # no gradient on this rank: give update() a verdict to read (the agreed one)
        scale = scaler._scale if scaler._scale is not None else torch.ones(1)
        per_device[scale.device] = torch.zeros(1, dtype=torch.float32, device=scale.device)
    flags = list(per_device.values())
    device = flags[0].device
    total = flags[0].reshape(1).clone()
    for f in flags[1:]:
        total.add_(f.to(device, non_blocking=True).reshape(1))
    return total


def record_agreed(opt, scaler, bad_ranks: int) -> None:
    """Write the agreed verdict (``bad_ranks`` > 0: some rank overflowed) into every
    per-device found-inf tensor of ``scaler`` for ``opt`` (``scaler.update()`` then moves
    every rank's scale the same way), or into ``opt.found_inf`` under the newer contract.
    ``bad_ranks`` is a Python int already on the host: no sync."""
    if scaler is None:
        found = getattr(opt, "found_inf", None)
        if found is not None:
            found.fill_(1.0 if bad_ranks else 0.0)
        return
    if not scaler.is_enabled():
        return
    for f in _state(opt, scaler)["found_inf_per_device"].values():
        f.fill_(1.0 if bad_ranks else 0.0)
