"""What starting a group of local workers costs: ``spawn`` against ``forkserver`` (tests/dist.py's way).

Each call of :func:`lioncub.testbed.launch.spawn` starts ``nproc`` gloo workers that do what most
distributed tests do first: build a ``torch.optim`` optimizer (torch then imports ``torch._dynamo``)
and run one all-reduce. Timed wall-clock per call, after one warm-up call (the forkserver's own start
and the C loops' build are paid there). Writes ``bench/results/worker_start.json`` and ``.md``.

    python3 -m bench.worker_start            # 2 and 4 workers, 5 calls each, both methods
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import _runner

OUT = Path(__file__).resolve().parent / "results"


def _work(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    p = torch.nn.Parameter(torch.ones(4))
    torch.optim.SGD([p], lr=0.1)  # the lazy torch._dynamo import every optimizer triggers
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _measure(method: str, sizes: list[int], calls: int) -> dict:
    """One method in this process (a forkserver's preload is per process)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lioncub.testbed.launch import spawn

    if method == "forkserver":
        from tests import dist as tests_dist  # its PRELOAD and server start, exactly as the suite does

        tests_dist._start_server()
    spawn(_work, 2, timeout_s=60, start_method=method)  # warm-up
    out = {}
    for n in sizes:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            assert spawn(_work, n, timeout_s=60, start_method=method) == [float(n)] * n
            times.append(time.perf_counter() - t0)
        out[str(n)] = dict(median_s=statistics.median(times), min_s=min(times), max_s=max(times))
    return out


def table(record: dict) -> list[str]:
    """Markdown: the median start of a group by size, spawn against the forkserver (``main``'s JSON)."""
    lines = [f"Starting {record['calls']} groups each (an optimizer and one all-reduce per worker), {record['cpus']} "
             f"cores, load at start {record['load_at_start'][0]:.2f}", "",
             "| workers | spawn (median s) | forkserver (median s) | ratio |", "|---|---|---|---|"]
    rows = record["results"]
    for n in rows["spawn"]:
        s, f = rows["spawn"][n]["median_s"], rows["forkserver"][n]["median_s"]
        lines.append(f"| {n} | {s:.2f} | {f:.2f} | {s / f:.0f}x |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--method", choices=("spawn", "forkserver"), help=argparse.SUPPRESS)  # one method, as a child
    ap.add_argument("--out", default=str(OUT / "worker_start"))
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    a = ap.parse_args(argv)
    if a.report_only:
        print("\n".join(table(json.loads(Path(a.report_only).read_text()))))
        return 0
    sizes = [int(x) for x in a.sizes.split(",")]
    if a.method:
        print(json.dumps(_measure(a.method, sizes, a.calls)))
        return 0
    load = os.getloadavg()
    rows = {}
    for method in ("spawn", "forkserver"):
        proc = subprocess.run([sys.executable, "-m", "bench.worker_start", "--method", method, "--sizes", a.sizes,
                               "--calls", str(a.calls)], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, OMP_NUM_THREADS="1"))
        rows[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    record = dict(load_at_start=load, cpus=os.cpu_count(), calls=a.calls, results=rows)
    _runner.write_record(a.out, record, table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
