"""Step time of data-parallel Lion / Lion Cub on an emulated 1 Gbit/s cluster (paper Table 4, Fig. 15).

A GPT (default ~28M parameters, 1 sequence of 16 tokens per worker) trained for a
few steps by 4 workers inside a :class:`lioncub.testbed.Testbed` at ``--rate`` and
unshaped (the CPU floor), once per method:

    adamw fp32      AdamW after an fp32 gradient allreduce
    lion fp32/bf16  LionCub(vote='grad'): fp32 / bf16 gradient allreduce, then Lion
    sign int8       vote='sign_allreduce';  gather 1-bit: vote='gather'
    onebit          1-bit all_to_all + all_gather
    onebit overlap  the same, each bucket's vote launched from backward's hooks (``overlap=True``): its
                    collectives run while backward goes on, so part of them shows as compute
    pbit 4          4-bit packed lanes;  pbit 8 l1: 8-bit lanes of L1-quantized values

Per method: the median step (each step timed on its slowest rank), split into compute
(forward+backward) / quantize+pack / collective / unpack+vote / apply; wire bytes
per step and rank (the veth tx counter); speedups over Lion fp32 and Lion bf16; the
α-β model (compute + apply + Σ_messages predicted comm, β = line rate, α from
``calibrate``) and the ideal (compute + apply + measured wire bytes at line rate). In the
model and the ideal, compute is the slowest rank's forward+backward in that step
(``compute_max``): no synchronous step ends before it. ``ideal_own_compute_s`` keeps the
stricter figure with the compute of the rank whose step was slowest (often a rank that
finished backward early and then waited in the collective).

    sudo OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.step_time          # ~6 min
    ... -m bench.step_time --rates 1gbit --steps 3 --layers 2   # quicker, smaller
Writes bench/results/step_time.json and bench/results/step_time.png. Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench import _runner

METHODS = [  # (label, optimizer kwargs; 'adamw' is AdamW with a harness fp32 allreduce)
    ("adamw fp32", None),
    ("lion fp32", dict(vote="grad", grad_dtype="fp32")),
    ("lion bf16", dict(vote="grad", grad_dtype="bf16")),
    ("sign int8", dict(vote="sign_allreduce")),
    ("gather 1-bit", dict(vote="gather")),
    ("onebit", dict(vote="onebit")),
    ("onebit overlap", dict(vote="onebit", overlap=True)),
    ("pbit 4", dict(vote="pbit", bits=4)),
    ("pbit 8 l1", dict(vote="pbit", bits=8, quantizer="l1")),
]
PARTS = ("compute", "pack", "collective", "unpack", "apply", "other")


def _adamw_step(opt, params, world, t):
    """AdamW's step after one flat fp32 gradient allreduce (what DDP + AdamW sends)."""
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    t1 = time.perf_counter()
    dist.all_reduce(flat)
    t2 = time.perf_counter()
    flat /= world
    for p, piece in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(piece.view_as(p))
    t3 = time.perf_counter()
    opt.step()
    t.update(pack=t1 - t0, collective=t2 - t1, unpack=t3 - t2, apply=time.perf_counter() - t3)


def worker(args, out_dir: str) -> None:
    """One rank: every method for ``args.steps`` timed steps, per-step records to JSON."""
    import torch
    import torch.distributed as dist

    from lioncub.optim.flags import flat_lioncub as LionCub
    from lioncub.engine import cost
    from lioncub.testbed import iface_bytes

    rank = _runner.init_worker()
    world, dev = dist.get_world_size(), os.environ["GLOO_SOCKET_IFNAME"]
    alpha, beta = cost.calibrate()
    x = _runner.tokens(args, rank)
    out = {"calibrate": [alpha, beta], "methods": {}}
    for label, kw in METHODS:
        model = _runner.gpt(args)
        params = list(model.parameters())
        if kw is None:
            for p in params:
                dist.broadcast(p.data, 0)
            opt, sizes = torch.optim.AdamW(params, lr=1e-4), [sum(p.numel() for p in params)]
        else:
            opt = LionCub(params, lr=1e-4, bucket_mb=args.bucket_mb, **kw)
            sizes = ([b.numel for b in opt.buckets] if kw["vote"] == "grad"
                     else opt.message_elements())  # votes: buckets travel together, in messages
        steps = []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            b0 = iface_bytes(dev)
            t0 = time.perf_counter()
            model(x, x)[1].backward()
            t = {"compute": time.perf_counter() - t0}
            if kw is None:
                _adamw_step(opt, params, world, t)
            else:
                opt.step()
                s = opt.last_step_stats
                t.update(pack=s.t_quantize_pack, collective=s.t_collective, unpack=s.t_unpack_vote,
                         apply=s.t_apply)
            t["step"] = time.perf_counter() - t0
            t["other"] = t["step"] - sum(t[k] for k in PARTS[:-1])
            opt.zero_grad()  # PyTorch's default (set_to_none=True), for every method
            dist.barrier()  # my last bytes may still sit in my tbf queue when my step ends
            b1 = iface_bytes(dev)
            b2 = iface_bytes(dev)
            dist.barrier()
            t["tx"] = (b1["tx"] - b0["tx"]) - (iface_bytes(dev)["tx"] - b2["tx"])  # minus one barrier
            if i >= args.warmup:
                steps.append(t)
        out["methods"][label] = {"sizes": sizes, "n_params_tensors": len(params), "steps": steps}
        del model, opt, params
    _runner.finish(out_dir, out)


def _model(label, kw, sizes, n_tensors, P, alpha, beta):
    """(bytes sent per rank, α-β seconds) the model predicts for one step of ``label``."""
    from lioncub.engine import cost

    if kw is None:
        m, mkw = "grad", {}
    else:
        m = kw["vote"]
        mkw = {k: v for k, v in kw.items() if k not in ("vote", "overlap")}  # (overlap moves no byte)
    nbytes = sum(cost.predicted_bytes(m, n, P, **mkw)["bytes_sent"] for n in sizes)
    secs = sum(cost.predicted_time(m, n, P, alpha, beta, **mkw) for n in sizes)
    if kw is not None:  # LionCub's has-grad / finite flag: one uint8 allreduce per step
        nbytes += cost.predicted_bytes("sign_allreduce", n_tensors + 1, P)["bytes_sent"]
        secs += cost.collective_time("allreduce", n_tensors + 1, P, alpha, beta)
    return nbytes, secs


def run_testbed(args, argv: list[str], rate) -> dict:
    """Every method on a testbed at ``rate`` (``argv``, the command line, passed on to the ranks)."""
    from lioncub.engine.auto import choose_vote, vote_costs

    P = args.workers
    ran = _runner.launch("bench.step_time", argv, P, prefix="lcs", rate=rate)
    ranks = ran.ranks
    alpha, beta_cal = ranks[0]["calibrate"]
    beta = beta_cal if ran.rate_bps is None else 1.0 / ran.rate_bps
    rows = []
    for label, kw in METHODS:
        per = [r["methods"][label] for r in ranks]
        k = len(per[0]["steps"])
        # a step lasts as long as its slowest rank: take that rank's split of the median step,
        # so the parts add up to the step time
        slow = [max((r["steps"][i] for r in per), key=lambda s: s["step"]) for i in range(k)]
        i_med = sorted(range(k), key=lambda i: slow[i]["step"])[(k - 1) // 2]
        median = slow[i_med]
        row = {"method": label, **{p: median[p] for p in PARTS + ("step",)}}
        # the step cannot end before the last rank's backward: its compute (4 workers share
        # 2 cores here, so ranks finish backward up to ~0.1 s apart; the wait shows as collective)
        row["compute_max"] = max(r["steps"][i_med]["compute"] for r in per)
        row["wire_bytes"] = statistics.median(statistics.fmean(r["steps"][i]["tx"] for r in per) for i in range(k))
        row["model_bytes"], comm = _model(label, kw, per[0]["sizes"], per[0]["n_params_tensors"], P, alpha, beta)
        row["model_s"] = row["compute_max"] + row["apply"] + comm
        row["ideal_s"] = row["compute_max"] + row["apply"] + row["wire_bytes"] * 8 * beta
        row["ideal_own_compute_s"] = row["compute"] + row["apply"] + row["wire_bytes"] * 8 * beta
        row["n"] = sum(per[0]["sizes"])
        rows.append(row)
    by = {r["method"]: r for r in rows}
    for r in rows:
        r["speedup_fp32"] = by["lion fp32"]["step"] / r["step"]
        r["speedup_bf16"] = by["lion bf16"]["step"] / r["step"]
    names = {"sign int8": "sign_allreduce", "gather 1-bit": "gather", "onebit": "onebit", "pbit 4": "pbit"}
    measured_gamma = {m: (by[lbl]["pack"] + by[lbl]["unpack"]) / by[lbl]["n"] for lbl, m in names.items()}
    sizes = ranks[0]["methods"]["onebit"]["sizes"]
    auto = {"default_gamma": choose_vote(sizes, P, alpha, beta),
            "measured_gamma": choose_vote(sizes, P, alpha, beta, gamma=measured_gamma),
            "costs_measured_gamma": {f"{m}/{b}": c for (m, b), c in
                                     vote_costs(sizes, P, alpha, beta, gamma=measured_gamma).items()}}
    return {"rate": ran.rate or "unshaped", "rate_bps": ran.rate_bps, "workers": P, "alpha": alpha,
            "beta": beta, "calibrate_beta": beta_cal, "rows": rows, "measured_gamma": measured_gamma,
            "auto": auto, "wall_s": ran.wall_s, "per_rank": ranks}


def table(res: dict) -> str:
    head = (f"{'method':13s} {'step s':>7s} {'comp':>6s} {'pack':>6s} {'coll':>6s} {'unpk':>6s} {'apply':>6s} "
            f"{'wire MB':>8s} {'modelMB':>8s} {'x fp32':>6s} {'x bf16':>6s} {'model s':>7s} {'ideal s':>7s} "
            f"{'/ideal':>6s} {'cmpmax':>6s}")
    lines = [f"{res['rate']}, {res['workers']} workers, alpha={res['alpha'] * 1e3:.2f} ms, "
             f"beta -> {1e-9 / res['beta']:.2f} Gbit/s, n={res['rows'][0]['n'] / 1e6:.1f}M params", head]
    for r in res["rows"]:
        lines.append(f"{r['method']:13s} {r['step']:7.3f} {r['compute']:6.3f} {r['pack']:6.3f} "
                     f"{r['collective']:6.3f} {r['unpack']:6.3f} {r['apply']:6.3f} {r['wire_bytes'] / 1e6:8.2f} "
                     f"{r['model_bytes'] / 1e6:8.2f} {r['speedup_fp32']:6.2f} {r['speedup_bf16']:6.2f} "
                     f"{r['model_s']:7.3f} {r['ideal_s']:7.3f} {r['step'] / r['ideal_s']:6.2f} {r['compute_max']:6.3f}")
    a = res["auto"]
    lines.append(f"auto picks {a['default_gamma']} (default gamma), {a['measured_gamma']} (this run's gamma)")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    colors = dict(compute="#4c72b0", pack="#dd8452", collective="#c44e52", unpack="#8172b3",
                  apply="#55a868", other="#bbbbbb")
    for ax, res in zip(axes[0], results):
        labels = [r["method"] for r in res["rows"]]
        bottom = [0.0] * len(labels)
        for part in PARTS:
            vals = [max(r[part], 0.0) for r in res["rows"]]
            ax.bar(labels, vals, bottom=bottom, color=colors[part], label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(labels, [r["model_s"] for r in res["rows"]], marker="_", s=400, color="k", zorder=3,
                   label="α-β model")
        for i, r in enumerate(res["rows"]):
            ax.text(i, bottom[i], f"{r['speedup_fp32']:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{res['workers']} workers, {res['rate']} (n={res['rows'][0]['n'] / 1e6:.1f}M)")
        ax.set_ylabel("seconds per step (slowest rank, median)")
        ax.tick_params(axis="x", rotation=40)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rates", default="1gbit,none", help="comma list; 'none' = unshaped")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=1)
    _runner.add_gpt_args(ap, layers=6, embd=576)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="LionCub bucket_mb")
    ap.add_argument("--out", default=os.path.join(_runner.RESULTS, "step_time.json"))
    ap.add_argument("--report-only", action="store_true", help="print the tables and redraw the plot from --out")
    _runner.add_worker_args(ap)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args, args.out_dir)
        return 0
    if args.report_only:
        with open(args.out) as f:
            results = json.load(f)["results"]
        for res in results:
            print(table(res), flush=True)
    else:
        rates = [None if r.strip().lower() == "none" else r.strip() for r in args.rates.split(",")]
        results = []
        for rate in rates:
            results.append(run_testbed(args, argv, rate))
            print(table(results[-1]), flush=True)
        _runner.write_json(args.out, {"args": vars(args), "load_avg": os.getloadavg(), "results": results})
    png = os.path.splitext(args.out)[0] + ".png"
    plot(results, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
