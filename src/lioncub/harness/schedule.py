"""The learning-rate schedule, as multipliers of the peak lr: one definition for the harness's loop
(``lioncub train``) and the benchmarks (bench/race.py, bench/study.py).

``lr_at`` is the harness's: linear warm-up, then a cosine over the remaining steps down to
``floor``. The race's clock is seconds as often as steps, so it composes the two factors itself:
``warmup_factor(step, w) * cosine_factor(spent fraction of the budget, floor)``.
"""
from __future__ import annotations

import math

__all__ = ["warmup_factor", "cosine_factor", "lr_at"]


def warmup_factor(step: int, warmup: int) -> float:
    """Linear warm-up: ``(step + 1) / warmup`` until it reaches 1 (1 throughout for ``warmup <= 0``)."""
    return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


def cosine_factor(progress: float, floor: float) -> float:
    """A cosine from 1 to ``floor`` as ``progress`` goes 0 -> 1 (clipped to [0, 1])."""
    p = min(1.0, max(0.0, progress))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))


def lr_at(step: int, steps: int, warmup: int, floor: float) -> float:
    """Step ``step`` of ``steps``: warm-up over the first ``warmup`` steps, then the cosine over the
    rest (``max(1, steps - warmup)`` of them) to ``floor``."""
    if step < warmup:
        return warmup_factor(step, warmup)
    return cosine_factor((step - warmup) / max(1, steps - warmup), floor)
