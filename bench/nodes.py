"""Flat vs hierarchical (NodeCub) step time on an emulated cluster of 2 nodes x 2 ranks.

The step-time table's GPT (default ~28M parameters, 1 sequence of 16 tokens per rank),
4 ranks in a :class:`lioncub.testbed.Testbed` with ``nodes=2``: the two ranks of a node
share one namespace (they talk over its loopback, unshaped) and one veth to the other
node, shaped to ``--rate`` both ways. Every method runs on the same testbed:

    <vote> flat           LionCub: all 4 ranks vote (the 2 ranks of a node send over one link)
    <vote> nodes          NodeCub: node mean over the loopback, then each rank votes on its
                          half of the model with its counterpart in the other node
    <vote> nodes all      NodeCub(shard=False): each rank votes on the whole model

for ``vote='grad'`` (fp32 all-reduce, then Lion: the baseline), ``onebit`` and ``pbit``.
Per method: the median step (each step timed on its slowest rank), its compute, and the
bytes the node's veth sent per step (the interface counter: only what crossed nodes).

    sudo OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.nodes               # ~4 min
    ... -m bench.nodes --layers 2 --embd 128 --steps 2                        # seconds, smaller
Writes bench/results/nodes.json. Needs root.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench import _runner

LAYOUTS = {"flat": None, "nodes": True, "nodes all": False}  # NodeCub's shard, None = LionCub
VOTES = {"lion fp32": dict(vote="grad"), "onebit": dict(vote="onebit"), "pbit": dict(vote="pbit")}


def worker(args, out_dir: str) -> None:
    """One rank: every (vote, layout) for ``args.steps`` timed steps; records to JSON."""
    import torch.distributed as dist

    from lioncub import node_groups
    from lioncub.optim.flags import flat_lioncub as LionCub, flat_nodecub as NodeCub
    from lioncub.testbed import iface_bytes

    rank, dev = _runner.init_worker(), os.environ["GLOO_SOCKET_IFNAME"]
    layout = node_groups()  # LOCAL_WORLD_SIZE from the testbed
    x = _runner.tokens(args, rank)
    out = {}
    for vote_label, kw in VOTES.items():
        for layout_label, shard in LAYOUTS.items():
            model = _runner.gpt(args)
            params = list(model.parameters())
            opt = (LionCub(params, lr=1e-4, **kw) if shard is None else
                   NodeCub(params, lr=1e-4, layout=layout, shard=shard, **kw))
            steps = []
            for i in range(args.warmup + args.steps):
                dist.barrier()
                b0 = iface_bytes(dev)
                t0 = time.perf_counter()
                model(x, x)[1].backward()
                t = {"compute": time.perf_counter() - t0}
                opt.step()
                t["step"] = time.perf_counter() - t0
                opt.zero_grad()
                dist.barrier()  # the node's last bytes may still sit in its tbf queue
                b1 = iface_bytes(dev)
                b2 = iface_bytes(dev)
                dist.barrier()
                t["node_tx"] = (b1["tx"] - b0["tx"]) - (iface_bytes(dev)["tx"] - b2["tx"])  # minus one barrier
                if i >= args.warmup:
                    steps.append(t)
            out[f"{vote_label} {layout_label}"] = {"steps": steps, "n": sum(p.numel() for p in params),
                                                   "local_rank": layout.local_rank}
            del model, opt, params
    _runner.finish(out_dir, out)


def run(args, argv: list[str]) -> dict:
    """The workers' records on the testbed (``argv``, the command line, passed on) and the table's rows."""
    ran = _runner.launch("bench.nodes", argv, args.workers, prefix="lcn", rate=args.rate, nodes=args.nodes)
    ranks = ran.ranks
    rows = []
    for label in ranks[0]:
        per = [r[label]["steps"] for r in ranks]
        k = len(per[0])
        slow = [max((r[i] for r in per), key=lambda s: s["step"]) for i in range(k)]
        i_med = sorted(range(k), key=lambda i: slow[i]["step"])[(k - 1) // 2]
        # every rank of a node reads the same veth: the node's bytes, from each node's local rank 0
        leaders = [r for r in range(args.workers) if ranks[r][label]["local_rank"] == 0]
        node_tx = statistics.median(statistics.fmean(per[r][i]["node_tx"] for r in leaders) for i in range(k))
        rows.append({"method": label, "step": slow[i_med]["step"], "compute_max": max(r[i_med]["compute"] for r in per),
                     "node_tx_bytes": node_tx, "n": ranks[0][label]["n"]})
    base = {r["method"]: r for r in rows}["lion fp32 flat"]
    for r in rows:
        r["speedup_vs_lion_fp32_flat"] = base["step"] / r["step"]
    return {"rate": ran.rate or "unshaped", "workers": args.workers, "nodes": args.nodes, "rows": rows,
            "wall_s": ran.wall_s, "per_rank": ranks}


def table(res: dict) -> str:
    lines = [f"{res['nodes']} nodes x {res['workers'] // res['nodes']} ranks, links between nodes {res['rate']}, "
             f"n={res['rows'][0]['n'] / 1e6:.1f}M params",
             f"{'method':22s} {'step s':>7s} {'compute':>7s} {'MB/node/step':>12s} {'x lion fp32 flat':>16s}"]
    for r in res["rows"]:
        lines.append(f"{r['method']:22s} {r['step']:7.3f} {r['compute_max']:7.3f} {r['node_tx_bytes'] / 1e6:12.2f} "
                     f"{r['speedup_vs_lion_fp32_flat']:16.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="links between nodes; 'none' = unshaped")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=1)
    _runner.add_gpt_args(ap, layers=6, embd=576)
    ap.add_argument("--out", default=os.path.join(_runner.RESULTS, "nodes.json"))
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    _runner.add_worker_args(ap)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.report_only:
        print(table(_runner.read_json(args.report_only)["result"]))
        return 0
    if args.worker:
        worker(args, args.out_dir)
        return 0
    if args.rate.lower() == "none":
        args.rate = None
    res = run(args, argv)
    print(table(res), flush=True)
    _runner.write_json(args.out, {"args": vars(args), "load_avg": os.getloadavg(), "result": res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
