"""Step time with the vote overlapped with backward (issue 6), on an emulated 1 Gbit/s cluster.

4 workers in a :class:`lioncub.testbed.Testbed` (prefix ``lco``) train a GPT from
:mod:`lioncub.harness.models.gpt`. Per Lion Cub method and ``bucket_mb``, in rounds
that interleave the four measurements (so host load drifts hit all of them alike):

    compute   forward + backward alone (no vote)
    comm      the votes alone: :func:`lioncub.majority_vote` on random c, message by message
              (pack + collective + unpack/vote, the sizes of the step's messages)
    no ovl    LionCub(overlap=False): forward + backward + step
    overlap   LionCub(overlap=True):  votes launched from backward hooks, step waits

Each round's time is its slowest rank's; the table shows medians over rounds, against
``max(compute, comm)`` (perfect overlap) and ``compute + comm`` (none), and the share of
``min(compute, comm)`` the overlap recovered: ``(no ovl − overlap) / min(compute, comm)``.
``rest`` = no ovl − compute − comm: the step's local math (c, θ/m updates) and rank skew.

    sudo OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.overlap            # ~6 min
    ... -m bench.overlap --loopback     # no namespaces: unshaped loopback (says so)
Writes bench/results/overlap.json. Needs root for the testbed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench import _runner

METHODS = {"pbit 4": dict(vote="pbit", bits=4), "onebit": dict(vote="onebit")}
KINDS = ("compute", "comm", "no_overlap", "overlap")


def worker(args, out_dir: str) -> None:
    """One rank: for each method and bucket size, ``warmup + rounds`` rounds of the four timings."""
    import torch
    import torch.distributed as dist

    from lioncub import majority_vote
    from lioncub.optim.flags import flat_lioncub as LionCub
    from lioncub.comm import CommStats

    rank = _runner.init_worker()
    x = _runner.tokens(args, rank)
    out = {"runs": []}
    for label in args.methods.split(","):
        for bucket in [float(b) for b in args.buckets.split(",")]:
            model = _runner.gpt(args)
            params = list(model.parameters())
            kw = dict(lr=1e-4, bucket_mb=bucket, **METHODS[label])
            plain, ovl = LionCub(params, **kw), LionCub(params, overlap=True, **kw)
            sizes = [b.numel for b in plain.buckets]
            gen = torch.Generator().manual_seed(rank)
            # what the step without overlap sends: its messages (several buckets each)
            cs = [torch.randn(s, generator=gen) for s in plain.message_elements()]
            times = {k: [] for k in KINDS}

            def timed(kind, fn):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[kind].append(time.perf_counter() - t0)

            def backward():
                model(x, x)[1].backward()

            def votes():
                for c in cs:
                    majority_vote(c, method=plain.vote, bits=plain.bits, quantizer=plain.quantizer,
                                  step=plain.steps, tie=plain.tie, stats=CommStats(), generator=plain.generator,
                                  out=c)

            for _ in range(args.warmup + args.rounds):
                for kind in KINDS:
                    model.zero_grad(set_to_none=False)
                    if kind == "compute":
                        with ovl.no_sync():
                            timed(kind, backward)
                    elif kind == "comm":
                        timed(kind, votes)
                    elif kind == "no_overlap":
                        with ovl.no_sync():
                            timed(kind, lambda: (backward(), plain.step()))
                    else:
                        timed(kind, lambda: (backward(), ovl.step()))
            ovl.remove_hooks()
            out["runs"].append({"method": label, "bucket_mb": bucket, "sizes": sizes,
                                "times": {k: v[args.warmup:] for k, v in times.items()}})
            model = plain = ovl = params = None  # free them (the closures above read these names)
    _runner.finish(out_dir, out)


def summarise(ranks: list[dict]) -> list[dict]:
    """Per run: median over rounds of each round's slowest rank, and the derived figures."""
    rows = []
    for i, run in enumerate(ranks[0]["runs"]):
        row = {"method": run["method"], "bucket_mb": run["bucket_mb"], "n_buckets": len(run["sizes"]),
               "n": sum(run["sizes"])}
        for k in KINDS:
            per_round = zip(*(r["runs"][i]["times"][k] for r in ranks))
            row[k] = statistics.median(max(t) for t in per_round)
        comp, comm = row["compute"], row["comm"]
        row["ideal"], row["serial"] = max(comp, comm), comp + comm
        row["rest"] = row["no_overlap"] - row["serial"]  # the step's local math (c, apply) and rank skew
        row["recovered"] = (row["no_overlap"] - row["overlap"]) / min(comp, comm)
        row["speedup"] = row["no_overlap"] / row["overlap"]
        rows.append(row)
    return rows


def table(rows: list[dict], where: str) -> str:
    lines = [where, f"{'method':8s} {'bucket':>6s} {'#b':>3s} {'compute':>8s} {'comm':>7s} {'no ovl':>7s} "
                    f"{'overlap':>8s} {'max()':>7s} {'sum':>7s} {'rest':>6s} {'x':>5s} {'recov':>6s}"]
    for r in rows:
        lines.append(f"{r['method']:8s} {r['bucket_mb']:6g} {r['n_buckets']:3d} {r['compute']:8.3f} "
                     f"{r['comm']:7.3f} {r['no_overlap']:7.3f} {r['overlap']:8.3f} {r['ideal']:7.3f} "
                     f"{r['serial']:7.3f} {r['rest']:6.3f} {r['speedup']:5.2f} {100 * r['recovered']:5.0f}%")
    return "\n".join(lines)


def run(args, argv: list[str]) -> dict:
    """The workers' records (on the testbed, or on loopback when asked or when it is unavailable)
    and their summary. ``argv``: the command line, passed on to every rank."""
    from lioncub.testbed import check_available

    reason = None if args.loopback else check_available()
    ran = _runner.launch("bench.overlap", argv, args.workers, prefix="lco", rate=args.rate,
                         loopback=args.loopback or reason is not None)
    where = f"LOOPBACK (unshaped; testbed unavailable: {reason})" if reason else ran.where
    return {"where": where, "workers": args.workers, "wall_s": ran.wall_s, "rows": summarise(ran.ranks),
            "per_rank": ran.ranks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--loopback", action="store_true", help="skip the testbed (unshaped loopback)")
    ap.add_argument("--methods", default="pbit 4,onebit")
    ap.add_argument("--buckets", default="1,4,25", help="bucket_mb values, comma list")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds per method and bucket size")
    ap.add_argument("--warmup", type=int, default=1)
    _runner.add_gpt_args(ap, layers=4, embd=512, tokens=8)
    ap.add_argument("--out", default=os.path.join(_runner.RESULTS, "overlap.json"))
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    _runner.add_worker_args(ap)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.report_only:
        res = _runner.read_json(args.report_only)
        print(table(res["rows"], res["where"]))
        return 0
    if args.worker:
        worker(args, args.out_dir)
        return 0
    res = run(args, argv)
    print(table(res["rows"], res["where"]) + f"\nwall {res['wall_s']:.0f} s, load {os.getloadavg()[0]:.1f}")
    _runner.write_json(args.out, {"args": vars(args), "load_avg": os.getloadavg(), **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
