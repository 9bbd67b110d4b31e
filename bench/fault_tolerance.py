"""What a lost replica costs: ``lioncub train --ft`` with and without failures, side by side.

Runs the fault-tolerant LocalCub (3 replica groups of one worker, or of ``--nproc-per-replica N`` ranks with the
model FSDP2-sharded over them; the comparison's LocalCub setting:
H = 50 AdamW steps at lr 1e-3, the 8-bit L1 lane mean with error feedback, Nesterov 0.7) behind an
emulated link (root; default 100 Mbit/s) for ``--budget`` seconds of training, alternating by seed:
failure-free, then with a replica killed (SIGKILL) every ``--kill-every`` seconds and restarted
``--restart-after`` seconds later. Each run is ``lioncub train --ft``'s own; this script only runs
them and gathers their ``ft_summary.json`` into one JSON with the comparison::

    {"command", "host", "runs": [{"seed", "kill_every", "summary", "kills", "restarts"}, ...],
     "compare": {"steps_per_s_kept", "replica_steps_per_s_kept", "val_loss": {...}, ...}}

    sudo OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.fault_tolerance            # ~4 min a run
    ... -m bench.fault_tolerance --method vote --warm-spare 2 --out bench/results/fault_tolerance_vote_spares.json
    ... -m bench.fault_tolerance --seeds 0 --budget 30 --model gpt-tiny --link none --out /tmp/ft.json
    ... -m bench.fault_tolerance --slow-worker 2:1.5 --out /tmp/ft_slow.json      # replica 2 1.5x slower
    ... -m bench.fault_tolerance --replicas 2 --nproc-per-replica 2 --kill-every 30 --budget 120   # groups of 2 ranks

``--slow-worker`` / ``--pause-worker`` (docs/stragglers.md) go to every run; each run's summary holds every
replica's compute and sleep (``straggler``).

Writes bench/results/fault_tolerance.json (bench/README.md, "A lost replica").
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from bench import _runner
from lioncub.testbed.straggler import add_arguments as add_straggler_arguments, format_specs, parse_flags


METHODS = {
    "localcub": [],  # lioncub train --ft's default: the comparison's LocalCub (H = 50)
    # short rounds of the 8-bit lane mean (first at r ≈ 9 in the races by regime): H = 10, outer SGD 1, AdamW lr 4e-3;
    # the lane mean, EF and AdamW are the comparison's LocalCub's too (a sum a quorum can leave a replica out of)
    "localcub-h10": ["--local-steps", "10", "--outer", "sgd", "--outer-lr", "1", "--lr", "4e-3"],
    "vote": ["--optimizer", "lioncub", "--vote", "pbit", "--local-steps", "1"],  # LionCub's vote every step
}
"""``--method``: the training options each adds to ``lioncub train --ft``."""


def local_steps(method: str) -> int:
    from lioncub.harness.compare import LOCALCUB

    options = METHODS[method]
    if "--local-steps" in options:
        return int(options[options.index("--local-steps") + 1])
    return LOCALCUB["local_steps"]


def run_argv(args, seed: int, kill_every: float, out: str) -> list[str]:
    argv = ["lioncub", "train", "--ft", *METHODS[args.method], "--model", args.model, "--budget", str(args.budget),
            "--seed", str(seed), "--replicas", str(args.replicas), "--kill-every", f"{kill_every:g}", "--restart-after",
            f"{args.restart_after:g}", "--heartbeat-ms", str(args.heartbeat_ms), "--out", out, "--no-progress"]
    min_replicas = args.min_replicas or (2 if args.replicas > 2 else 1)  # a kill must leave a quorum
    if min_replicas != 2:  # (2: lioncub train's own default)
        argv += ["--min-replicas", str(min_replicas)]
    if args.nproc_per_replica != 1:  # replica groups of many ranks, FSDP2 inside (each rank a shard)
        argv += ["--nproc-per-replica", str(args.nproc_per_replica)]
    if args.warm_spare:
        argv += ["--warm-spare", str(args.warm_spare)]
    if args.ft_timeout is not None:
        argv += ["--ft-timeout", f"{args.ft_timeout:g}"]
    if args.link != "none":
        argv += ["--link", args.link]
    argv += format_specs(args.slow_workers, args.pause_workers).split()  # the same in both runs of a seed
    return argv


def r_estimate(summary: dict, args, n_params: int) -> dict:
    """The regime r: a ring fp32 all-reduce of the gradient on this link over one inner step's compute
    (a round's time less its agreement, over H). P is the replica groups: with ``--nproc-per-replica N`` each rank
    of a group exchanges its shard (1/N of the model) with the same rank of the other groups, and the group's N
    ranks share its one link (one namespace), so the link carries the whole model, as with one worker; the
    compute is a group's step (its N ranks' batches, sharded)."""
    from lioncub.testbed import parse_rate

    H = local_steps(args.method)
    compute = (summary["round_s_median"] - summary["agree_s_median"]) / H
    if args.link in ("none", "unshaped"):
        return dict(compute_s=compute, allreduce_s=None, r=None)
    P = args.replicas
    wire = 2 * (P - 1) / P * 4 * n_params * 8 / parse_rate(args.link)[1]
    return dict(compute_s=compute, allreduce_s=wire, r=wire / compute)


def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return dict(mean=statistics.mean(xs), std=statistics.stdev(xs) if len(xs) > 1 else 0.0, n=len(xs))


def kill_to_join(run: dict) -> list:
    """Each kill to the commit at which that replica's next life joined (older records: its restart's delay plus
    the restart to that commit)."""
    s = run["summary"]
    if "kill_to_join_s" in s:
        return s["kill_to_join_s"]
    return [None if back is None else back + r["wall"] - k["wall"]
            for k, r, back in zip(run["kills"], run["restarts"], s["rejoin_s"])]


def table(result: dict) -> str:
    """The runs and their comparison as markdown (bench/README.md, "A lost replica")."""
    H = result.get("local_steps", 50)
    ranks = result.get("nproc_per_replica", 1)
    lines = [f"replica groups of {ranks} ranks (FSDP2 inside; a group's step is its {ranks} ranks' batches, counted "
             "once in replica-steps; a kill takes the whole group out)", ""] if ranks > 1 else []
    lines += ["| seed | kills | steps/s | replica-steps/s | round (agree) s | stall per failure mean / max s "
              "| kill to join s | uncommitted | lost/repeated rounds | identical | val loss |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        s = run["summary"]
        stall = (f"{s['stall_mean_s']:.2f} / {s['stall_max_s']:.2f}" if s["stall_mean_s"] is not None else "-")
        rejoin = [x for x in kill_to_join(run) if x is not None]
        rejoin = f"{statistics.mean(rejoin):.1f}" if rejoin else "-"
        lines.append(f"| {run['seed']} | {s['kills']} | {s['rounds_per_s'] * H:.2f} | {s['replica_rounds_per_s'] * H:.2f} "
                     f"| {s['round_s_median']:.2f} ({s['agree_s_median']:.2f}) | {stall} | {rejoin} | {s['uncommitted']} "
                     f"| {s['lost_or_repeated_rounds']} | {s['identical']} | {s['val_loss']:.4f} |")
    c = result["compare"]
    kept = ", ".join(f"{x:.3f}" for x in c["steps_per_s_kept"])
    work = ", ".join(f"{x:.3f}" for x in c["replica_steps_per_s_kept"])
    free, hit = c["val_loss"]["failure_free"], c["val_loss"]["with_failures"]
    lines += ["", f"steps/s kept with failures, seed by seed: {kept}; replica-steps/s kept: {work}",
              f"val loss: failure-free {free['mean']:.4f} ± {free['std']:.4f} (n={free['n']}), with failures "
              f"{hit['mean']:.4f} ± {hit['std']:.4f} (n={hit['n']})"]
    if c.get("regime"):
        g = c["regime"]
        lines.append(f"regime: compute {g['compute_s'] * 1e3:.0f} ms per step, an fp32 ring all-reduce of the gradient "
                     f"{g['allreduce_s'] * 1e3:.0f} ms on this link: r = {g['r']:.1f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=_runner.comma_list(int), default=[0, 1, 2])
    ap.add_argument("--budget", type=float, default=200.0, help="training seconds per run")
    ap.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills in the failure runs")
    ap.add_argument("--restart-after", type=float, default=5.0, help="seconds a killed replica stays down")
    ap.add_argument("--heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout")
    ap.add_argument("--replicas", type=int, default=3, help="replica groups")
    ap.add_argument("--min-replicas", type=int, default=None,
                    help="replica groups a round needs (default: 2, or 1 with --replicas 2: a kill leaves one)")
    ap.add_argument("--nproc-per-replica", type=int, default=1, metavar="N",
                    help="ranks per replica group (lioncub train --ft --nproc-per-replica N: FSDP2 over them; a kill "
                         "takes one rank and its whole group out)")
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--method", choices=sorted(METHODS), default="localcub",
                    help="localcub: the comparison's LocalCub (H = 50); localcub-h10: its short-round setting "
                         "(H = 10, outer SGD lr 1, AdamW 4e-3); vote: LionCub's every-step vote (pbit)")
    ap.add_argument("--ft-timeout", type=float, default=None, metavar="SECONDS",
                    help="a collective's time limit (lioncub train --ft-timeout; default: its own, 10 s)")
    ap.add_argument("--warm-spare", type=int, default=0, metavar="N",
                    help="warm spares per replica (lioncub train --ft --warm-spare N; 0: a killed replica restarts)")
    ap.add_argument("--link", default="100mbit", help="a rate, 'unshaped', or 'none' (loopback)")
    ap.add_argument("--out", default=os.path.join(_runner.RESULTS, "fault_tolerance.json"))
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    add_straggler_arguments(ap, rank="replica RANK")
    args = ap.parse_args(argv)
    try:
        args.slow_workers, args.pause_workers = parse_flags(args.slow_workers, args.pause_workers, world=args.replicas)
    except ValueError as exc:
        ap.error(str(exc))
    if args.report_only:
        with open(args.report_only) as f:
            print(table(json.load(f)))
        return

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for kill in (0.0, args.kill_every):
                out = os.path.join(tmp, f"s{seed}_k{kill:g}")
                argv = run_argv(args, seed, kill, out)
                print(" ".join(argv), flush=True)
                done = subprocess.run([sys.executable, "-m", "lioncub.cli", *argv[1:]], text=True,
                                      capture_output=True)
                print(done.stdout[-1500:], flush=True)
                if done.returncode:
                    raise SystemExit(f"run failed ({done.returncode}):\n{done.stderr[-3000:]}")
                with open(os.path.join(out, "ft_summary.json")) as f:
                    record = json.load(f)
                runs.append(dict(seed=seed, kill_every=kill, **record))
                result = dict(command=" ".join(run_argv(args, 0, args.kill_every, "OUT")), host=host_note(), runs=runs,
                              method=args.method, local_steps=local_steps(args.method), warm_spare=args.warm_spare,
                              nproc_per_replica=args.nproc_per_replica,
                              compare=compare(runs, args))
                _runner.write_json(args.out, result)
    print(table(result))


def host_note() -> dict:
    return dict(machine=platform.machine(), cpus=os.cpu_count(), python=platform.python_version(),
                load=os.getloadavg())


def compare(runs: list, args) -> dict:
    """Failures against none, seed by seed (the ratios) and over seeds (the losses)."""
    free = {r["seed"]: r["summary"] for r in runs if not r["kill_every"]}
    hit = {r["seed"]: r["summary"] for r in runs if r["kill_every"]}
    pairs = [(free[s], hit[s]) for s in sorted(free) if s in hit]
    n_params = 834_304 if args.model == "gpt-mini" else None
    out = dict(
        steps_per_s_kept=[b["rounds_per_s"] / a["rounds_per_s"] for a, b in pairs],
        replica_steps_per_s_kept=[b["replica_rounds_per_s"] / a["replica_rounds_per_s"] for a, b in pairs],
        val_loss=dict(failure_free=mean_std([s["val_loss"] for s in free.values()]),
                      with_failures=mean_std([s["val_loss"] for s in hit.values()])),
        stall_mean_s=mean_std([s["stall_mean_s"] for s in hit.values()]),
        stall_max_s=max([s["stall_max_s"] for s in hit.values() if s["stall_max_s"] is not None], default=None),
        lost_or_repeated_rounds=sum(s["lost_or_repeated_rounds"] for s in list(free.values()) + list(hit.values())),
        identical=all(s["identical"] for s in list(free.values()) + list(hit.values())),
        kills=sum(s["kills"] for s in hit.values()),
        uncommitted=sum(s["uncommitted"] for s in hit.values()))
    if n_params and free:
        out["regime"] = r_estimate(next(iter(free.values())), args, n_params)
    return out


if __name__ == "__main__":
    main()
