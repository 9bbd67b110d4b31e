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

    sudo OMP_NUM_THREADS=1 PYTHONPATH=src python3 bench/overlap.py            # ~6 min
    ... bench/overlap.py --loopback     # no namespaces: unshaped loopback (says so)
Writes bench/results/overlap.json. Needs root for the testbed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = {"pbit 4": dict(vote="pbit", bits=4), "onebit": dict(vote="onebit")}
KINDS = ("compute", "comm", "no_overlap", "overlap")


def worker(args, out_dir: str) -> None:
    """One rank: for each method and bucket size, ``warmup + rounds`` rounds of the four timings."""
    import datetime

    import torch
    import torch.distributed as dist

    from lioncub import LionCub, majority_vote
    from lioncub.comm import CommStats
    from lioncub.harness.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    x = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(rank))
    out = {"runs": []}
    for label in args.methods.split(","):
        for bucket in [float(b) for b in args.buckets.split(",")]:
            torch.manual_seed(0)
            model = GPT(GPTConfig(n_layer=args.layers, n_head=8, n_embd=args.embd, vocab_size=args.vocab,
                                  block_size=args.tokens))
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
            del model, plain, ovl, params
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _pass_through(args) -> list[str]:
    return ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--layers", str(args.layers),
            "--embd", str(args.embd), "--vocab", str(args.vocab), "--tokens", str(args.tokens),
            "--methods", args.methods, "--buckets", args.buckets]


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


def run(args) -> dict:
    from lioncub.testbed import Testbed, check_available

    P = args.workers
    argv = [sys.executable, os.path.abspath(__file__), "--worker"] + _pass_through(args)
    reason = None if args.loopback else check_available()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lco-ovl-") as d:
        if args.loopback or reason is not None:
            import subprocess

            where = f"LOOPBACK (unshaped; testbed unavailable: {reason})" if reason else "LOOPBACK (unshaped)"
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29563", WORLD_SIZE=str(P),
                       GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
            procs = [subprocess.Popen(argv + ["--out-dir", d], env=dict(env, RANK=str(r))) for r in range(P)]
            if any(p.wait(timeout=1500) for p in procs):
                raise RuntimeError("a loopback worker failed")
        else:
            with Testbed(P, rate=args.rate, prefix="lco", subnet="10.79.6", port=29561) as tb:
                tb.run_workers([argv + ["--out-dir", d]] * P, timeout=1500)
            where = f"netem testbed, {P} workers, {args.rate} per link"
        ranks = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(P)]
    return {"where": where, "workers": P, "wall_s": time.perf_counter() - t0, "rows": summarise(ranks),
            "per_rank": ranks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--loopback", action="store_true", help="skip the testbed (unshaped loopback)")
    ap.add_argument("--methods", default="pbit 4,onebit")
    ap.add_argument("--buckets", default="1,4,25", help="bucket_mb values, comma list")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds per method and bucket size")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=8, help="tokens per worker per step (batch 1)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "overlap.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args, args.out_dir)
        return 0
    res = run(args)
    print(table(res["rows"], res["where"]) + f"\nwall {res['wall_s']:.0f} s, load {os.getloadavg()[0]:.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "load_avg": os.getloadavg(), **res}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
