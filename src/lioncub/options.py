r"""What the optimizers take beyond their main arguments: :class:`Options`, :class:`Outer` and :class:`Streaming`.

:class:`Options` holds the settings a user rarely changes (sizes, backends, checks, seeds, the link's measured
α and β, the momentum sync); every field's default ``None`` means the optimizer's own default, and an optimizer
refuses a field it has no use for, in one line. Every field, its default and when to change it: docs/api.md.

:class:`Outer` is :class:`~lioncub.LocalCub`'s outer rule with its step scale (``outer='sgd'`` is
``Outer('sgd')``); :class:`Streaming` its streamed rounds (``streaming=True`` is ``Streaming()``, an int F is
``Streaming(fragments=F)``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from numbers import Real
from typing import Optional, Union

from .validate import (check_bool, check_choice, check_fraction, check_hyperparameters, check_int, check_number,
                       check_optional_bool)

__all__ = ["Options", "Outer", "Streaming", "STEP_OPTIONS", "ROUND_OPTIONS", "NONFINITE_POLICIES",
           "NONFINITE_ALIASES", "OUTER_STATES", "SYNC_DTYPE_NAMES", "PACES"]

NONFINITE_POLICIES = ("raise", "skip")
"""What ``Options.nonfinite`` takes: on a NaN/Inf gradient anywhere, raise (naming the parameter) or skip."""
NONFINITE_ALIASES = {"skip_step": "skip", "skip_round": "skip"}
"""The older spellings of ``'skip'``, still accepted."""
OUTER_STATES = ("device", "host")
"""Where ``Options.outer_state`` keeps LocalCub's θ_s and outer state."""
SYNC_DTYPE_NAMES = ("fp32", "bf16")
"""What ``Options.sync_dtype`` takes (the momentum sync's all-reduce dtype)."""
PACES = ("slowest", "timed")
"""What ``Options.pace`` takes: LocalCub's rounds of H steps on every rank, at the slowest rank's pace; or rounds of
a time each rank fills with as many steps as fit, its Δ weighted by its steps (:mod:`lioncub.optim.pace`)."""


@dataclass(frozen=True)
class Options:
    """The advanced settings, each ``None`` for the optimizer's default (docs/api.md says when to change each).

    Every optimizer: ``seed`` (the stochastic quantizers' generator, ``seed + rank``; default 0),
    ``nonfinite`` (``'raise'``, the default, or ``'skip'``: every rank skips the step / drops the round when any
    rank's gradient holds NaN or Inf), ``check_every`` (verify every k steps / rounds that replicas are identical;
    0, the default: never), ``alpha``, ``beta`` (the link's latency in s and seconds per bit, for the ``'auto'``
    choices; default: measured), ``gamma`` (per-method local costs of ``SignVote(transport='auto')``).

    :class:`~lioncub.LionCub` only: ``fused`` (None: the fused C/Triton loops where they run; True requires them;
    False the torch ops), ``bucket_mb`` (25), ``message_mb`` (25), ``timing`` (None: time the step's split on
    CPU only), ``maximize`` (False), ``momentum_sync`` (``'none'``; ``'all'``, ``'io'``, ``'adaptive'`` or names)
    with ``sync_every`` (10) and ``sync_dtype`` (``'fp32'``).

    :class:`~lioncub.LocalCub` only: ``round_share`` (0.5), ``min_local_steps`` (10), ``max_local_steps`` (500)
    of ``local_steps='auto'``; ``outer_state`` (``'device'`` or ``'host'``: where θ_s and the outer state
    live); ``max_attempts`` (20: agreements tried per round under a torchft ``manager``); ``pace`` (``'slowest'``:
    H steps a round on every rank; ``'timed'``: each rank fills the round's time with its own count of steps, its Δ
    weighted by its steps: docs/stragglers.md).
    """

    seed: Optional[int] = None
    nonfinite: Optional[str] = None
    check_every: Optional[int] = None
    alpha: Optional[float] = None
    beta: Optional[float] = None
    gamma: Optional[dict] = None
    fused: Optional[bool] = None
    bucket_mb: Optional[float] = None
    message_mb: Optional[float] = None
    timing: Optional[bool] = None
    maximize: Optional[bool] = None
    momentum_sync: object = None
    sync_every: Optional[int] = None
    sync_dtype: Optional[str] = None
    round_share: Optional[float] = None
    min_local_steps: Optional[int] = None
    max_local_steps: Optional[int] = None
    outer_state: Optional[str] = None
    max_attempts: Optional[int] = None
    pace: Optional[str] = None

    def __post_init__(self):
        """Each field checks itself here, once, in one line naming it (``Options.seed must be an int``); the
        optimizers only refuse a field they have no use for (:meth:`for_`)."""
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"Options.seed must be an int, got {self.seed!r}")
        if self.nonfinite is not None:
            check_choice("Options.nonfinite", self.nonfinite, NONFINITE_POLICIES, aliases=NONFINITE_ALIASES)
        for name, low in (("check_every", 0), ("sync_every", 1), ("min_local_steps", 1), ("max_local_steps", 1),
                          ("max_attempts", 1)):
            if getattr(self, name) is not None:
                check_int(f"Options.{name}", getattr(self, name), low)
        for name in ("fused", "timing"):  # (None: the optimizer decides)
            check_optional_bool(f"Options.{name}", getattr(self, name))
        if self.maximize is not None:
            check_bool("Options.maximize", self.maximize)
        for name in ("bucket_mb", "message_mb"):
            if getattr(self, name) is not None:
                check_number(f"Options.{name}", getattr(self, name))
        for name in ("alpha", "beta"):  # (0: a free link)
            if getattr(self, name) is not None:
                check_number(f"Options.{name}", getattr(self, name), positive=False)
        if (self.alpha is None) != (self.beta is None):
            raise ValueError("Options: give both alpha and beta (a known link, no probe), or neither (measured)")
        if self.gamma is not None and not isinstance(self.gamma, dict):
            raise TypeError(f"Options.gamma must be a dict (vote method -> seconds per element), got "
                            f"{type(self.gamma).__name__}")
        if self.sync_dtype is not None:
            check_choice("Options.sync_dtype", self.sync_dtype, SYNC_DTYPE_NAMES)
        if self.round_share is not None and (isinstance(self.round_share, bool) or not isinstance(self.round_share, Real)
                                             or not 0 < self.round_share <= 1):
            raise ValueError(f"Options.round_share must be a number in (0, 1], got {self.round_share!r}")
        if None not in (self.min_local_steps, self.max_local_steps) and self.min_local_steps > self.max_local_steps:
            raise ValueError(f"Options.min_local_steps must be at most max_local_steps={self.max_local_steps}, got "
                             f"{self.min_local_steps}")
        if self.outer_state is not None:
            check_choice("Options.outer_state", self.outer_state, OUTER_STATES)
        if self.pace is not None:
            check_choice("Options.pace", self.pace, PACES)

    def given(self) -> dict:
        """The fields set (not None)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def for_(self, owner: str, allowed: tuple) -> dict:
        """The fields set, refusing (one line) one that ``owner`` has no use for."""
        given = self.given()
        for key in given:
            if key not in allowed:
                raise ValueError(f"{owner}: Options.{key} does not apply to {owner} (it takes "
                                 f"{', '.join(allowed)})")
        return given

    @classmethod
    def of(cls, value, owner: str) -> "Options":
        if value is None:
            return cls()
        if not isinstance(value, cls):
            raise TypeError(f"{owner}: options must be a lioncub.Options, got {type(value).__name__}")
        return value


COMMON_OPTIONS = ("seed", "nonfinite", "check_every", "alpha", "beta", "gamma")
STEP_OPTIONS = COMMON_OPTIONS + ("fused", "bucket_mb", "message_mb", "timing", "maximize", "momentum_sync",
                                 "sync_every", "sync_dtype")
"""The :class:`Options` fields :class:`~lioncub.LionCub` takes."""
ROUND_OPTIONS = COMMON_OPTIONS + ("round_share", "min_local_steps", "max_local_steps", "outer_state", "max_attempts",
                                  "pace")
"""The :class:`Options` fields :class:`~lioncub.LocalCub` takes."""


@dataclass(frozen=True)
class Outer:
    """LocalCub's outer rule (docs/local_steps.md): ``rule`` ``'sgd'``, ``'nesterov'`` or ``'lion'``; ``lr`` α > 0
    (dimensionless: with H = 1, ``'sgd'``, α = 1 and a sign vote a round is one LionCub step); ``momentum`` μ in
    [0, 1) of ``'nesterov'``; ``betas`` of ``'lion'`` (:mod:`lioncub.optim.outer` runs them)."""

    rule: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    betas: tuple = (0.9, 0.99)

    RULES = ("sgd", "nesterov", "lion")

    def __post_init__(self):
        if not isinstance(self.rule, str) or self.rule not in self.RULES:
            raise ValueError(f"Outer.rule must be one of {self.RULES}, got {self.rule!r}")
        check_number("Outer.lr", self.lr)
        check_fraction("Outer.momentum", self.momentum)
        check_hyperparameters(1.0, self.betas, 0.0)

    @classmethod
    def of(cls, value) -> "Outer":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(rule=value)
        raise TypeError(f"LocalCub: outer must be 'sgd', 'nesterov', 'lion' or a lioncub.Outer, got "
                        f"{type(value).__name__}")


@dataclass(frozen=True)
class Streaming:
    """LocalCub's streamed rounds: a round's agreement travels while the next round's inner steps run and is
    applied when it lands (one round late, or H/F steps late in ``fragments`` F). ``eager``: with a mean, each
    worker's own Δ stands in for the agreed one while it is in flight (measured to help with fragments)."""

    fragments: int = 1
    eager: bool = False

    def __post_init__(self):
        check_int("Streaming.fragments", self.fragments, 1)
        if not isinstance(self.eager, bool):
            raise TypeError(f"Streaming.eager must be a bool, got {self.eager!r}")

    @classmethod
    def of(cls, value: Union[bool, int, "Streaming", None]) -> Optional["Streaming"]:
        """``False``/None: blocking rounds (None returned); ``True``: :class:`Streaming`; an int F: F fragments."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, int):
            return cls(fragments=value)
        raise TypeError(f"LocalCub: streaming must be a bool, an int (fragments) or a lioncub.Streaming, got "
                        f"{type(value).__name__}")

    def flags(self) -> dict:
        return dict(delay=1, fragments=self.fragments, eager=self.eager)
