r"""``LocalCub(local_steps='auto')``: H chosen from the measured link and the measured compute.

A round of H local steps costs H·t_step of compute and one agreement on the wire. The wire time of the
agreement, for this model's chunks and this aggregation, is priced by the ring α-β model
(:func:`lioncub.engine.cost.collective_time`; α and β measured by :func:`lioncub.engine.cost.calibrate`
when not given), and the pick is the smallest H for which that time is at most ``round_share`` of the
round's compute::

    H = clamp(ceil(T_round(α, β) / (round_share · t_step)), min_local_steps, max_local_steps)

so the loop runs at about ``1 / (1 + round_share)`` of its compute-bound step rate (2/3 at the default
0.5) whatever the link. Why a half, not less: longer rounds buy step rate and cost quality. If the steps a
run needs to reach a loss grow as H^a, the time to it, H^a·(t_step + T_round/H), is least where the round's
share T_round/(H·t_step) is a/(1 − a). The races say a is large here: at r ≈ 90 H = 50 (its rounds about
as long as their compute) ended 0.09 below H = 200 and at r ≈ 200 0.10 below H ≈ 300 (the pick of a share
of 0.1), at 0.60-0.66 of the compute-bound rate against 0.80 (bench/README, the races by regime). A half
keeps H at 50 there and only lengthens rounds where they would cost more than half their compute.

H is never below ``min_local_steps`` (default 10): the outer rules and their rates were tuned for rounds of
10 steps and more (a Nesterov outer step of 0.7 on a one-step Δ would multiply the inner step several-fold);
where the link is that fast, a fixed H (or LionCub every step) is the choice. A setting whose outer rate was
tuned at a larger H takes that H as its floor (``lioncub train``'s LocalCub row: 50, the H its Nesterov 0.7
was tuned at): ``'auto'`` then only lengthens rounds where the link makes them costly.

``t_step`` is measured on the first round, which runs ``min_local_steps`` steps (so a run whose floor is its
tuned H runs exactly that H until the pick): the median time between consecutive ``step()`` calls (a whole
iteration: data, forward, backward and the inner step), the slowest rank's (one MAX all-reduce, once): a synchronous
round runs at the slowest rank's pace. With ``Options(pace='timed')`` the rounds run at t_ref instead, the lower
median of the ranks' step times (:mod:`lioncub.optim.pace`: each rank's mean gap after its first step, gathered at
the first round's end), so t_step = t_ref there, and the same first round sets the round time T = H · t_ref. Every
rank then computes the same H (and T) from the same agreed numbers. The pick is kept in :attr:`AutoSteps.steps_pick`,
saved in checkpoints and taken back on resume.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch

from .. import comm
from ..engine import auto
from ..engine.cost import calibrate, collective_time
from .pace import reference_step

__all__ = ["AutoSteps", "FIRST_ROUND", "ROUND_SHARE", "MAX_LOCAL_STEPS", "round_seconds", "pick_local_steps"]

FIRST_ROUND = 10
"""The default ``min_local_steps``: the smallest H ``'auto'`` picks, and the first round's length (it is timed)."""
ROUND_SHARE = 0.5
"""The default ``round_share``: a round's agreement costs at most this fraction of its compute."""
MAX_LOCAL_STEPS = 500
"""The default ``max_local_steps``: the largest H ``'auto'`` picks."""


def round_seconds(aggregation, chunks: list[tuple[int, int]], world: int, alpha: float, beta: float) -> float:
    """The α-β time of one round's agreement: its small all-reduce (a finite count and the per-tensor head, fp64)
    and each chunk's exchange (``chunks``: ``(elements, tensors)`` of each)."""
    tensors = sum(t for _, t in chunks)
    total = collective_time("allreduce", 8 * (tensors + 1), world, alpha, beta)
    for n, t in chunks:
        total += sum(collective_time(kind, nbytes, world, alpha, beta) for kind, nbytes in aggregation.plan(n, t))
    return total


def pick_local_steps(round_s: float, step_s: float, share: float, most: int, least: int = FIRST_ROUND) -> int:
    """The smallest H whose round spends at most ``share`` of its compute on the agreement, in [``least``,
    ``most``] (``most`` wins where they cross)."""
    if not step_s > 0:
        return most
    return min(most, max(least, math.ceil(round_s / (share * step_s) - 1e-9)))


class AutoSteps:
    """The mixin of ``local_steps='auto'`` (module docstring). Uses what LocalCub defines: ``H``, ``group``,
    ``world_size``, ``device``, ``aggregation``, ``_plan``, and :class:`~lioncub.optim.pace.Pace`'s ``pace``."""

    steps_pick: Optional[dict] = None
    """``local_steps='auto'``: ``{'alpha', 'beta', 'round_share', 'max_local_steps', 'step_s', 'round_s', 'H'}``
    (``step_s``, ``round_s`` and ``H`` None until the first round ends); None for a fixed H."""

    def _init_steps(self, local_steps, round_share, max_local_steps, vote, alpha, beta, gamma, min_local_steps=None
                    ) -> tuple[Optional[dict], int]:
        """Check ``local_steps`` and the link's arguments (``alpha``, ``beta``: ``vote='auto'``'s, or
        ``local_steps='auto'``'s); the settings ``'auto'`` starts from (None for a fixed H) and the first round's
        H. The link is measured later (:meth:`_measure_link`), once the optimizer's group exists."""
        if local_steps != "auto":
            if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
                raise ValueError(f"local_steps must be an int >= 1 or 'auto', got {local_steps!r}")
            if round_share is not None or max_local_steps is not None or min_local_steps is not None:
                raise ValueError("round_share, min_local_steps and max_local_steps apply to local_steps='auto' only")
            auto.check_auto_args(vote, alpha, beta, gamma)
            return None, local_steps
        if vote == "auto":
            auto.check_auto_args(vote, alpha, beta, gamma)
        elif (alpha is None) != (beta is None) or gamma is not None:
            raise ValueError("local_steps='auto' takes alpha and beta together (a known link) or neither (measured); "
                             "gamma applies to vote='auto' only")
        share = ROUND_SHARE if round_share is None else round_share  # (each checked by Options, where given)
        most = MAX_LOCAL_STEPS if max_local_steps is None else max_local_steps
        least = FIRST_ROUND if min_local_steps is None else min_local_steps
        if least > most:  # (one of them the default: Options checks the pair only when both are given)
            raise ValueError(f"min_local_steps must be at most max_local_steps={most}, got {least}")
        return dict(alpha=alpha, beta=beta, round_share=float(share), min_local_steps=least, max_local_steps=most,
                    step_s=None, round_s=None, H=None), least

    def _measure_link(self) -> None:
        """α and β of the group's link (calibrated unless given), the same on every rank. Collective; set-up."""
        pick = self.steps_pick
        if pick["alpha"] is None:
            alpha, beta = (0.0, 0.0) if self.world_size == 1 else calibrate(self.group, device=self.device)
            pick.update(alpha=float(alpha), beta=float(beta))
        self._marks: list[float] = []

    def _mark_step(self) -> None:
        """The time of this ``step()`` call while the first round is being timed (``pace='timed'`` times it
        itself: :mod:`lioncub.optim.pace`)."""
        if self.steps_pick is not None and self.steps_pick["H"] is None and self.pace == "slowest":
            self._marks.append(time.perf_counter())

    def _pick_steps(self) -> None:
        """At the end of the first round: the step time its rounds run at (the slowest rank's median iteration;
        ``pace='timed'``: t_ref, the lower median of the ranks' gathered step times), the round's α-β time, and H
        (then, timed, T = H · t_ref)."""
        pick = self.steps_pick
        if self.pace == "timed":  # the round's end gathered every rank's (s_i, t_i): the same list on every rank
            step_s = reference_step(self.last_round_pace["step_s"])
        else:
            gaps = sorted(b - a for a, b in zip(self._marks, self._marks[1:]))
            mine = gaps[len(gaps) // 2] if gaps else 0.0
            agreed = torch.tensor([mine], dtype=torch.float64, device=self.device)
            if self.world_size > 1:
                comm.all_reduce(agreed, self.group, op="max")
            step_s = float(agreed.item())  # one host read, once
        chunks = [(sum(pc.size for pc in pieces), len(pieces)) for pieces in self._plan()]
        round_s = round_seconds(self.exchange, chunks, self.world_size, pick["alpha"], pick["beta"])
        H = None
        if "setting" in pick and pick["setting"] is None:  # aggregation='auto': the setting first (AutoSetting)
            H = self._pick_setting(round_s, step_s)  # the low-bit rounds' H, or None: long rounds, priced below
            if H is None:
                round_s = round_seconds(self.exchange, chunks, self.world_size, pick["alpha"], pick["beta"])
        if H is None:
            H = pick_local_steps(round_s, step_s, pick["round_share"], pick["max_local_steps"],
                                 pick.get("min_local_steps", FIRST_ROUND))
        pick.update(step_s=step_s, round_s=round_s, H=H)
        self.H, self._marks = pick["H"], []
        if self.pace == "timed":
            self._time_rounds()  # T = H · t_ref (optim.pace)

    def _restore_steps(self, saved: Optional[dict]) -> None:
        """A checkpoint's pick (saved by :meth:`RoundCheckpoint.state_dict`): H as the saved run picked it."""
        if self.steps_pick is None or not saved:
            return
        self.steps_pick = dict(saved)
        self.H = int(saved.get("min_local_steps", FIRST_ROUND)) if saved.get("H") is None else int(saved["H"])
