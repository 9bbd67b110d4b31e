"""Momentum synchronisation policies for LionCub (DESIGN.md §5)."""
from __future__ import annotations

__all__ = ["MomentumSync"]


class MomentumSync:
    """Placeholder accepting only ``'none'``; the policies land with issue 3."""

    def __init__(self, policy="none", *, every=10, dtype="fp32", model=None, optimizer=None):
        if policy != "none":
            raise ValueError(f"momentum_sync must be 'none' for now, got {policy!r}")

    def after_step(self, optimizer, stats) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None
