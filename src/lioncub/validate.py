"""The argument checks every public entry point shares: one line per bad input, naming the
argument and what it allows.

A leaf module (it imports nothing of the package), so optimizers, votes, the cost model,
the harness and the testbed all check with the same words. ``bool`` is refused where a
number is expected (``True`` is an ``int`` to Python, never a sensible count or rate).
Each check returns the value it accepted, normalised (``float`` for numbers), so a
constructor reads ``self.H = check_int("local_steps", local_steps, low=1)``.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Iterable, Optional, Union

__all__ = ["check_float_params", "check_int", "check_number", "check_bool", "check_optional_bool", "check_choice",
           "check_optional_choice", "check_fraction", "check_hyperparameters"]


def check_int(name: str, value, low: Optional[int] = None, high: Optional[int] = None, *,
              what: str = "") -> int:
    """``value`` as an ``int`` in ``[low, high]`` (either bound may be open); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or \
            (low is not None and value < low) or (high is not None and value > high):
        if low is not None and high is not None:
            allowed = f"an int in [{low}, {high}]"
        elif low is not None:
            allowed = f"an int >= {low}"
        elif high is not None:
            allowed = f"an int <= {high}"
        else:
            allowed = "an int"
        raise ValueError(f"{name}{f' ({what})' if what else ''} must be {allowed}, got {value!r}")
    return value


def check_number(name: str, value, *, positive: bool = True) -> float:
    """``value`` as a ``float``: ``> 0`` (``positive``) or ``>= 0``; else ValueError."""
    ok = not isinstance(value, bool) and isinstance(value, Real) and (value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"{name} must be a number {'>' if positive else '>='} 0, got {value!r}")
    return float(value)


def check_fraction(name: str, value) -> float:
    """``value`` as a ``float`` in ``[0, 1)`` (a momentum or decay factor); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


def check_bool(name: str, value) -> bool:
    """``value`` if it is a ``bool``; else TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_stochastic(name: str, value) -> Union[bool, float]:
    """``value`` if it is a bool or a finite real > 0 (not a bool); else TypeError / ValueError."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, Real):
        raise TypeError(f"{name} must be a bool or a float > 0 (the scale k of M = k·mean|v|), got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a bool or a finite float > 0 (the scale k of M = k·mean|v|), got {value!r}")
    return value


def check_optional_bool(name: str, value) -> Optional[bool]:
    """``value`` if it is None, True or False; else TypeError."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be None, True or False, got {value!r}")
    return value


def check_choice(name: str, value, allowed: Iterable, *, aliases: Optional[dict] = None):
    """``value`` if it is one of ``allowed``; an alias (old spelling) maps to its name; else ValueError."""
    allowed = tuple(allowed)
    if aliases and isinstance(value, str) and value in aliases:
        return aliases[value]
    if value not in allowed:
        also = f" (or the older {', '.join(map(repr, aliases))})" if aliases else ""
        raise ValueError(f"{name} must be one of {allowed}{also}, got {value!r}")
    return value


def check_optional_choice(name: str, value, allowed: Iterable):
    """``value`` if it is None or one of ``allowed``; else ValueError."""
    allowed = tuple(allowed)
    if value is not None and value not in allowed:
        raise ValueError(f"{name} must be None or one of {allowed}, got {value!r}")
    return value


def check_hyperparameters(lr, betas, weight_decay) -> None:
    """Lion's (and every optimizer's here) ``lr >= 0``, ``betas`` a pair in ``[0, 1)``,
    ``weight_decay >= 0``: TypeError for a non-number, ValueError for one out of range."""
    if isinstance(lr, bool) or not isinstance(lr, Real):
        raise TypeError(f"lr must be a real number >= 0, got {type(lr).__name__}")
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2) with 0 <= beta < 1, got {betas!r}")
    for name, beta in zip(("beta1", "beta2"), betas):
        if isinstance(beta, bool) or not isinstance(beta, Real):
            raise TypeError(f"betas: {name} must be a real number in [0, 1), got {type(beta).__name__}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas: {name} must be in [0, 1), got {beta}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, Real):
        raise TypeError(f"weight_decay must be a real number >= 0, got {type(weight_decay).__name__}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def check_float_params(params, who: str) -> None:
    """Refuse a parameter that is not a dense floating-point tensor (``TypeError`` naming it)."""
    import torch

    for i, p in enumerate(params):
        if not torch.is_floating_point(p):
            raise TypeError(f"parameter {i} has dtype {p.dtype}; {who} needs floating-point params")
        if p.is_sparse:
            raise TypeError(f"parameter {i} is sparse; {who} supports dense parameters only")
