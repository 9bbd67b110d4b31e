r"""LocalCub's whole setting from the link: short rounds where the wire is cheap, long ones where it decides.

The races by regime (bench/README.md) found two settings, each the best of its regime, and they differ in more
than H::

    short rounds   H = 10,  AdamW lr 4e-3, 8-bit L1 lane mean + EF, outer SGD at 1 (averaging)    r ≈ 1 and 9
    long rounds    H ≥ 50,  AdamW lr 2e-3, 4-bit scatter mean + EF, outer Nesterov 0.7           r ≈ 70-200

where r = (one fp32 ring all-reduce of the gradient) / (one step's compute) is the regime. Short rounds
average often and train best per step; long rounds and a 4-bit code spend less of each round on the wire.
The switch is the rule ``local_steps='auto'`` prices rounds by (:mod:`lioncub.optim.auto_steps`): short
rounds are taken while their own round, an 8-bit lane all-reduce every 10 steps, costs at most
``round_share`` of those 10 steps' compute::

    T_lanes(α, β) ≤ round_share · 10 · t_step        (about r ≤ 20 at the default share of a half:
                                                     an 8-bit all-reduce is a quarter of an fp32 one)

otherwise long rounds, whose H ``'auto'`` then lengthens past 50 where even a 50-step round would cost more
than its share. Both times come from measurements: α and β from :func:`lioncub.engine.cost.calibrate`,
t_step from a timed step (:func:`lioncub.harness.regime.measure_step`), each the slowest rank's, so every rank
picks the same setting.

Example::

    >>> from lioncub.optim.regime import pick_setting
    >>> pick_setting(834_304, 4, alpha=1e-4, beta=1e-8, step_s=0.05).name      # 100 Mbit/s, r ≈ 8
    'short'
    >>> pick_setting(834_304, 4, alpha=1e-4, beta=1e-7, step_s=0.05).name      # 10 Mbit/s, r ≈ 80
    'long'
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..engine.cost import collective_time
from .auto_steps import ROUND_SHARE

__all__ = ["SETTINGS", "SHORT_H", "SettingPick", "pick_setting", "AutoSetting", "pick_rounds", "LOWBIT_H",
           "LOWBIT_BITS", "LOWBIT_SHARE"]

SHORT_H = 10
"""H of the short-round setting."""

SETTINGS: dict[str, dict] = {
    # bench/README, "The race by regime": first beyond the noise at r ≈ 9, tied with local AdamW at r ≈ 1
    "short": dict(local_steps=SHORT_H, inner="adamw", lr=4e-3, vote="pbit", bits=8, quantizer="l1",
                  aggregate="mean", error_feedback=True, outer="sgd", outer_lr=1.0),
    # bench/README, the races at r ≈ 70-200: the 4-bit scatter mean led at r ≈ 71, 150, 170 and 200; lr 2e-3 ahead of
    # 1e-3 at equal steps beyond the noise (2.211 ± 0.007 against 2.230 ± 0.005) and at r = 71 within it
    "long": dict(local_steps="auto", min_local_steps=50, inner="adamw", lr=2e-3, vote="onebit", bits=4,
                 aggregate="mean", error_feedback=True, outer="nesterov", outer_lr=0.7),
}
"""The two settings, as :class:`~lioncub.LocalCub` keyword arguments plus the inner ``lr`` (the peak of the
schedule: both were tuned with a warm-up then a cosine)."""
ROUNDS = {"short": "the 8-bit L1 lane mean", "long": "the 4-bit scatter mean"}
"""How each setting's round travels, in words (for the log line)."""

LOWBIT_H = 5
"""The least H of :class:`~lioncub.LocalCub`'s own ``aggregation='auto'`` low-bit rounds (and its default H)."""
LOWBIT_BITS = 2
LOWBIT_SHARE = 4.0
"""``aggregation='auto'``: a low-bit round's α-β time may be up to this many times its H steps' compute (the link
kept busy: the races with H = 5 measured r ≈ 10 and 250 there, bench/README.md, "Short low-bit rounds")."""
AUTO_SETTINGS = ("lowbit", "long")
"""What ``LocalCub(aggregation='auto')`` picks between (:func:`pick_rounds`)."""


def pick_rounds(round_s: float, step_s: float) -> tuple[str, int]:
    """``LocalCub(aggregation='auto')``'s pick from the α-β time ``round_s`` of one round of its low-bit rounds (the
    2-bit scatter mean: :func:`~lioncub.optim.auto_steps.round_seconds` of the first round's exchange) and the
    slowest rank's step ``step_s``: ``('lowbit', H)`` with H the smallest >= :data:`LOWBIT_H` whose round takes at
    most :data:`LOWBIT_SHARE` times its H steps' compute, while that H is at most the long rounds' 50; else
    ``('long', 50)`` (whose H is then priced as ``local_steps='auto'`` prices it). Pure."""
    H = LOWBIT_H if round_s == 0 else (math.inf if step_s <= 0 else
                                        max(LOWBIT_H, math.ceil(round_s / (LOWBIT_SHARE * step_s) - 1e-9)))
    least_long = SETTINGS["long"]["min_local_steps"]
    return ("lowbit", int(H)) if H <= least_long else ("long", least_long)




@dataclass(frozen=True)
class SettingPick:
    """What :func:`pick_setting` chose and from what (all times in seconds, the slowest rank's)."""

    name: str
    """``'short'`` or ``'long'``: a key of :data:`SETTINGS`."""
    r: float
    """The regime: an fp32 ring all-reduce of the model over one step, both as measured (α-β priced)."""
    step_s: float
    short_round_s: float
    """The short setting's round on this link: one all-reduce of 8-bit lanes of the whole model."""
    alpha: float
    beta: float
    round_share: float
    options: dict = field(default_factory=dict)
    """A copy of ``SETTINGS[name]``."""

    def as_dict(self) -> dict:
        """Plain numbers and strings (for a run's record or a checkpoint)."""
        return dict(name=self.name, r=self.r, step_s=self.step_s, short_round_s=self.short_round_s,
                    alpha=self.alpha, beta=self.beta, round_share=self.round_share)

    @classmethod
    def from_dict(cls, saved: dict) -> "SettingPick":
        """The pick :meth:`as_dict` wrote (a checkpoint's): the same setting, whatever the link measures now."""
        if not isinstance(saved, dict) or saved.get("name") not in SETTINGS:
            raise ValueError(f"a saved local setting must name one of {sorted(SETTINGS)}, got {saved!r}")
        numbers = {k: float(saved[k]) for k in ("r", "step_s", "short_round_s", "alpha", "beta", "round_share")}
        return cls(saved["name"], **numbers, options=dict(SETTINGS[saved["name"]]))

    def text(self) -> str:
        """One line for a run's log."""
        o = self.options
        return (f"local setting from the link: r = {self.r:.1f} (one step {self.step_s * 1e3:.0f} ms; an 8-bit round "
                f"{self.short_round_s * 1e3:.0f} ms against {self.round_share:g} of {SHORT_H} steps) -> {self.name} "
                f"rounds: H = {o['local_steps']}{' (at least %d)' % o['min_local_steps'] if 'min_local_steps' in o else ''}, "
                f"AdamW lr {o['lr']:g}, outer {o['outer']} {o['outer_lr']:g}, {ROUNDS[self.name]}")


def pick_setting(n_params: int, world_size: int, alpha: float, beta: float, step_s: float, *,
                 round_share: float = ROUND_SHARE) -> SettingPick:
    """The setting for a model of ``n_params`` on ``world_size`` workers whose link is (α, β) and whose step
    takes ``step_s`` (module docstring). Pure: every rank given the same numbers picks the same."""
    for name, value in (("n_params", n_params), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, value in (("alpha", alpha), ("beta", beta), ("step_s", step_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if isinstance(round_share, bool) or not isinstance(round_share, (int, float)) or not 0 < round_share <= 1:
        raise ValueError(f"round_share must be a number in (0, 1], got {round_share!r}")
    fp32 = collective_time("allreduce", 4 * n_params, world_size, alpha, beta)
    lanes = collective_time("allreduce", n_params, world_size, alpha, beta)  # 8-bit lanes: a byte a parameter
    r = fp32 / step_s if step_s > 0 else math.inf
    name = "short" if lanes <= round_share * SHORT_H * step_s else "long"
    return SettingPick(name, r, float(step_s), lanes, float(alpha), float(beta), float(round_share),
                       dict(SETTINGS[name]))


class AutoSetting:
    """The mixin of ``LocalCub(local_steps='auto', aggregation='auto')``: the first round runs the low-bit rounds
    (the 2-bit scatter mean, outer SGD at 1) for :data:`LOWBIT_H` timed steps; at its end :func:`pick_rounds`
    chooses from the measured α, β and the slowest rank's step, every rank alike. ``'lowbit'`` keeps those rounds
    with the H it priced (at least 5); ``'long'`` switches to the 4-bit scatter mean and Nesterov 0.7 (the
    workers' residuals carry over, both in Δ's units; the chunk owners' restart at zero, their spans differ) and ``'auto'`` then picks H >= 50. The pick is
    ``steps_pick['setting']``, kept in checkpoints. The inner lr stays the caller's: the low-bit rounds were raced at
    4e-3, the long ones at 2e-3."""

    def _pick_setting(self, round_s: float, step_s: float):
        """Pick, apply and record from the first round's α-β ``round_s`` and ``step_s``; returns the low-bit rounds'
        H, or None (long: H is priced next, on the long rounds' exchange)."""
        pick = self.steps_pick
        name, H = pick_rounds(round_s, step_s)
        pick["setting"] = dict(name=name, H=H, step_s=step_s, round_s=round_s, alpha=pick["alpha"], beta=pick["beta"])
        self._apply_setting(name)
        if name == "lowbit":
            return H
        pick["min_local_steps"] = max(pick["min_local_steps"], H)
        pick["max_local_steps"] = max(pick["max_local_steps"], pick["min_local_steps"])
        return None

    def _apply_setting(self, name: str) -> None:
        """The rounds of setting ``name`` from here on (the first round's are the low-bit ones)."""
        if name == "lowbit":
            return
        from ..aggregations import ScatterMean
        from ..engine.config import VoteConfig
        from .outer import make_outer

        o = SETTINGS[name]
        self.aggregation = ScatterMean(bits=o["bits"])
        self.aggregate, self.round_bits = o["aggregate"], o["bits"]
        self._set_config(VoteConfig(vote=o["vote"], tie=self.config.tie, seed=self.config.seed))
        self.rule = make_outer(o["outer"], lr=o["outer_lr"])
        self.owner_residuals = {}  # (the owners' spans change with the code width: theirs restart at zero)
        for p in self.params:
            self.rule.init_state(p, self.local_state[p], **self._placed())

    def _restore_setting(self, saved_pick) -> None:
        """Before a checkpoint's state is loaded: the setting its run picked (once; a different one is refused)."""
        saved = (saved_pick or {}).get("setting") if isinstance(saved_pick, dict) else None
        mine = self.steps_pick.get("setting", False) if self.steps_pick is not None else False
        if saved is None or mine is False:
            return
        name = saved.get("name") if isinstance(saved, dict) else None
        if name not in AUTO_SETTINGS:
            raise ValueError(f"state_dict's picked setting must be one of {AUTO_SETTINGS}, got {saved!r}")
        if mine is None:
            self._apply_setting(name)
            self.steps_pick["setting"] = dict(saved)
        elif mine["name"] != name:
            raise ValueError(f"state_dict was saved with the {name} setting; this optimizer already runs the "
                             f"{mine['name']} one: load it into a fresh LocalCub(aggregation='auto')")
