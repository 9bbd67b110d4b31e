"""Probe the emulated cluster: fp32 allreduce time and wire bytes vs the ring model.

Builds a :class:`lioncub.testbed.Testbed` (4 workers, tbf on both ends of every
veth) for each rate, runs gloo fp32 SUM allreduces of 1, 16 and 64 MiB inside it,
and compares with docs/design.md §3:

    time  = 2(P-1)·α + 2(P-1)/P · 8B · β      (model: α = 0, β = 1/rate)
    bytes = 2(P-1)/P · B sent per worker      (wire: the veth's tx counter)

It also fits (α, β) from the measured times and from :func:`lioncub.engine.cost.calibrate`.
The unshaped row is the CPU-bound floor of this host. Needs root.

    sudo OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.net_probe            # ~1 min
    ... -m bench.net_probe --rates 0.5gbit,1gbit,2gbit,none --sizes-mib 1,16,64
Writes bench/results/net_probe.json.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from bench import _runner

MiB = 1 << 20


def worker(sizes_mib: list[float], repeats: int, out_dir: str) -> None:
    """One rank inside the testbed: time allreduces, read its own veth counters."""
    import torch
    import torch.distributed as dist

    from lioncub.engine.cost import calibrate
    from lioncub.testbed import iface_bytes

    _runner.init_worker(timeout_s=300)
    dev = os.environ["GLOO_SOCKET_IFNAME"]
    rows = []
    for mib in sizes_mib:
        x = torch.ones(int(mib * MiB) // 4, dtype=torch.float32)
        times, tx, rx = [], [], []
        for i in range(1 + repeats):  # the first run warms up connections and buffers
            dist.barrier()
            b0 = iface_bytes(dev)
            t0 = time.perf_counter()
            dist.all_reduce(x)
            dt = time.perf_counter() - t0
            dist.barrier()  # my last sends may still sit in my tbf queue when I finish
            b1 = iface_bytes(dev)
            if i:
                times.append(dt)
                tx.append(b1["tx"] - b0["tx"])
                rx.append(b1["rx"] - b0["rx"])
        rows.append({"mib": mib, "seconds": times, "tx": tx, "rx": rx})
    barrier = []
    for _ in range(3):  # what a barrier alone adds to the counters
        b0 = iface_bytes(dev)
        dist.barrier()
        barrier.append(iface_bytes(dev)["tx"] - b0["tx"])
    alpha, beta = calibrate()
    _runner.finish(out_dir, {"rows": rows, "barrier_tx": barrier, "calibrate": [alpha, beta]})


def _median(v):
    v = sorted(v)
    return v[len(v) // 2]


def probe(n_workers: int, rate, sizes_mib, repeats: int) -> dict:
    """Run the probe in one testbed; returns the measured rows and model figures."""
    from lioncub.engine.cost import fit_alpha_beta, predicted_bytes, predicted_time

    P = n_workers
    argv = ["--repeats", str(repeats), "--sizes-mib", ",".join(str(s) for s in sizes_mib)]
    ran = _runner.launch("bench.net_probe", argv, P, prefix="lcbprobe", rate=rate, timeout=900)
    ranks = ran.ranks
    beta_model = None if ran.rate_bps is None else 1.0 / ran.rate_bps
    barrier_tx = _median([b for r in ranks for b in r["barrier_tx"]])
    rows = []
    for i, mib in enumerate(sizes_mib):
        per_rank = [r["rows"][i] for r in ranks]
        seconds = max(_median(r["seconds"]) for r in per_rank)  # the slowest rank sets the step
        tx = sum(_median(r["tx"]) for r in per_rank) / P - barrier_tx
        rx = sum(_median(r["rx"]) for r in per_rank) / P - barrier_tx
        n = int(mib * MiB) // 4
        model_bytes = predicted_bytes("grad", n, P)["bytes_sent"]
        model_s = None if beta_model is None else predicted_time("grad", n, P, 0.0, beta_model)
        rows.append({
            "mib": mib, "seconds": seconds, "model_seconds": model_s,
            "time_ratio": None if model_s is None else seconds / model_s,
            "bus_gbit_s": model_bytes * 8 / seconds / 1e9,
            "wire_tx_bytes": tx, "wire_rx_bytes": rx, "model_bytes": model_bytes,
            "wire_ratio": tx / model_bytes,
        })
    fit = fit_alpha_beta([int(r["mib"] * MiB) for r in rows], [r["seconds"] for r in rows], P)
    cal = ranks[0]["calibrate"]
    assert all(r["calibrate"] == cal for r in ranks), "calibrate must agree across ranks"
    return {"workers": P, "rate": ran.rate or "unshaped", "rate_bps": ran.rate_bps,
            "rows": rows, "fit_alpha_s": fit[0], "fit_beta_s_per_bit": fit[1],
            "fit_gbit_s": 1e-9 / fit[1], "calibrate_alpha_s": cal[0],
            "calibrate_beta_s_per_bit": cal[1], "calibrate_gbit_s": 1e-9 / cal[1],
            "barrier_tx_bytes": barrier_tx, "wall_s": ran.wall_s}


def table(results: list[dict]) -> str:
    head = (f"{'rate':>9} {'MiB':>4} {'time s':>8} {'model s':>8} {'t/model':>7} {'bus Gb/s':>8} "
            f"{'wire tx B':>11} {'model B':>11} {'wire/model':>10}")
    lines = [head, "-" * len(head)]
    for res in results:
        for r in res["rows"]:
            ms = "-" if r["model_seconds"] is None else f"{r['model_seconds']:.4f}"
            ratio = "-" if r["time_ratio"] is None else f"{r['time_ratio']:.3f}"
            lines.append(f"{res['rate']:>9} {r['mib']:>4g} {r['seconds']:>8.4f} {ms:>8} {ratio:>7} "
                         f"{r['bus_gbit_s']:>8.3f} {r['wire_tx_bytes']:>11.0f} {r['model_bytes']:>11.0f} "
                         f"{r['wire_ratio']:>10.4f}")
        lines.append(f"{res['rate']:>9}  fit 1/16/64 MiB: alpha={res['fit_alpha_s'] * 1e3:.3f} ms "
                     f"beta -> {res['fit_gbit_s']:.3f} Gbit/s | calibrate(): alpha="
                     f"{res['calibrate_alpha_s'] * 1e3:.3f} ms beta -> {res['calibrate_gbit_s']:.3f} Gbit/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rates", default="1gbit,none", help="comma list; 'none' = unshaped")
    ap.add_argument("--sizes-mib", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(_runner.RESULTS, "net_probe.json"))
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    _runner.add_worker_args(ap)
    args = ap.parse_args(argv)
    if args.report_only:
        print(table(_runner.read_json(args.report_only)["results"]))
        return 0
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    if args.worker:
        worker(sizes, args.repeats, args.out_dir)
        return 0
    rates = [None if r.strip().lower() == "none" else r.strip() for r in args.rates.split(",")]
    results = [probe(args.workers, rate, sizes, args.repeats) for rate in rates]
    print(table(results))
    _runner.write_json(args.out, {"host": {"cpus": os.cpu_count(), "kernel": platform.release(),
                                           "python": platform.python_version()},
                                  "sizes_mib": sizes, "repeats": args.repeats, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
