"""The step-matched grid of LocalCub configurations (issue 15): three ``bench.race --steps`` runs, one JSON.

Every configuration trains gpt-mini (4 layers x 128, block 64, 3 sequences x 4 workers) for the
same number of steps (``--steps 1000``: each run ends at its first sync point at or after it) on
unshaped testbed links, seed 0, lr 1e-4 for the Lion family and 1e-3 for the AdamW family, and is
evaluated once at the end: the loss per step, which the host's load does not move. The three
grids are the three invocations the study ran; each keeps its race arguments and its runs:

    {"what": ..., "grids": [{"name", "args" (the race's), "runs" (the race's records)}, ...]}

    sudo OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.local_grid             # ~1.5 h on 2 cores
    ... -m bench.local_grid --dry-run       # the three bench.race command lines; runs nothing
    ... -m bench.local_grid --grids grid3 --steps 2 --workers 2 --layers 1 --embd 32 --out /tmp/g.json

Writes bench/results/local_grid.json (bench/README.md, "Step-matched grid"). Needs root (the testbed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from bench import _runner

GRIDS = {  # name -> (what it asks, the methods of its invocation)
    "grid1": ("sign votes", "lion-ddp,diloco-h50,lcub-onebit-h10-nest1,lcub-onebit-h10-nest3,lcub-onebit-h10-nest7,"
              "lcub-onebit-h10-nest3-ef,lcub-onebit-h10-sgd10,lcub-onebit-h10-lion10"),
    "grid2": ("mean lanes at H=10", "lcub-mean8-h10-nest0.7-ef,lcub-mean8-h10-nest0.7-ef-adamw,"
              "lcub-mean4-h10-nest0.7-ef-adamw,lcub-grad-h10-nest0.7,lcub-onebit-h10-nest0.3-ef,diloco-h10,"
              "lcub-mean4-h50-nest0.7-ef-adamw"),
    "grid3": ("per-tensor scale, clip at 4 mean magnitudes; sanity: grad vote = DiLoCo",
              "diloco-h50,lcub-grad-h50-nest0.7-adamw,lcub-mean8-h50-nest0.7-ef-adamw,lcub-mean4-h50-nest0.7-ef-adamw"),
}


def race_argv(args, name: str, out: str) -> list[str]:
    """The ``bench.race`` arguments of grid ``name``."""
    return ["--methods", GRIDS[name][1], "--steps", str(args.steps), "--rate", "none", "--workers", str(args.workers),
            "--layers", str(args.layers), "--heads", str(args.heads), "--embd", str(args.embd),
            "--block", str(args.block), "--batch", str(args.batch), "--lr-lion", "1e-4", "--lr-adamw", "1e-3",
            "--warmup", "10", "--eval-every", "1000", "--eval-batches", "2", "--seeds", "0", "--out", out]


def table(res: dict) -> str:
    """Validation loss at the end of each run of each grid (rank 0's records), as bench/README.md shows it."""
    lines = ["| grid | method | lr | val @ end | steps |", "|---|---|---|---|---|"]
    for grid in res["grids"]:
        for r in grid["runs"]:
            last = r["evals"][-1]
            lines.append(f"| {grid['name'].split()[0]} | {r['method']} | {r['lr']:g} | {last['val']:.3f} | {last['step']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grids", type=_runner.comma_list(str), default=list(GRIDS), help=f"comma list of {list(GRIDS)}")
    ap.add_argument("--steps", type=int, default=1000)
    _runner.add_race_model_args(ap)
    ap.add_argument("--out", default=os.path.join(_runner.RESULTS, "local_grid.json"))
    ap.add_argument("--dry-run", action="store_true", help="print the bench.race command lines; run nothing")
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    args = ap.parse_args(argv)
    if args.report_only:
        print(table(_runner.read_json(args.report_only)))
        return 0
    unknown = [g for g in args.grids if g not in GRIDS]
    if unknown:
        ap.error(f"--grids must be among {list(GRIDS)}, got {unknown}")
    if args.dry_run:
        for name in args.grids:
            print(" ".join(["python3", "-m", "bench.race", *race_argv(args, name, f"{name}.json")]))
        return 0
    from bench import race

    grids = []
    with tempfile.TemporaryDirectory(prefix="lcb-grid-") as d:
        for name in args.grids:
            out = os.path.join(d, f"{name}.json")
            code = race.main(race_argv(args, name, out))
            with open(out) as f:
                res = json.load(f)
            grids.append({"name": f"{name} ({GRIDS[name][0]})", "args": res["args"], "runs": res["runs"]})
            if code:
                print(f"{name}: a worker failed; its finished runs are kept", file=sys.stderr)
    what = (f"step-matched grid of LocalCub configurations (bench.race --steps {args.steps} --rate none), GPT "
            f"{args.layers}x{args.embd}, block {args.block}, {args.batch} sequences x {args.workers} workers, lr 1e-4 "
            "Lion family / 1e-3 AdamW family, seed 0 (losses do not depend on the host's load, s/step does)")
    _runner.write_json(args.out, {"what": what, "grids": grids})
    print(table({"grids": grids}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
