"""What averaging inside nodes costs in convergence: flat LionCub against NodeCub (2 nodes x 2 ranks).

Four ``lioncub train`` runs of gpt-mini, one seed, one per (vote, layout): ``onebit`` and ``pbit``
(binary, ties -> 0), each flat (4 voters) and with ``--nodes 2`` (2 voters: the node mean, then the
vote across nodes). Each run is the harness's own loop (its schedule, loss and evaluation); this
script only runs them one after another and gathers what each run's directory recorded
(``metrics.jsonl``'s evaluations, ``summary.csv``'s final loss and bytes per step) into one JSON:

    {"command": the lioncub train command line ({a,b} marks what varies), "host": ...,
     "runs": [{"label", "vote", "nodes", "final_val_loss", "bytes_sent_per_step",
               "evals": [{"step", "val_loss"}, ...]}, ...]}

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.nodes_convergence            # 4 runs, hours on 2 cores
    ... -m bench.nodes_convergence --dry-run      # the JSON's command, then the four runs'; runs nothing
    ... -m bench.nodes_convergence --model gpt-tiny --steps 4 --eval-every 2 --out /tmp/nc.json   # seconds

Writes bench/results/nodes_convergence.json (bench/README.md, "What it costs in convergence").
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import tempfile

from bench import _runner


def _number(text: str) -> str:
    """An argparse ``type``: a float, kept as written (so the command line reads as given)."""
    float(text)
    return text


def train_argv(args, vote: str, nodes: int) -> list[str]:
    """The ``lioncub train`` arguments of one run (without ``--out``)."""
    return ["--model", args.model, "--block-size", str(args.block_size), "--batch-size", str(args.batch_size),
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps), "--lr", args.lr,
            "--weight-decay", str(args.weight_decay), "--vote", vote, "--nodes", str(nodes),
            "--nproc", str(args.nproc), "--eval-every", str(args.eval_every), "--eval-batches",
            str(args.eval_batches), "--no-compare", "--seed", str(args.seed)]


def command(args) -> str:
    """The runs as one command line, with ``{a,b}`` where the runs differ (the JSON's ``command``)."""
    line = train_argv(args, "{" + ",".join(args.votes) + "}", 0)
    line[line.index("--nodes") + 1] = "{" + ",".join(str(n) for n in args.nodes) + "}"
    return " ".join(["lioncub", "train", *line])


def read_run(run_dir: str, vote: str, nodes: int) -> dict:
    """One run's record out of its run directory (what ``lioncub train`` wrote there)."""
    from lioncub.harness.metrics import read_jsonl

    with open(os.path.join(run_dir, "summary.csv"), newline="") as f:
        summary = next(csv.DictReader(f))
    evals = [{"step": r["step"], "val_loss": r["val_loss"]}
             for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "eval"]
    return {"label": summary["label"], "vote": vote, "nodes": nodes,
            "final_val_loss": float(summary["final_val_loss"]),
            "bytes_sent_per_step": float(summary["bytes_sent_per_step"]), "evals": evals}


def table(res: dict) -> str:
    """Validation loss at each evaluation and bytes per rank per step, one row per run (bench/README.md's
    "What it costs in convergence")."""
    steps = [e["step"] for e in res["runs"][0]["evals"]]
    lines = ["| vote | layout | " + " | ".join(f"val @ {s}" for s in steps) + " | bytes sent per rank per step |",
             "|---|---|" + "---|" * len(steps) + "---|"]
    for r in res["runs"]:
        layout = "flat" if r["nodes"] == 1 else f"{r['nodes']} nodes"
        vals = " | ".join(f"{e['val_loss']:.3f}" for e in r["evals"])
        lines.append(f"| `{r['vote']}` | {layout} | {vals} | {r['bytes_sent_per_step'] / 1e3:.0f} KB |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--votes", type=_runner.comma_list(str), default=["onebit", "pbit"], help="comma list")
    ap.add_argument("--nodes", type=_runner.comma_list(int), default=[1, 2], help="comma list (1 = flat)")
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=3, help="sequences per worker")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--lr", type=_number, default="1e-4", help="passed on as written")
    ap.add_argument("--weight-decay", type=float, default=1.0)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs-dir", help="keep each run's directory here (default: a temporary directory)")
    ap.add_argument("--out", default=os.path.join(_runner.RESULTS, "nodes_convergence.json"))
    ap.add_argument("--dry-run", action="store_true", help="print the JSON's command, then each run's; run nothing")
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    args = ap.parse_args(argv)
    if args.report_only:
        print(table(_runner.read_json(args.report_only)))
        return 0
    grid = [(vote, nodes) for vote in args.votes for nodes in args.nodes]
    if args.dry_run:
        print(command(args))
        for vote, nodes in grid:
            print(" ".join(["lioncub", "train", *train_argv(args, vote, nodes)]))
        return 0
    import torch

    from lioncub import cli

    runs = []
    with tempfile.TemporaryDirectory(prefix="lcb-nodes-conv-") as tmp:
        for vote, nodes in grid:
            run_dir = os.path.join(args.runs_dir or tmp, f"{vote}-{nodes}nodes")
            code = cli.main(["train", *train_argv(args, vote, nodes), "--out", run_dir, "--no-progress"])
            if code:
                print(f"lioncub train --vote {vote} --nodes {nodes} exited {code}", file=sys.stderr)
                return code
            runs.append(read_run(run_dir, vote, nodes))
    host = f"{os.cpu_count()}-core {platform.machine()} host, torch {torch.__version__}, gloo"
    _runner.write_json(args.out, {"command": command(args), "host": host, "runs": runs})
    print(table({"runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
