"""The regime of a run, measured in its workers: one step's compute and the link, then LocalCub's setting.

:func:`measure_step` times local AdamW's step with no communication (the compute-bound step a run is held
against; the race's ``of compute rate`` column); :func:`setting_from_link` adds the link's α and β
(:func:`lioncub.engine.cost.calibrate`) and picks LocalCub's setting (:func:`lioncub.optim.regime.pick_setting`).
Both are collective and run before training: every rank of ``group`` calls them, and every rank gets the same
numbers (the slowest rank's), so every rank picks the same setting.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from .. import comm
from ..engine.cost import calibrate
from ..optim.regime import SettingPick, pick_setting

__all__ = ["measure_step", "setting_from_link", "apply_setting", "resolve_setting"]


def _gpt_loss(model, x, y):
    return model(x, y)[1]


def measure_step(model: torch.nn.Module, loader, group=None, *, repeats: int = 8,
                 device: torch.device | None = None, loss=_gpt_loss) -> float:
    """Seconds of one step of local AdamW with no communication: forward + backward of a batch (``loss(model, x,
    y)``; default a GPT's, ``model(x, y)`` returning ``(logits, loss)``) and an AdamW step, on a copy of the model
    (the run's own model, gradients and loader are left as they were: ``loader`` has ``next_batch``,
    ``state_dict`` and ``load_state_dict``), after one untimed step that makes AdamW's state; the median over
    ``repeats``, the slowest rank's (one float64 MAX all-reduce on ``device``, default the model's). Collective;
    set-up only."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    device = next(model.parameters()).device if device is None else device
    state = loader.state_dict()
    local = copy.deepcopy(model)
    opt = torch.optim.AdamW(local.parameters(), lr=1e-6)
    times = []
    comm.barrier(group, device)  # every rank computes at once, as in a run (ranks may share the host's cores)
    for i in range(repeats + 1):
        x, y = (t.to(device) for t in loader.next_batch())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss(local, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    del local, opt
    loader.load_state_dict(state)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    comm.all_reduce(slowest, group, op="max")
    return float(slowest.item())


def setting_from_link(model: torch.nn.Module, loader, group=None, *, round_share: float | None = None,
                      device: torch.device | None = None, loss=_gpt_loss) -> SettingPick:
    """LocalCub's setting for this model on this link (:mod:`lioncub.optim.regime`): the step timed
    (:func:`measure_step`), α and β calibrated on ``group``, then :func:`~lioncub.optim.regime.pick_setting`.
    Collective; set-up only (a second or two, plus the probe's all-reduces)."""
    import torch.distributed as dist

    device = next(model.parameters()).device if device is None else device
    world = dist.get_world_size(group)
    step_s = measure_step(model, loader, group, device=device, loss=loss)
    alpha, beta = (0.0, 0.0) if world == 1 else calibrate(group, device=device)
    n = sum(p.numel() for p in model.parameters())
    kw = {} if round_share is None else dict(round_share=round_share)
    return pick_setting(n, world, float(alpha), float(beta), step_s, **kw)


def apply_setting(config, pick: SettingPick):
    """``config`` (a :class:`~lioncub.harness.config.TrainConfig`) with LocalCub's options and inner lr replaced by
    the picked setting's (the fields a setting leaves out back at their defaults: no quantizer for the scatter
    mean, no floor for a fixed H), and ``local_setting='given'``: the pick is made, its fields are the run's."""
    from .config import TrainConfig

    fields = TrainConfig.__dataclass_fields__
    cleared = {name: fields[name].default for name in ("quantizer", "min_local_steps", "delay", "fragments", "eager")}
    return config.replace(**{**cleared, **pick.options}, local_setting="given")  # the pick is made


def resolve_setting(config, model: torch.nn.Module, loader, resume_from: str | None = None,
                    device: torch.device | None = None):
    """``(config, pick)``: with ``config.local_setting == 'link'``, the setting picked from the link
    (:func:`setting_from_link`) applied to ``config``, or on a resume the one saved in the checkpoint's
    ``meta.json`` (``local_setting``: a resumed run continues the same algorithm, whatever the link measures now);
    otherwise ``(config, None)``. Collective unless resuming."""
    if config.local_setting != "link":
        return config, None
    from .checkpoint import read_meta

    saved = read_meta(resume_from).get("local_setting") if resume_from else None
    if saved:
        pick = SettingPick.from_dict(saved)
    else:
        from .method import batch_loss

        pick = setting_from_link(model, loader, device=device,
                                 loss=lambda m, x, y: batch_loss(m, x, y, config.is_gpt)[0])
    return apply_setting(config, pick), pick
