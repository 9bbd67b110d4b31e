"""Where a worker's CPU goes in each step: a method's forward and backward, its optimizer step, and inside a
LocalCub step the round's ends and the inner step's finite check, in thread CPU time (issue 65's step rate).

``P`` gloo workers (default 4) on this host each train the race's GPT (``bench.race``'s model flags) on random
tokens for ``--steps`` steps, one method at a time, and time their main thread (``time.thread_time``: its own CPU,
not the time it waited for a core or a peer) around ``backward`` and ``step``; inside the step, around LocalCub's
``_round_ends`` (every round's and fragment's end: measure, agree, exchange, receive) and
:func:`lioncub.engine.guard.grads_finite` (the check every inner step makes). The first ``--skip`` steps are not
counted. The gloo threads' own CPU is not in these figures (about 1% of a core each when last looked at with
``ps -L``). On 2 cores with 4 workers every extra millisecond of a step's CPU costs the step rate what it costs the
computation: the step rate relative to the first method is about ``its CPU / this CPU``.

    OMP_NUM_THREADS=1 python3 -m bench.round_cpu          # ~4 min alone: no communication, blocking, streamed

Writes ``bench/results/round_cpu.json`` and ``.md`` (``--out``); ``--report-only JSON`` prints an earlier table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench import _runner

OUT = Path(__file__).resolve().parent / "results" / "round_cpu"
METHODS = ("compute-adamw-h50@2e-3,lcub-smean2-h15-sgd1-ef-adamw@4e-3,"
           "lcub-smean2-h15-sgd1-ef-adamw-stream-f5@4e-3")


def _timed(acc: dict, key: str, fn):
    """``fn`` with its thread CPU added to ``acc[key]`` (seconds)."""
    def timed(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] = acc.get(key, 0.0) + time.thread_time() - t0
    return timed


def _worker(rank: int, world: int, name: str, lr: float, model: dict, steps: int, skip: int) -> dict:
    import torch

    from lioncub import baselines
    from lioncub.engine import guard
    from lioncub.harness.models.gpt import GPT, GPTConfig
    from lioncub.optim import streaming

    parts: dict = {}  # (the class attribute and the module function, wrapped in this worker process only)
    streaming.StreamingRounds._round_ends = _timed(parts, "round_ends", streaming.StreamingRounds._round_ends)
    guard.grads_finite = _timed(parts, "finite_check", guard.grads_finite)
    torch.manual_seed(0)
    shape = {k: v for k, v in model.items() if k != "batch"}
    method = baselines.build(name, GPT(GPTConfig(vocab_size=65, **shape)), lr=lr)
    gen = torch.Generator().manual_seed(rank)
    fwd_bwd, step = [], []
    for i in range(steps):
        if i == skip:
            parts.clear()
        x, y = (torch.randint(0, 65, (model["batch"], model["block_size"]), generator=gen) for _ in range(2))
        t0 = time.thread_time()
        method.backward(x, y)
        t1 = time.thread_time()
        method.step(lr)
        t2 = time.thread_time()
        if i >= skip:
            fwd_bwd.append(t1 - t0)
            step.append(t2 - t1)
    n = steps - skip
    return dict(fwd_bwd_ms=1e3 * sum(fwd_bwd) / n, step_ms=1e3 * sum(step) / n,
                step_median_ms=1e3 * statistics.median(step), **{f"{k}_ms": 1e3 * v / n for k, v in parts.items()})


def _measure(name: str, lr: float, model: dict, workers: int, steps: int, skip: int) -> dict:
    from lioncub.testbed.launch import spawn

    ranks = spawn(_worker, workers, name, lr, model, steps, skip, timeout_s=300)
    keys = sorted({k for r in ranks for k in r})
    return dict(method=name, lr=lr, **{k: statistics.fmean(r.get(k, 0.0) for r in ranks) for k in keys},
                by_rank=ranks)


def table(record: dict) -> list[str]:
    """Markdown: each method's CPU per step (mean over workers), and its step's CPU relative to the first row's."""
    rows = record["rows"]
    base = rows[0]["fwd_bwd_ms"] + rows[0]["step_ms"]
    lines = [f"{record['workers']} workers on {record['cpus']} cores, {record['steps']} steps ({record['skip']} not "
             f"counted), thread CPU ms per step, mean over workers, median of {record.get('repeats', 1)} runs; load "
             f"before {record['load_before'][0]:.2f}", "",
             "| method | fwd+bwd | optimizer step | of it: round ends | of it: finite check | step CPU | rate vs row 1 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        total = r["fwd_bwd_ms"] + r["step_ms"]
        lines.append(f"| {r['method']} | {r['fwd_bwd_ms']:.2f} | {r['step_ms']:.2f} | {r.get('round_ends_ms', 0):.2f} | "
                     f"{r.get('finite_check_ms', 0):.2f} | {total:.2f} | {base / total:.2f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=METHODS, help="comma list of NAME@LR (lioncub.baselines); the first is "
                                                        "the reference row")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="runs of every method, round robin; the table's figures "
                                                          "are each method's medians over them")
    _runner.add_race_model_args(ap)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    a = ap.parse_args(argv)
    if a.report_only:
        print("\n".join(table(json.loads(Path(a.report_only).read_text()))))
        return 0
    if not 0 <= a.skip < a.steps:
        raise SystemExit(f"--skip must be at least 0 and below --steps={a.steps}, got {a.skip}")
    if a.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {a.repeats}")
    model = dict(n_layer=a.layers, n_head=a.heads, n_embd=a.embd, block_size=a.block, batch=a.batch)
    load = os.getloadavg()
    methods = []
    for item in a.methods.split(","):
        name, _, lr = item.partition("@")
        if not lr:
            raise SystemExit(f"--methods: each entry is NAME@LR, got {item!r}")
        methods.append((name, float(lr)))
    runs = [_measure(name, lr, model, a.workers, a.steps, a.skip)
            for _ in range(a.repeats) for name, lr in methods]  # (round robin: a slow minute hits every method)
    rows = []
    for name, lr in methods:
        mine = [r for r in runs if r["method"] == name and r["lr"] == lr]
        keys = [k for k in mine[0] if k.endswith("_ms")]
        rows.append(dict(method=name, lr=lr, **{k: statistics.median(r.get(k, 0.0) for r in mine) for k in keys}))
    record = dict(load_before=load, cpus=os.cpu_count(), workers=a.workers, steps=a.steps, skip=a.skip,
                  repeats=a.repeats, model=model, torch_threads=os.environ.get("OMP_NUM_THREADS"), rows=rows,
                  runs=runs)
    _runner.write_record(a.out, record, table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
