"""Soak test: many LionCub steps on a loopback gloo group; replicas identical, memory flat.

8 ranks (default) train a small MLP classifier, each on its own synthetic shard
(a fixed random teacher labels the inputs), for >= 2000 steps with:

* the replica guard on (``check_every``: checksums all-gathered every k steps),
* ``nonfinite='skip_step'`` and a NaN injected on one rank every ``--nan-every``
  steps (a different rank each time): every rank must skip those steps together,
* several buckets per step (small ``bucket_mb``).

At the end every rank all-gathers its full parameter vector and compares it bit for
bit with everyone else's (independent of the checksum guard), and reports its
resident set size (``VmRSS``) and peak (``VmHWM``, from /proc/self/status) after
warm-up and at the end: memory growth over the run is the difference.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.soak               # 8 ranks, 2000 steps
    ... -m bench.soak --world 4 --steps 500 --vote onebit --out /tmp/soak.json

Prints a table and writes bench/results/soak.json. Not a unit test (minutes).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from bench import _runner

KiB = 1024


def _mem() -> dict:
    """Current and peak resident set size of this process, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(val.split()[0]) / KiB  # kB -> MiB
    return {"rss_mib": out["VmRSS"], "peak_mib": out["VmHWM"]}


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from lioncub.optim.flags import flat_lioncub as LionCub
    from lioncub.engine import guard

    torch.manual_seed(0)  # same teacher and model init everywhere (LionCub broadcasts rank 0's anyway)
    teacher = torch.nn.Linear(args.dim, args.classes)
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU(),
                                torch.nn.Linear(args.hidden, args.classes))
    opt = LionCub(model.parameters(), lr=args.lr, vote=args.vote, model=model, nonfinite="skip_step",
                  check_every=args.check_every, bucket_mb=args.bucket_mb)
    data = torch.Generator().manual_seed(1000 + rank)  # this rank's shard
    step_s, losses, mem_trace = [], [], []
    mem_start = None
    for step in range(args.steps):
        t0 = time.perf_counter()
        x = torch.randn(args.batch, args.dim, generator=data)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if args.nan_every and step % args.nan_every == args.nan_every - 1 and \
                rank == (step // args.nan_every) % world:
            model[0].weight.grad[0, 0] = float("nan")
        opt.step()
        step_s.append(time.perf_counter() - t0)
        if step % 100 == 0 or step == args.steps - 1:
            losses.append((step, loss.item()))
        if step == args.warmup - 1:
            mem_start = _mem()
        if step % 250 == 0:
            mem_trace.append((step, _mem()))
            if rank == 0:
                print(f"step {step}/{args.steps}: loss {loss.item():.3f}, RSS {mem_trace[-1][1]['rss_mib']:.1f} "
                      f"MiB, {sum(step_s):.0f} s", flush=True)
    mem_end = _mem()
    guard.check_replicas(list(model.parameters()), None, world, step=opt.steps)  # checksum path
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)  # bit-for-bit, independent of the checksums
    identical = all(torch.equal(e, flat) for e in everyone)
    dist.barrier()
    dist.destroy_process_group()
    result = dict(rank=rank, n_params=flat.numel(), n_buckets=len(opt.buckets), steps_done=opt.steps,
                  skipped_steps=opt.skipped_steps, replicas_identical=identical,
                  step_ms_median=1e3 * statistics.median(step_s[args.warmup:]),
                  step_ms_p99=1e3 * sorted(step_s[args.warmup:])[int(0.99 * (len(step_s) - args.warmup)) - 1],
                  loss_first=losses[0][1], loss_last=losses[-1][1], losses=losses,
                  mem_start=mem_start, mem_end=mem_end, mem_trace=mem_trace)
    return result


def run(args: argparse.Namespace) -> dict:
    from lioncub.testbed.launch import spawn

    t0 = time.time()  # one CPU thread and gloo per rank (the launcher's default)
    ranks = spawn(_worker, args.world, args, timeout_s=args.timeout, deadline_s=float("inf"))
    growth = [r["mem_end"]["peak_mib"] - r["mem_start"]["peak_mib"] for r in ranks]
    summary = dict(
        wall_s=time.time() - t0,
        replicas_identical=all(r["replicas_identical"] for r in ranks),
        skipped_steps_agree=len({r["skipped_steps"] for r in ranks}) == 1,
        max_peak_growth_mib=max(growth),
        max_rss_growth_mib=max(r["mem_end"]["rss_mib"] - r["mem_start"]["rss_mib"] for r in ranks),
        memory_flat=max(growth) <= args.growth_limit_mib,
    )
    return dict(config=vars(args), host=dict(platform=platform.platform(), python=sys.version.split()[0],
                                             cpus=os.cpu_count(), load_avg=os.getloadavg()),
                summary=summary, ranks=ranks)


def _table(res: dict) -> str:
    head = (f"{'rank':>4} {'steps':>6} {'skip':>4} {'ms/step':>8} {'p99 ms':>7} {'loss 0':>7} {'loss end':>8} "
            f"{'RSS start':>9} {'RSS end':>8} {'peak start':>10} {'peak end':>9} {'same':>5}")
    rows = [head, "-" * len(head)]
    for r in res["ranks"]:
        rows.append(f"{r['rank']:>4} {r['steps_done']:>6} {r['skipped_steps']:>4} {r['step_ms_median']:>8.2f} "
                    f"{r['step_ms_p99']:>7.1f} {r['loss_first']:>7.3f} {r['loss_last']:>8.3f} "
                    f"{r['mem_start']['rss_mib']:>9.1f} {r['mem_end']['rss_mib']:>8.1f} "
                    f"{r['mem_start']['peak_mib']:>10.1f} {r['mem_end']['peak_mib']:>9.1f} "
                    f"{str(r['replicas_identical']):>5}")
    s = res["summary"]
    rows.append(f"wall {s['wall_s']:.0f} s; replicas identical: {s['replicas_identical']}; skipped steps agree: "
                f"{s['skipped_steps_agree']}; peak RSS growth max {s['max_peak_growth_mib']:.2f} MiB "
                f"(RSS {s['max_rss_growth_mib']:+.2f} MiB); memory flat: {s['memory_flat']} (MiB, after "
                f"{res['config']['warmup']} warm-up steps)")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=50, help="steps before the 'start' memory reading")
    ap.add_argument("--vote", default="pbit")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=0.03, help="small: several buckets per step")
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--nan-every", type=int, default=500, help="inject a NaN on one rank every k steps (0: off)")
    ap.add_argument("--timeout", type=float, default=120.0, help="process group timeout (s)")
    ap.add_argument("--growth-limit-mib", type=float, default=4.0)
    ap.add_argument("--out", default=os.path.join(_runner.RESULTS, "soak.json"))
    ap.add_argument("--report-only", metavar="JSON", help="print the table of an earlier run's JSON; run nothing")
    args = ap.parse_args(argv)
    if args.report_only:
        print(_table(_runner.read_json(args.report_only)))
        return 0
    if args.steps <= args.warmup:
        ap.error(f"--steps must exceed --warmup ({args.warmup}), got {args.steps}")
    res = run(args)
    print(_table(res))
    _runner.write_json(args.out, res)
    ok = res["summary"]["replicas_identical"] and res["summary"]["skipped_steps_agree"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
