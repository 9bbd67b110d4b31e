"""Reliability checks for LionCub: same model on every rank, finite gradients,
identical replicas (DESIGN.md §2: replicas must stay bit-identical).

Every check that needs other ranks is a collective: all ranks call it at the same
point, and all of them raise (or skip) together.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_same_params", "grads_finite", "handle_nonfinite", "check_replicas"]


def grads_finite(params: list[Tensor]) -> bool:
    """True when every present gradient is finite (local, no communication)."""
    for p in params:
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return False
    return True


def handle_nonfinite(optimizer, params: list[Tensor], bad_ranks: int) -> None:
    """Apply ``optimizer.nonfinite`` once all ranks agree that ``bad_ranks`` > 0 of them
    hold a NaN/Inf gradient: raise, or return so the step is skipped everywhere."""
    if optimizer.nonfinite == "raise":
        raise FloatingPointError(
            f"non-finite gradient on {bad_ranks} rank(s) at step {optimizer.steps}; "
            "pass nonfinite='skip_step' to skip such steps on all ranks"
        )


def check_same_params(params: list[Tensor], group, world_size: int) -> None:
    """Collective check that every rank holds the same parameter shapes and dtypes."""
    return None  # filled in by the reliability work (issue 7)


def check_replicas(params: list[Tensor], group, world_size: int, *, step: int) -> None:
    """Collective check that every rank holds bit-identical parameters."""
    return None  # filled in by the reliability work (issue 7)
