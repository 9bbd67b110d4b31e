"""A slower worker in the testbed (issue 67, item 1): one rank made FACTOR× slower, or paused now and then.

A real straggler is a slower GPU, a throttled one, a host shared with another job, a pause for a checkpoint
write. On the testbed's CPUs the workers share cores, so the slowdown must *free* the slow worker's cores:
lowering its priority (``nice``) does not make a straggler when 4 workers share 2 cores (the others wait for
it in every collective, and it catches up on the cores they leave idle). A sleep does: the slowed worker sleeps
after each backward, as a slower accelerator would sit in its kernels, and the time it sleeps is counted in
its steps (the others wait for it in the next collective).

Two forms, one rank each (both may name the same rank):

* ``--slow-worker RANK:FACTOR`` (``TrainConfig.slow_workers``): after each backward, sleep
  ``(FACTOR - 1) ×`` this step's measured forward + backward (:func:`slowdown_sleep`): its compute takes
  FACTOR× as long. FACTOR >= 1 (1: no slowdown).
* ``--pause-worker RANK:S:T`` (``TrainConfig.pause_workers``): a pause of S seconds every T seconds of that
  worker's training time, its pauses not counted (:func:`pauses_due`); taken after a backward, at the first
  step whose start is past the next multiple of T.

The loop (:class:`lioncub.harness.loop.Loop`, and the torchft replica's in :mod:`lioncub.ft.train`) calls one
:class:`Straggler` per rank after each backward; it keeps what it applied (:meth:`Straggler.totals`), which
``lioncub train`` writes to ``metrics.jsonl`` and summary.csv and the benches to their records.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

__all__ = ["SLOW_FLAG", "PAUSE_FLAG", "parse_slow_worker", "parse_pause_worker", "parse_flags", "check_workers", "add_arguments",
           "slowdown_sleep", "pauses_due", "Straggler", "format_specs"]

SLOW_FLAG = "--slow-worker"
PAUSE_FLAG = "--pause-worker"


def slowdown_sleep(factor: float, compute_s: float) -> float:
    """Seconds to sleep after a backward that took ``compute_s`` so that the step's compute takes ``factor``×
    as long: ``(factor - 1) * compute_s``."""
    return (factor - 1.0) * compute_s


def pauses_due(trained_s: float, every_s: float, taken: int) -> int:
    """Pauses owed at ``trained_s`` seconds of training (the pauses not counted) with one every ``every_s``
    seconds, ``taken`` already taken: one at each of ``every_s``, ``2 * every_s``, ... reached."""
    return max(0, int(trained_s // every_s) - taken)


def _numbers(text: str, flag: str, form: str, count: int) -> list[str]:
    parts = text.split(":")
    if len(parts) != count or not all(p.strip() for p in parts):
        raise ValueError(f"{flag} {text}: expected {form}")
    return [p.strip() for p in parts]


def _rank(text: str, spec: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} {spec}: RANK must be a worker's rank, an int >= 0, got {text!r}") from None


def _float(text: str, spec: str, flag: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} {spec}: {name} must be a number, got {text!r}") from None


def parse_slow_worker(text: str) -> list[tuple[int, float]]:
    """``RANK:FACTOR[,RANK:FACTOR...]`` -> ``[(rank, factor), ...]`` (unchecked: :func:`parse_flags` checks)."""
    out = []
    for spec in text.split(","):
        rank, factor = _numbers(spec, SLOW_FLAG, "RANK:FACTOR, e.g. 1:1.5 (comma-separated for several)", 2)
        out.append((_rank(rank, spec, SLOW_FLAG), _float(factor, spec, SLOW_FLAG, "FACTOR")))
    return out


def parse_pause_worker(text: str) -> list[tuple[int, float, float]]:
    """``RANK:S:T[,RANK:S:T...]`` -> ``[(rank, seconds, every), ...]`` (unchecked: :func:`parse_flags` checks)."""
    out = []
    for spec in text.split(","):
        rank, seconds, every = _numbers(spec, PAUSE_FLAG, "RANK:S:T (a pause of S seconds every T seconds), "
                                        "e.g. 1:2:10 (comma-separated for several)", 3)
        out.append((_rank(rank, spec, PAUSE_FLAG), _float(seconds, spec, PAUSE_FLAG, "S"),
                    _float(every, spec, PAUSE_FLAG, "T")))
    return out


def parse_flags(slow: Iterable[str] = (), pause: Iterable[str] = (), world: int | None = None):
    """The ``--slow-worker`` and ``--pause-worker`` texts given (each flag repeatable, each text
    comma-separated) -> the checked ``(slow, pause)`` (:func:`check_workers`, ranks below ``world`` when given).
    A ValueError names the flag, the entry and what is allowed."""
    slow = [entry for text in slow for entry in parse_slow_worker(text)]
    pause = [entry for text in pause for entry in parse_pause_worker(text)]
    return check_workers(slow, pause, world, names=(SLOW_FLAG, PAUSE_FLAG))


def add_arguments(parser, *, rank: str = "worker RANK") -> None:
    """``--slow-worker`` and ``--pause-worker`` on ``parser`` (``lioncub train``, ``bench.race``,
    ``bench.fault_tolerance``): lists of texts in ``slow_workers`` and ``pause_workers``, for :func:`parse_flags`."""
    group = parser.add_argument_group("a slower worker (the testbed's; docs/stragglers.md)")
    group.add_argument(SLOW_FLAG, dest="slow_workers", action="append", default=[], metavar="RANK:FACTOR",
                       help=f"slow down {rank}: its compute takes FACTOR (>= 1) times as long; after each backward it sleeps "
                       "(FACTOR - 1) x that step's measured forward+backward, freeing its cores as a slower GPU "
                       "would (not `nice`: on shared cores the others wait for it and it catches up). Repeatable or "
                       "comma-separated (1:1.5,3:3)")
    group.add_argument(PAUSE_FLAG, dest="pause_workers", action="append", default=[], metavar="RANK:S:T",
                       help=f"pause {rank} for S seconds every T seconds of its training time (its pauses not counted), "
                       "after a backward. Repeatable or comma-separated (1:2:10)")


def format_specs(slow: Iterable, pause: Iterable) -> str:
    """The flags that give ``slow`` and ``pause`` (``--slow-worker 1:1.5 --pause-worker 2:2:10``); '' for none."""
    words = [f"{SLOW_FLAG} {r}:{f:g}" for r, f in slow] + [f"{PAUSE_FLAG} {r}:{s:g}:{t:g}" for r, s, t in pause]
    return " ".join(words)


def check_workers(slow: Iterable, pause: Iterable, world: int | None = None,
                  names: tuple[str, str] = ("slow_workers", "pause_workers")):
    """The validated ``(slow, pause)`` as tuples of tuples (JSON's lists taken back): a rank >= 0 (< ``world``
    when given) named once per form, FACTOR >= 1, S > 0, T > 0. A ValueError names the flag (or field,
    ``names``), the entry and what is allowed."""
    slow_name, pause_name = names
    checked = []
    for name, entries, size in ((slow_name, slow, 2), (pause_name, pause, 3)):
        seen, out = set(), []
        for entry in entries:
            entry = tuple(entry)
            if len(entry) != size or isinstance(entry[0], bool) or not isinstance(entry[0], int):
                form = "(rank, factor)" if size == 2 else "(rank, seconds, every)"
                raise ValueError(f"{name}: each entry must be {form} with an int rank, got {entry!r}")
            rank, spec = entry[0], ":".join(f"{v:g}" if isinstance(v, float) else str(v) for v in entry)
            if rank < 0 or (world is not None and rank >= world):
                allowed = "an int >= 0" if world is None else f"0..{world - 1} (there are {world} workers)"
                raise ValueError(f"{name} {spec}: RANK must be {allowed}, got {rank}")
            if rank in seen:
                raise ValueError(f"{name} {spec}: rank {rank} is given twice; one entry per rank")
            seen.add(rank)
            values = tuple(float(v) for v in entry[1:])
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"{name} {spec}: the numbers must be finite, got {entry[1:]}")
            if size == 2 and not values[0] >= 1.0:
                raise ValueError(f"{name} {spec}: FACTOR must be >= 1 (1: no slowdown; 1.5: compute takes 1.5x "
                                 f"as long), got {values[0]:g}")
            if size == 3 and not (values[0] > 0 and values[1] > 0):
                raise ValueError(f"{name} {spec}: S and T must be > 0 seconds (a pause of S seconds every T "
                                 f"seconds of training), got S={values[0]:g}, T={values[1]:g}")
            out.append((rank, *values))
        checked.append(tuple(out))
    return checked[0], checked[1]


@dataclass
class Straggler:
    """One rank's slowdown and pauses, and what it applied; :meth:`after_backward` is the loop's one call.

    A rank named by neither flag gets one with ``factor=1`` and no pause: it sleeps never and counts its compute.
    ``sleep``: the sleeping function (tests pass a recorder)."""

    factor: float = 1.0
    """Compute takes this many times as long (``--slow-worker``)."""
    pause_s: float = 0.0
    """A pause of this many seconds ... (``--pause-worker``'s S; 0: none)."""
    every_s: float = 0.0
    """... every this many seconds of training time, the pauses not counted (T)."""
    sleep: Callable[[float], None] = time.sleep
    compute_s: float = 0.0
    """Forward + backward seconds measured so far."""
    slept_s: float = 0.0
    """Seconds of slowdown asked of ``sleep`` so far (:func:`slowdown_sleep` summed; pauses apart)."""
    paused_s: float = 0.0
    """Seconds of pauses so far."""
    pauses: int = 0
    """Pauses taken so far."""

    @classmethod
    def for_rank(cls, rank: int, slow: Iterable = (), pause: Iterable = (), **kw) -> "Straggler":
        """``rank``'s straggler from ``slow`` ((rank, factor) pairs) and ``pause`` ((rank, S, T) triples)."""
        factor = next((f for r, f in slow if r == rank), 1.0)
        pause_s, every_s = next(((s, t) for r, s, t in pause if r == rank), (0.0, 0.0))
        return cls(factor=factor, pause_s=pause_s, every_s=every_s, **kw)

    @property
    def active(self) -> bool:
        return self.factor != 1.0 or self.pause_s > 0

    def after_backward(self, compute_s: float, train_s: float) -> float:
        """Sleep what this step owes: the slowdown for a forward + backward of ``compute_s`` seconds, and the
        pauses due at ``train_s`` seconds of this rank's training (its steps so far, pauses included: they
        are taken out here). Returns the seconds slept."""
        self.compute_s += compute_s
        owed = slowdown_sleep(self.factor, compute_s) if self.factor != 1.0 else 0.0
        self.slept_s += owed
        if self.pause_s > 0:
            due = pauses_due(train_s - self.paused_s, self.every_s, self.pauses)
            self.pauses += due
            self.paused_s += due * self.pause_s
            owed += due * self.pause_s
        if owed > 0:
            self.sleep(owed)
        return owed

    def totals(self) -> dict:
        """What was applied: ``factor``, ``pause_s``, ``every_s``, ``compute_s``, ``slept_s`` (the slowdown),
        ``paused_s``, ``pauses``."""
        return dict(factor=self.factor, pause_s=self.pause_s, every_s=self.every_s, compute_s=self.compute_s,
                    slept_s=self.slept_s, paused_s=self.paused_s, pauses=self.pauses)
