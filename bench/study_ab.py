"""The study's seed-0 records reproduced bit for bit by two trees (issue 64: the new API against the code before it).

Runs the study's runs for Lion, the 1-bit vote and the 1-bit mean (``bench.study``'s ``recipe`` and ``ablate``
parts, seed 0, the recipe's shape with ``--steps`` steps) once from ``--before`` (a git worktree of the older
commit) and once from ``--after`` (default: this tree), each in its own process with that tree's ``src`` and
``bench`` first on the path, on the same host; then compares every record's curve, final loss and last 20 training
losses for exact equality and writes both plus the verdict to ``--out``::

    git worktree add /tmp/before64 2c52b6f
    OMP_NUM_THREADS=1 python3 bench/study_ab.py --before /tmp/before64 --steps 100
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

LABELS = ("Lion lr=0.0001 wd=1", "1-bit (onebit)", "1-bit mean, Lion on a shared momentum (onebit-mean)")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import os, sys
tree, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path[:0] = [os.path.join(tree, "src"), tree]
from bench import study_plan, study
study_plan.RECIPE["steps"] = steps
if __name__ == "__main__":
    study.run_study(["recipe", "ablate"], [0], out=out, only=set(sys.argv[4].split(";")), recipe_steps=steps,
                    eval_every=25)
"""


def run_tree(tree: str, steps: int, workdir: str) -> dict:
    out = os.path.join(workdir, f"{abs(hash(tree))}.jsonl")
    child = os.path.join(workdir, "child.py")
    with open(child, "w") as f:
        f.write(_CHILD)
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "src") + os.pathsep + tree)
    subprocess.run([sys.executable, child, tree, out, str(steps), ";".join(LABELS)], env=env, cwd=workdir,
                   check=True)
    with open(out) as f:
        return {r["label"]: r for r in map(json.loads, f)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a worktree of the older commit (required unless --report-only)")
    ap.add_argument("--after", default=HERE)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(HERE, "bench", "results", "study_ab_issue64.json"))
    ap.add_argument("--report-only", metavar="JSON", help="print the verdict of a study_ab JSON; run nothing")
    a = ap.parse_args(argv)
    if a.report_only:
        with open(a.report_only) as f:
            res = json.load(f)
        report(res)
        return 0
    if a.before is None:
        ap.error("--before is required (a worktree of the older commit)")
    with tempfile.TemporaryDirectory() as d:
        before, after = run_tree(os.path.abspath(a.before), a.steps, d), run_tree(os.path.abspath(a.after), a.steps, d)
    keys = ("curve", "final", "train_loss_last20")
    verdict = {k: all(before[k][x] == after.get(k, {}).get(x) for x in keys) for k in LABELS}
    with open(a.out, "w") as f:
        commit = {k: subprocess.run(["git", "-C", t, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
                  for k, t in (("before", a.before), ("after", a.after))}
        json.dump(dict(steps=a.steps, before=a.before, after=a.after, commits=commit, identical=verdict, before_runs=before,
                       after_runs=after), f, indent=1)
    with open(a.out) as f:
        report(json.load(f))
    print(f"wrote {a.out}")
    return 0 if all(verdict.values()) else 1


def report(res: dict) -> None:
    """The verdict table of a study_ab JSON."""
    print(f"| run ({res['steps']} steps, seed 0) | before {res['commits']['before'][:7]} | after "
          f"{res['commits']['after'][:7]} | bit-identical |\n|---|---|---|---|")
    for k, same in res["identical"].items():
        b, a = res["before_runs"][k]["final"]["val_loss"], res["after_runs"][k]["final"]["val_loss"]
        print(f"| {k} | {b:.6f} | {a:.6f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    sys.exit(main())
