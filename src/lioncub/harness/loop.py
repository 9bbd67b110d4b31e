"""The one training loop behind ``lioncub train``, the convergence study and the race (issue 46).

It drives a *method*: anything with the calls of :class:`lioncub.baselines.Adapter` (the race's
peers, and :class:`~lioncub.harness.method.OptimizerMethod` around the harness's optimizers)::

    loss   = method.backward(x, y)      # forward + backward of this rank's batch
    synced = method.step(lr)            # the update at lr; True when every replica holds the same model
    with method.evaluation(): ...       # the model the ranks agree on, for an evaluation

Per step, on every rank (``Loop.run``)::

    lr     = loop.lr(step, clock)       # clock: the agreed training seconds at the last sync point
    x, y   = loader.next_batch()        # this rank's own shard                      } t_step: "start" to "end";
    loss   = method.backward(x, y)      # t_compute                                  } evaluations, logging and
    loop.straggler.after_backward(...)  # a slower worker's sleep (the testbed's)    } the clock's own
    loop.probe(step, method)            # an instrument (the study's), before the update } all-reduce not counted
    synced = method.step(lr)                                                         }

and at a sync point only (``synced``): the agreed clock (every rank's seconds of steps since the
last sync point, the slowest rank's by a MAX all-reduce, added to the clock: every rank stops and
evaluates at the same step), the stop rule (``steps`` done, or ``budget`` seconds of the clock) and
the evaluations (every ``eval_every`` steps, every ``eval_every_s`` seconds of the clock, and at the
end), each on the agreed model. A local method is so judged on the model the workers agree on,
never on one worker's drifted copy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import comm

__all__ = ["Loop", "StepInfo", "StepClock"]


class StepClock:
    """Seconds between marks of a training step: CUDA events on the GPU's current stream (each read waits for
    that stream up to its mark only, never for the whole device: a collective left in flight on its own stream,
    a streamed LocalCub round, is not waited for), ``time.perf_counter`` on CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, first: str, last: str) -> float:
        if self.cuda:
            self.marks[last].synchronize()
            return self.marks[first].elapsed_time(self.marks[last]) / 1e3
        return self.marks[last] - self.marks[first]


@dataclass
class StepInfo:
    """What one step did, for :attr:`Loop.on_step`."""

    step: int
    """Steps done (1 after the first)."""
    loss: Any
    """What ``method.backward`` returned: a float, or a detached 0-dim tensor the loop never reads."""
    lr: float
    """The lr handed to ``method.step``."""
    t_step: float
    """Seconds of the step: batch, forward, backward and update."""
    t_compute: float
    """Seconds of forward and backward."""
    synced: bool
    """The replicas agree after this step."""
    train_time: float
    """This rank's seconds of steps so far (``t_step`` summed; not agreed)."""
    t_slept: float = 0.0
    """Seconds the straggler slept in this step (:attr:`Loop.straggler`; in ``t_step``, not in ``t_compute``)."""


@dataclass(kw_only=True)
class Loop:
    """The rules of one run: its lr, when it stops, when it evaluates, and its hooks. ``run`` trains."""

    lr: Callable[[int, float], float]
    """``(step, clock) -> lr`` handed to ``method.step``: ``step`` counts from 0, ``clock`` is the agreed
    training seconds at the last sync point (0 where the clock is not agreed)."""
    steps: int | None = None
    """Stop at the first sync point at or after this many steps (with ``budget``: a cap)."""
    budget: float | None = None
    """Stop at the first sync point where the agreed clock has reached this many seconds."""
    eval_every: int = 0
    """Evaluate at sync points whose step count is a multiple of this (0: never)."""
    eval_every_s: float = 0.0
    """Evaluate at the first sync point past every this many seconds of the agreed clock (0: never)."""
    eval_at_start: bool = False
    """Evaluate the starting model too (step 0), before the first step."""
    device: torch.device | None = None
    """Where batches go (``non_blocking``); None leaves them where the loader made them."""
    probe: Callable[[int, Any], None] | None = None
    """``probe(step, method)`` after the backward and before the update: an instrument, which must not
    touch the model, the gradients or the global RNG (the study's vote agreement, its momentum restart)."""
    on_step: Callable[[StepInfo], None] | None = None
    """Called on every rank after every step (it may run collectives: every rank calls it alike)."""
    on_eval: Callable[[dict], bool | None] | None = None
    """Called with each evaluation's record ``{"step", <the scores>, "clock", "train_time"}``; a true
    return stops the run there (the race's divergence rule: the scores are all-reduced, so every rank
    agrees)."""
    after_step: Callable[[int], None] | None = None
    """Called with the step count after each step's evaluation (the harness's checkpoints)."""
    straggler: Any = None
    """This rank's :class:`lioncub.testbed.straggler.Straggler` (``--slow-worker``, ``--pause-worker``): after
    each backward, ``straggler.after_backward(t_compute, train_time)`` sleeps what this rank owes (inside the
    step's time, as a slower device's compute would be); None: no call."""

    @property
    def agrees_clock(self) -> bool:
        """Whether sync points all-reduce the clock (a budget or timed evaluations need it)."""
        return self.budget is not None or bool(self.eval_every_s)

    def run(self, method, loader, evaluate: Callable[[], dict], *, start: int = 0, cuda: bool = False) -> list[dict]:
        """Train ``method`` on ``loader``'s batches from step ``start``; return the evaluation records.

        ``evaluate()`` scores the model in the method's module (an all-reduce: every rank calls it), inside
        ``method.evaluation()``. ``cuda``: time steps by CUDA events (:class:`StepClock`)."""
        if self.steps is None and self.budget is None:
            raise ValueError("a loop needs steps or a budget to stop")
        if getattr(method, "uneven_steps", False) and (self.steps is not None or self.eval_every):
            raise ValueError("a method whose ranks take their own steps a round (Options(pace='timed')) stops and "
                             "evaluates on the agreed clock: give a budget and eval_every_s, not steps or eval_every")
        timer = StepClock(cuda)
        evals: list[dict] = []
        clock = own = train_time = 0.0  # agreed seconds; this rank's since the last sync point; its total
        next_eval_s = self.eval_every_s

        def score(done: int) -> bool:
            with method.evaluation():
                record = {"step": done, **evaluate(), "clock": clock if self.agrees_clock else None,
                          "train_time": train_time}
            evals.append(record)
            return bool(self.on_eval(record)) if self.on_eval is not None else False

        if self.eval_at_start and score(start):
            return evals
        step = start
        while True:
            lr = self.lr(step, clock)
            timer.mark("start")
            x, y = loader.next_batch()
            if self.device is not None:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            timer.mark("batch")
            loss = method.backward(x, y)
            timer.mark("backward")
            slept = 0.0
            if self.straggler is not None:  # (on CUDA this read waits for the backward: only when it is needed)
                slept = self.straggler.after_backward(timer.seconds("batch", "backward"), train_time)
            if self.probe is not None:
                self.probe(step, method)
            synced = method.step(lr)
            timer.mark("end")
            t_step = timer.seconds("start", "end")
            own += t_step
            train_time += t_step
            step += 1
            if self.on_step is not None:
                self.on_step(StepInfo(step=step, loss=loss, lr=lr, t_step=t_step,
                                      t_compute=timer.seconds("batch", "backward"), synced=synced,
                                      train_time=train_time, t_slept=slept))
            finished = due = False
            if synced:
                if self.agrees_clock:  # the slowest rank's seconds since the last sync point
                    clock = comm.all_reduce(torch.tensor([own], dtype=torch.float64, device=self.device),
                                            op="max").item() + clock
                    own = 0.0
                finished = ((self.steps is not None and step >= self.steps)
                            or (self.budget is not None and clock >= self.budget))
                due = finished or bool(self.eval_every and step % self.eval_every == 0)
                if self.eval_every_s and clock >= next_eval_s:
                    due = True
                    while next_eval_s <= clock:
                        next_eval_s += self.eval_every_s
            if due and score(step):
                finished = True
            if self.after_step is not None:
                self.after_step(step)
            if finished:
                return evals
