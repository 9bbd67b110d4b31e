"""Per-method cost of one vote on a large bucket: bytes and time split.

4 gloo workers on loopback (unshaped: this is the CPU floor, not a slow network;
see bench/net_probe.py and the step-time table for shaped links). For every vote
method, each rank votes on its own ~25M-element fp32 bucket a few times; we report
the median over repetitions of the slowest rank's times, split into
quantize+pack / collective / unpack+vote, the bytes sent per rank per step (our
accounting) and the α-β model's bytes (lioncub.engine.cost.predicted_bytes).

    python bench/vote_bench.py [--n 25000000] [--world 4] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

CONFIGS = [  # (label, method, kwargs)
    ("grad fp32 allreduce", "grad", dict(dtype=torch.float32)),
    ("grad bf16 allreduce", "grad", dict(dtype=torch.bfloat16)),
    ("sign_allreduce int8", "sign_allreduce", {}),
    ("gather 1-bit", "gather", {}),
    ("onebit all_to_all", "onebit", {}),
    ("pbit binary (4-bit lanes)", "pbit", {}),
    ("pbit l1 8-bit lanes", "pbit", dict(bits=8, quantizer="l1")),
]


def _worker(rank, world, n, reps, out):  # one CPU thread, in a gloo group (the launcher's default)
    from lioncub.comm import CommStats, all_reduce
    from lioncub.engine.cost import predicted_bytes
    from lioncub.votes.api import majority_vote

    g = torch.Generator().manual_seed(rank)
    c = torch.distributions.Laplace(0.0, 1.0).sample((n,))
    rows = []
    for label, method, kw in CONFIGS:
        samples = []
        for rep in range(reps + 1):  # first rep warms up
            stats = CommStats()
            dist.barrier()
            t0 = time.perf_counter()
            if method == "grad":
                t1 = time.perf_counter()
                buf = c.to(kw["dtype"])
                stats.t_quantize_pack += time.perf_counter() - t1
                all_reduce(buf, None, stats)
                t1 = time.perf_counter()
                buf = buf.float().div_(world)
                stats.t_unpack_vote += time.perf_counter() - t1
            else:
                majority_vote(c, method=method, step=rep, stats=stats, generator=g, **kw)
            total = time.perf_counter() - t0
            if rep:
                samples.append((total, stats))
        # the step takes as long as its slowest rank: take the max over ranks per rep
        times = torch.tensor([[s[0], s[1].t_quantize_pack, s[1].t_collective, s[1].t_unpack_vote]
                              for s in samples], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        med = times.median(dim=0).values.tolist()
        pred_kw = dict(grad_dtype="bf16" if kw.get("dtype") == torch.bfloat16 else "fp32") if method == "grad" \
            else {k: v for k, v in kw.items()}
        pred = predicted_bytes(method, n, world, **pred_kw)
        rows.append(dict(method=label, name=method, total_s=med[0], quantize_pack_s=med[1],
                         collective_s=med[2], unpack_vote_s=med[3],
                         bytes_sent=samples[-1][1].bytes_sent, model_bytes=pred["bytes_sent"]))
    if rank == 0:
        Path(out).write_text(json.dumps(dict(n=n, world=world, reps=reps, rows=rows), indent=2))
    dist.destroy_process_group()


def table(res: dict) -> str:
    """Per method: bytes sent against fp32's and the time split, from ``main``'s JSON."""
    base = res["rows"][0]
    lines = [f"n={res['n']:,} elements, {res['world']} gloo workers on loopback, median of {res['reps']} (slowest rank)",
             f"{'method':28s} {'MB sent':>9s} {'model MB':>9s} {'vs fp32':>8s} {'total ms':>9s} "
             f"{'q+pack':>8s} {'coll':>8s} {'unpack+vote':>11s}"]
    for r in res["rows"]:
        lines.append(f"{r['method']:28s} {r['bytes_sent'] / 1e6:9.2f} {r['model_bytes'] / 1e6:9.2f} "
                     f"{base['bytes_sent'] / r['bytes_sent']:7.1f}x {r['total_s'] * 1e3:9.1f} "
                     f"{r['quantize_pack_s'] * 1e3:8.1f} {r['collective_s'] * 1e3:8.1f} {r['unpack_vote_s'] * 1e3:11.1f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=25_000_000, help="elements in the bucket")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vote_bench.json"))
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    args = ap.parse_args(argv)
    if args.report_only:
        print(table(json.loads(Path(args.report_only).read_text())))
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from lioncub.testbed.launch import spawn

    spawn(_worker, args.world, args.n, args.reps, args.out, timeout_s=1800.0, deadline_s=float("inf"))
    print(table(json.loads(Path(args.out).read_text())))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
