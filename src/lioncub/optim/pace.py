r"""``Options(pace='timed')``: LocalCub's rounds of a time, not of a step count, so that a slow worker does not set
everyone's pace (the rule of asynchronous Local-SGD and Decoupled DiLoCo's merge weighted by tokens).

The first round runs H steps on every rank, as ``pace='slowest'`` does, and is timed: rank i's own step time
``t_i`` is the mean of its H − 1 gaps between consecutive ``step()`` returns (the first step left out: it carries
the warm-up, a compilation, the first batch). At its end the ranks gather ``(s_i, t_i)`` (one small all-gather)
and every rank computes the same round time from the same numbers::

    T = H · t_ref,    t_ref = the lower median of the t_i (sorted, index ⌊(P − 1)/2⌋)

so with one straggler among P >= 2 ranks the others keep their H steps a round. With ``local_steps='auto'`` (and
``aggregation='auto'``) the first round, of ``min_local_steps`` steps, serves both: ``'auto'`` picks H from t_ref
(:mod:`lioncub.optim.auto_steps`, where the synchronous rounds take the slowest rank's step), then T = H · t_ref.

From then on each rank ends its round at the first ``step()`` after which its own time since the round began is at
least T, but at least 1 step and at most ``CAP·H`` (a fast rank does not run away)::

    s_i = min(CAP·H, the least k >= 1 with clock(k-th step's return) − clock(round began) >= T)

The round begins when the ``step()`` that ended the last one returns (after the round's collectives: waiting for
the others is not counted). At the round's end the ranks gather ``(s_i, t_i = elapsed_i / s_i)`` again, and each
rank sends its Δ_i scaled by ``c_i = P·s_i / Σ_j s_j``, so that the exchange's mean (its code unchanged) is the
steps-weighted mean::

    v_i = c_i·Δ_i + e_i           (e_i: the error-feedback residual, in the units of what is sent)
    d   = (1/P)·Σ_i c_i·Δ_i = Σ_i (s_i / Σ_j s_j)·Δ_i          (Mean(): exactly this, in fp32)

Every rank computes c from the same gathered s, and the outer step from the same d: the replicas of θ_s stay
bit-identical. When every s_i is equal (the first round) c_i = 1 and nothing is scaled. A streaming round
(``streaming=True``) sends the same v_i; its rebase carries the worker's own (unscaled) Δ_i. T is fixed after the
first round and kept in the checkpoint, with this rank's time into the round in progress.

The clock is ``time.perf_counter`` on the host (``_clock``, a hook: tests set a clock of their own). On CUDA the
host runs ahead of the kernels it launched, by at most the launch queue; no step synchronises with the device
for the clock, so a rank's count may overshoot by the steps the host is ahead, and the round's end (whose agreement
reads the device) absorbs that lag into the next round's first step.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from .. import comm

__all__ = ["Pace", "CAP", "check_timed", "reference_step", "round_time"]

CAP = 4
"""A timed round's most steps, in multiples of H."""


def check_timed(aggregation, local_steps, streaming, manager, sign_vote: type, first_round: int = 0) -> None:
    """Refuse, in one line, what ``Options(pace='timed')`` cannot run with (before any parameter is seen);
    ``first_round``: ``local_steps='auto'``'s first round (its ``min_local_steps``)."""
    if manager is not None:
        raise ValueError("LocalCub: Options.pace='timed' needs every replica's steps in the round; a torchft manager "
                         "decides who is in a round itself: leave pace at 'slowest' with manager=")
    if local_steps == "auto":
        if first_round < 2:
            raise ValueError(f"LocalCub: Options.pace='timed' times the first round's steps (its gaps): with "
                             f"local_steps='auto' Options.min_local_steps must be >= 2, got {first_round}")
    elif isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 2:
        raise ValueError(f"LocalCub: Options.pace='timed' times the first round's H steps (its H - 1 gaps): "
                         f"local_steps must be an int >= 2 or 'auto', got {local_steps!r}")
    if isinstance(aggregation, sign_vote):
        raise ValueError(f"LocalCub: Options.pace='timed' weights each rank's Δ by its steps: it needs a mean "
                         f"(Mean, LaneMean or ScatterMean), got {aggregation!r}")
    if streaming is not None and streaming.fragments != 1:
        raise ValueError(f"LocalCub: Options.pace='timed' ends each rank's round at its own step: streaming must be "
                         f"False or True (one round in flight), got {streaming!r}")


def reference_step(step_s: list[float]) -> float:
    """t_ref: the lower median of the ranks' step times (module docstring), the timed rounds' pace."""
    return sorted(step_s)[(len(step_s) - 1) // 2]


def round_time(H: int, step_s: list[float]) -> float:
    """T = H · t_ref (module docstring)."""
    return H * reference_step(step_s)


class Pace:
    """The mixin of ``Options.pace`` (module docstring). Uses what LocalCub defines: ``H``, ``local_step``,
    ``group``, ``world_size``, ``rank``, ``device``; sets ``_weight``, read by
    :meth:`~lioncub.optim.rounds.Rounds._pseudo_gradient`."""

    pace = "slowest"
    last_round_pace: Optional[dict] = None
    """``pace='timed'``: the last round's ``{'steps': [s_i], 'step_s': [t_i], 'budget_s': T}`` by rank, the same on
    every rank (T None until the first round ends); None with ``'slowest'``."""

    def _open_pace(self, pace: Optional[str], sharding) -> None:
        self.pace = pace or "slowest"
        if self.pace == "slowest":
            return
        if sharding is not None:
            raise ValueError("LocalCub: Options.pace='timed' ends each rank's round at its own step, but an FSDP2 "
                             "replica's shards must step together: leave pace at 'slowest' with sharded parameters")
        self._clock = time.perf_counter
        self.budget_s: Optional[float] = None  # T, from the first round's times
        self._began: Optional[float] = None  # the clock when the round's timing began (first round: step 1)
        self._from = 0  # the steps of the round before its timing began (the first round: 1)
        self._mark = 0.0  # the clock at the last step's return
        self.last_round_pace = dict(steps=None, step_s=None, budget_s=None)

    def _round_due(self) -> bool:
        """After an inner step (``local_step`` counts it): whether this rank's round ends here."""
        if self.pace == "slowest":
            return self.local_step == self.H
        self._mark = self._clock()
        if self._began is None:  # the first round: timed from its first step's return
            self._began, self._from = self._mark, self.local_step
        if self.budget_s is None:  # the first round: H steps
            return self.local_step >= self.H
        return self.local_step >= CAP * self.H or self._mark - self._began >= self.budget_s

    def _weigh_round(self, stats) -> None:
        """At a round's end, before Δ is measured: every rank's steps and step time gathered (one all-gather), T
        set after the first round, and this rank's weight c_i (None when every rank took as many steps)."""
        self._weight = None
        if self.pace == "slowest":
            return
        s, timed = self.local_step, self.local_step - self._from
        mine = (self._mark - self._began) / timed if timed else -1.0  # (-1: no gap timed, the first round again)
        sent = torch.tensor([float(s), mine], dtype=torch.float64, device=self.device)
        got = comm.all_gather(sent, self.group, stats) if self.world_size > 1 else sent.view(1, 2)
        steps, step_s = zip(*got.tolist())  # one host read a round
        steps = [int(k) for k in steps]
        if self.budget_s is None and min(step_s) >= 0:
            self.budget_s = round_time(self.H, list(step_s))
        if len(set(steps)) > 1:
            self._weight = self.world_size * s / sum(steps)
        self.last_round_pace = dict(steps=steps, step_s=list(step_s), budget_s=self.budget_s)

    def _time_rounds(self) -> None:
        """``local_steps='auto'``, once its H is picked from t_ref (:meth:`AutoSteps._pick_steps`): T = H · t_ref,
        from the first round's gathered step times, as every rank holds them."""
        self.budget_s = round_time(self.H, self.last_round_pace["step_s"])
        self.last_round_pace["budget_s"] = self.budget_s

    def _pace_restart(self) -> None:
        """After a round's end: the next round's time begins now."""
        if self.pace != "slowest":
            self._weight, self._began, self._from = None, self._clock(), 0

    def _pace_key(self) -> dict:
        """The fingerprint's entry (none with ``'slowest'``: its checkpoints are as before)."""
        return {} if self.pace == "slowest" else dict(pace=self.pace)

    def _pace_saved(self) -> Optional[dict]:
        """The checkpoint's: T, this rank's seconds into the round in progress (None before its timing began) and
        the steps before it began."""
        if self.pace == "slowest":
            return None
        into = None if self._began is None else 0.0 if self.local_step == 0 else self._mark - self._began
        return dict(budget_s=self.budget_s, into_s=into, from_step=self._from, last=self.last_round_pace)

    def _restore_pace(self, saved: Optional[dict]) -> None:
        """A checkpoint's T and time into the round (the clock restarts here, less the seconds already in)."""
        if self.pace == "slowest":
            return
        saved = saved or {}
        budget, into = saved.get("budget_s"), saved.get("into_s")
        self.budget_s = None if budget is None else float(budget)
        now = self._clock()
        self._began = None if into is None else now - float(into)
        self._from, self._mark = int(saved.get("from_step", 0)), now
        last = saved.get("last")
        self.last_round_pace = dict(last) if isinstance(last, dict) else dict(steps=None, step_s=None,
                                                                             budget_s=self.budget_s)
