#!/usr/bin/env python3
"""bench/opt_step.py on two source trees, alternately, side by side in one run: the before/after
of a change to the optimizer's local work (median step ms per run, per method).

    git worktree add /tmp/before <commit>
    OMP_NUM_THREADS=1 python3 bench/opt_step_ab.py --before /tmp/before/src --after src --runs 5 \
        --out bench/results/opt_step_before_after_issue30.json

Run it alone on the machine: the table is only as good as the host is quiet.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def one(src: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "o.json")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(src), OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, os.path.join(HERE, "opt_step.py"), "--steps", str(steps), "--out", out],
                       env=env, check=True, capture_output=True, text=True)
        with open(out) as f:
            return json.load(f)


def median_step(run: dict) -> dict:
    """method -> the median step ms (opt_step.py's JSON holds seconds)."""
    return {label: 1000.0 * row["step"] for label, row in run.items() if isinstance(row, dict) and "step" in row}


def table(summary: dict) -> str:
    """Per method: the median step before and after, their ratio and the spread before (``main``'s JSON's
    ``methods``)."""
    lines = [f"{'method':10s} {'before ms (median of runs)':>28s} {'after':>8s} {'ratio':>6s} {'spread before':>14s}"]
    for m, s in summary.items():
        b = s["before_ms"]
        lines.append(f"{m:10s} {s['before_median']:28.1f} {s['after_median']:8.1f} {s['ratio']:6.2f} "
                     f"{min(b):6.1f}-{max(b):.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    ap.add_argument("--before", help="src/ of the tree before the change (required unless --report-only)")
    ap.add_argument("--after", help="src/ of the tree after it (required unless --report-only)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--note", default="", help="what, host load")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            print(table(json.load(f)["methods"]))
        return 0
    if not (args.before and args.after and args.out):
        ap.error("--before, --after and --out are required (or --report-only JSON)")
    runs = {"before": [], "after": []}
    for k in range(args.runs):
        for side in ("before", "after"):
            runs[side].append(median_step(one(getattr(args, side), args.steps)))
            print(f"run {k} {side}: " + ", ".join(f"{m} {v:.1f}" for m, v in runs[side][-1].items()), flush=True)
    methods = list(runs["after"][0])
    summary = {}
    for m in methods:
        b = [r[m] for r in runs["before"] if m in r]
        a = [r[m] for r in runs["after"]]
        summary[m] = {"before_ms": b, "after_ms": a, "before_median": statistics.median(b),
                      "after_median": statistics.median(a), "ratio": statistics.median(a) / statistics.median(b)}
    print(table(summary))
    with open(args.out, "w") as f:
        json.dump({"what": f"bench/opt_step.py --steps {args.steps}, {args.runs} runs alternately",
                   "note": args.note, "before_src": args.before, "after_src": args.after, "methods": summary},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
