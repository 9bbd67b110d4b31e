"""Where a LocalCub round's time goes: each round method of every worker timed, the totals written at exit.

A diagnostic, not a benchmark of its own: put this directory first on ``PYTHONPATH`` of a ``bench.race`` run
and every worker process (Python imports ``sitecustomize`` at start-up) wraps LocalCub's round methods in a
timer and writes ``{method: [seconds, calls]}`` to ``$LIONCUB_ROUND_TIMERS/rank<R>_<pid>.json`` when it exits
(default directory /tmp/round_timers)::

    OMP_NUM_THREADS=1 PYTHONPATH=bench/round_timers:src python3 -m bench.race --layers 4 --heads 4 --embd 128 \\
        --block 64 --batch 3 --warmup 100 --schedule cosine --budget 30 --seeds 0 --rate 10mbit \\
        --methods lcub-smean4-h50-nest0.7-ef-adamw-stream-f10@1e-3 --target lcub-smean4-h50-nest0.7-ef-adamw-stream-f10 \\
        --out /tmp/timed_race.json

The timers add a few microseconds a call. Nothing is wrapped where lioncub cannot be imported.
"""
import atexit
import json
import os
import time
from collections import defaultdict

_TOTAL, _CALLS = defaultdict(float), defaultdict(int)
TIMED = {"StreamingRounds": ("_receive_pending", "_fragment_round", "_send_late", "_advance", "_stream_chunks"),
         "Rounds": ("_agree", "_send", "_measure", "_round"), "LocalCub": ("_inner_step",)}


def _wrap(cls, name: str) -> None:
    inner = getattr(cls, name)

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            _TOTAL[name] += time.perf_counter() - t0
            _CALLS[name] += 1

    setattr(cls, name, timed)


def _write() -> None:
    if not _CALLS:
        return
    out = os.environ.get("LIONCUB_ROUND_TIMERS", "/tmp/round_timers")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{os.environ.get('RANK', 'x')}_{os.getpid()}.json"), "w") as f:
        json.dump({k: [_TOTAL[k], _CALLS[k]] for k in _CALLS}, f)


try:
    from lioncub.optim import localcub, rounds, streaming
except ImportError:
    pass
else:
    for module, cls in ((streaming, "StreamingRounds"), (rounds, "Rounds"), (localcub, "LocalCub")):
        for name in TIMED[cls]:
            if hasattr(getattr(module, cls), name):
                _wrap(getattr(module, cls), name)
    atexit.register(_write)
