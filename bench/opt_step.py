"""Time ``LionCub.step()`` alone (gradients fixed, no forward/backward) on the 28.7M-parameter
GPT of bench/step_time.py: 2 gloo workers on loopback, 5 timed steps per method (median).
Isolates the optimizer's local work (c, pack, vote, apply) from the network.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 bench/opt_step.py [--steps 5] [--out FILE]

Prints a table (ms per step and per part; ``other`` = what no part's timer covers: the
has-grad/finite agreement, Python) and writes JSON (default bench/results/opt_step.json).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def worker(rank, world, methods, steps, out, gpt=None):
    # one CPU thread, in a gloo group (the launcher's default)
    try:  # the flat settings through the public constructor (issue 64's API)
        from lioncub.optim.flags import flat_lioncub as LionCub
    except ImportError:  # a tree before it (opt_step_ab.py's --before), whose LionCub took them itself
        from lioncub import LionCub
    from lioncub.harness.models.gpt import GPT, GPTConfig
    res = {}
    for label, kw in methods:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**dict(dict(n_layer=6, n_head=6, n_embd=576, vocab_size=8192, block_size=64),
                                     **(gpt or {}))))
        gen = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt = LionCub(model.parameters(), lr=1e-4, weight_decay=0.1, **kw)
        rows = []
        for s in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            st = opt.last_step_stats
            if s:
                rows.append(dict(step=dt, pack=st.t_quantize_pack, coll=st.t_collective, unpack=st.t_unpack_vote, apply=st.t_apply))
        res[label] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()

METHODS = [("grad fp32", dict(vote="grad")), ("onebit", dict(vote="onebit")), ("gather", dict(vote="gather")),
           ("pbit4", dict(vote="pbit", bits=4)), ("pbit8 l1", dict(vote="pbit", bits=8, quantizer="l1")),
           ("sign int8", dict(vote="sign_allreduce")), ("onebit mean", dict(vote="onebit", aggregate="mean"))]


def table(r: dict) -> str:
    """Per method, ms of the step and its parts (median over the timed steps), from ``main``'s JSON."""
    lines = []
    for k, v in r.items():
        other = v["step"] - v["pack"] - v["coll"] - v["unpack"] - v["apply"]
        lines.append(f"{k:10s} step {v['step'] * 1e3:7.1f}  pack {v['pack'] * 1e3:6.1f}  coll {v['coll'] * 1e3:6.1f}  "
                     f"unpack {v['unpack'] * 1e3:6.1f}  apply {v['apply'] * 1e3:6.1f}  other {other * 1e3:6.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method (after one warm-up)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "opt_step.json"))
    ap.add_argument("--layers", type=int, default=6, help="GPT layers (smaller: a quicker, smaller run)")
    ap.add_argument("--embd", type=int, default=576, help="GPT width (a multiple of 6)")
    ap.add_argument("--vocab", type=int, default=8192, help="GPT vocabulary")
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            print(table(json.load(f)))
        return 0
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from lioncub.testbed.launch import spawn

    gpt = dict(n_layer=args.layers, n_embd=args.embd, vocab_size=args.vocab)
    spawn(worker, 2, METHODS, args.steps, args.out, gpt, timeout_s=1800.0, deadline_s=float("inf"))
    with open(args.out) as f:
        print(table(json.load(f)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
