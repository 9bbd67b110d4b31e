"""The regime of a run: one step's compute, measured in its workers, and ``--local-setting link``.

:func:`measure_step` times local AdamW's step with no communication (the compute-bound step a run is held
against; the race's ``of compute rate`` column): collective, before training, every rank gets the slowest rank's.
:func:`resolve_setting` turns ``--local-setting link`` into LocalCub's own ``aggregation='auto'``, which picks the
setting from the link inside the optimizer (:mod:`lioncub.optim.regime`).
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from .. import comm
from ..optim.regime import AUTO_LR

__all__ = ["measure_step", "resolve_setting"]


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


def resolve_setting(config):
    """``config`` with ``local_setting == 'link'`` as the run it stands for: LocalCub's own
    ``aggregation='auto'`` (:mod:`lioncub.optim.regime`, one rule for the library and the harness) with AdamW inside
    at :data:`~lioncub.optim.regime.AUTO_LR`, the lr its low-bit rounds were raced at; the optimizer times its first
    round and picks, and its checkpoint keeps the pick (a resumed run continues the same setting). Other configs
    unchanged. Pure."""
    if config.local_setting != "link":
        return config
    return config.replace(inner="adamw", lr=AUTO_LR)
