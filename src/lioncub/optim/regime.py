r"""LocalCub's whole setting from the link: ``LocalCub(local_steps='auto', aggregation='auto')`` (:class:`AutoSetting`).

One rule, here, for the optimizer and for everything built on it (``lioncub train --local-setting link``, the race's
``lcub-link`` row). The first round runs the low-bit rounds (the 2-bit scatter mean, outer SGD at 1) for
:data:`LOWBIT_H` timed steps; at its end :func:`pick_rounds` decides, every rank alike, from the α-β time of one such
round (``round_s``: the exchange's own plan on the measured α and β) and the slowest rank's step ``step_s``
(``Options(pace='timed')``: the rounds' own pace t_ref, the lower median of the ranks' steps; docs/stragglers.md)::

    H = max(5, ⌈round_s / step_s⌉)              the smallest H >= 5 whose round costs at most H steps' compute
    low-bit rounds with that H                  while H <= 50 (the link busy beside compute: 0.66-0.76 measured)
    long rounds otherwise                       4-bit scatter mean, outer Nesterov 0.7, H >= 50 priced by 'auto'

The races behind it (bench/README.md, "Low-bit rounds for the library's default" and "The rule's share from 4 to
1"; 3 seeds, 100 s each): the 2-bit rounds at H = 5 led the long setting at r ≈ 250 beyond the noise and the 8-bit
lane mean at H = 10 at r ≈ 10; at 5 Mbit/s (r ≈ 480) H = 12, this rule's pick there, reached AdamW + DDP's
loopback loss at 1.17 times its time where H = 5 (a share of 4) needed 1.84 and H = 25 1.41. Streaming these short
rounds (one round in flight) ran at 0.89 of the compute rate but stalled on 2 of 3 seeds; in 5 fragments (3 steps
in flight) they hid the wire (0.79 of the no-communication row at 5 Mbit/s, 0.78 on loopback) but stalled on 1 of 3
(bench/README.md, "Short rounds streamed in fragments"): they stay blocking. The inner lr stays the caller's: the
low-bit rounds were raced at :data:`AUTO_LR`, the long ones at 2e-3.

Example::

    >>> from lioncub.optim.regime import pick_rounds
    >>> pick_rounds(round_s=0.02, step_s=0.05)        # a 2-bit round worth 0.4 steps: averaging every 5 steps
    ('lowbit', 5)
    >>> pick_rounds(round_s=0.54, step_s=0.045)       # 12 steps' worth (5 Mbit/s here): every 12 steps
    ('lowbit', 12)
    >>> pick_rounds(round_s=3.0, step_s=0.05)         # 60 steps' worth: long rounds
    ('long', 50)
"""
from __future__ import annotations

import math

__all__ = ["SETTINGS", "AutoSetting", "pick_rounds", "setting_text", "LOWBIT_H", "LOWBIT_BITS", "LOWBIT_SHARE",
           "AUTO_LR"]

SETTINGS: dict[str, dict] = {
    # bench/README, the races at r ≈ 70-200: the 4-bit scatter mean led at r ≈ 71, 150, 170 and 200; lr 2e-3 ahead of
    # 1e-3 at equal steps beyond the noise (2.211 ± 0.007 against 2.230 ± 0.005) and at r = 71 within it
    "long": dict(local_steps="auto", min_local_steps=50, inner="adamw", lr=2e-3, vote="onebit", bits=4,
                 aggregate="mean", error_feedback=True, outer="nesterov", outer_lr=0.7),
}
"""The long rounds :func:`pick_rounds` switches to, as LocalCub's engine settings plus the inner ``lr`` they were
raced at (a warm-up then a cosine)."""

LOWBIT_H = 5
"""The least H of :class:`~lioncub.LocalCub`'s own ``aggregation='auto'`` low-bit rounds (and its default H)."""
LOWBIT_BITS = 2
LOWBIT_SHARE = 1.0
"""``aggregation='auto'``: a low-bit round's α-β time may be up to this many times its H steps' compute. It was 4
until the 5 Mbit/s race (bench/README.md, "The rule's share from 4 to 1"): at r ≈ 480 the share of 4 kept H = 5,
whose rounds waited on the wire (0.37 of the compute rate, level with not communicating); H = 12 (a share of 1)
reached DDP-loopback's loss at 1.17x its time."""
AUTO_LR = 4e-3
"""The inner (AdamW) lr the low-bit rounds were raced at: what ``lioncub train --local-setting link`` and the race's
``lcub-link`` row run ``aggregation='auto'`` with."""
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


def setting_text(pick: dict) -> str:
    """One line for a run's log from ``steps_pick`` (the optimizer's): what ``aggregation='auto'`` picked and why."""
    s = pick.get("setting") or {}
    if not s:
        return "local setting from the link: not picked yet (the first round is timed)"
    rounds = (f"low-bit rounds: the {LOWBIT_BITS}-bit scatter mean, outer SGD 1, H = {s['H']}" if s["name"] == "lowbit"
              else f"long rounds: the 4-bit scatter mean, outer Nesterov 0.7, H = {pick.get('H')}")
    return (f"local setting from the link: one step {s['step_s'] * 1e3:.0f} ms, a {LOWBIT_BITS}-bit round "
            f"{s['round_s'] * 1e3:.0f} ms (alpha {s['alpha']:.2g} s, beta {s['beta']:.2g} s/bit) -> {rounds}")


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
