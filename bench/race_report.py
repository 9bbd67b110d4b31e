"""The race's report (:mod:`bench.race`): each method's best lr and mean ± std over seeds, the targets A and B and
each row's time and bytes to them, the table and the plot; ``report`` re-makes them from a race.json."""
from __future__ import annotations

import json
import math
import os

from bench.regime import REFERENCE, regime_text


def final_loss(run: dict, budget: float) -> float:
    """Validation loss of the last evaluation within the budget (local methods may overshoot it)."""
    inside = [e for e in run["evals"] if e["t"] <= budget * 1.05] or run["evals"][:1]
    return inside[-1]["val"] if run["status"] == "ok" else float("inf")


def _mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def _loss_at(run: dict, t: float) -> float:
    """Validation loss of the last evaluation at or before ``t`` seconds (5% slack)."""
    return next(e["val"] for e in reversed(run["evals"]) if e["t"] <= t * 1.05)


def loopback_target(loopback: dict | None, budget: float):
    """(loss, seconds): the unshaped reference's (``--reference-loopback``) mean validation loss at half the budget,
    and its mean time to reach it; None without one."""
    runs = [r for r in (loopback or {}).get("runs", []) if r["status"] == "ok"]
    if not runs:
        return None
    loss = sum(_loss_at(r, budget / 2) for r in runs) / len(runs)
    times = [c[0] for c in (_crossing(r["evals"], loss) for r in runs) if c is not None]
    return (loss, sum(times) / len(times)) if times else None


def summarize(runs: list[dict], budget: float, target_method: str = REFERENCE, loopback: dict | None = None) -> dict:
    """Per method: its best lr by mean final loss over the seeds all its lrs ran (each lr's own seeds
    where they share none), and mean ± std over every seed of that lr. With the unshaped reference's runs
    (``loopback``), each row's time to its loss at half the budget, over the reference's own time
    (``x_loopback``, mean ± std over the seeds that reached it)."""
    fast = loopback_target(loopback, budget)
    by: dict[tuple, list] = {}
    for r in runs:
        by.setdefault((r["method"], r["lr"]), []).append(r)
    mean_final = {k: sum(final_loss(r, budget) for r in rs) / len(rs) for k, rs in by.items()}
    # lrs are compared on the seeds every lr of the method ran (the tuning seed, when later seeds ran
    # only at the best lr); a 3-seed mean is not set against one seed's luck
    shared: dict[str, set] = {}
    for (name, lr), rs in by.items():
        seeds = {r.get("seed", 0) for r in rs}
        shared[name] = shared[name] & seeds if name in shared else seeds
    tuned = {}
    for (name, lr), rs in by.items():
        on = [r for r in rs if r.get("seed", 0) in shared[name]] or rs
        tuned[(name, lr)] = sum(final_loss(r, budget) for r in on) / len(on)
    best = {}
    for (name, lr), m in tuned.items():
        if name not in best or m < tuned[best[name]]:
            best[name] = (name, lr)
    # two targets, both set by one method alone (Lion fp32 unless told; mean over its seeds): its loss at
    # the end of the budget, and at half of it
    target = half = None
    if target_method in best:
        ref = by[best[target_method]]
        target = mean_final[best[target_method]]
        half = sum(_loss_at(r, budget / 2) for r in ref) / len(ref)
    rows = []
    for name, key in best.items():
        rs, per = by[key], []
        for r in rs:
            ev = r["evals"]
            last, mid = ev[-1], ev[len(ev) // 2]
            ok = r["status"] == "ok"
            per.append(dict(final=final_loss(r, budget), steps=last["step"], step_s=last["t"] / max(1, last["step"]),
                            # second half of the run: PowerSGD's first steps are uncompressed
                            bytes_per_step=(last["tx"] - mid["tx"]) / max(1, last["step"] - mid["step"]),
                            target=_crossing(ev, target) if target is not None and ok else None,
                            half=_crossing(ev, half) if half is not None and ok else None,
                            # the step rate over the compute-bound one (local AdamW, no communication, measured in the run)
                            rate=r["compute_s"] * last["step"] / last["t"] if r.get("compute_s") and last["t"] else None,
                            fast=_crossing(ev, fast[0]) if fast is not None and ok else None,
                            seed=r.get("seed", 0)))
        final, final_std = _mean_std([p["final"] for p in per])
        row = dict(method=name, lr=key[1], seeds=len(rs), final_val=final, final_val_std=final_std,
                   steps=round(sum(p["steps"] for p in per) / len(per)),
                   step_s=sum(p["step_s"] for p in per) / len(per),
                   bytes_per_step=sum(p["bytes_per_step"] for p in per) / len(per),
                   compute_rate=(sum(p["rate"] for p in per) / len(per)) if all(p["rate"] for p in per) else None,
                   lrs_tried={lr: tuned[(n, lr)] for n, lr in by if n == name})
        for which in ("target", "half"):
            hits = [p[which] for p in per if p[which] is not None]
            row[f"reached_{which}"] = len(hits)
            if hits:
                (t, t_sd), (b, b_sd) = _mean_std([h[0] for h in hits]), _mean_std([h[1] for h in hits])
            else:
                t = t_sd = b = b_sd = None
            row.update({f"time_to_{which}": t, f"time_to_{which}_std": t_sd, f"bytes_to_{which}": b,
                        f"bytes_to_{which}_std": b_sd})
        row["per_seed_step_s"] = {p["seed"]: p["step_s"] for p in per}
        fast_hits = [p["fast"][0] / fast[1] for p in per if p["fast"] is not None]
        row["reached_loopback"] = len(fast_hits)
        row["x_loopback"], row["x_loopback_std"] = _mean_std(fast_hits) if fast_hits else (None, None)
        rows.append(row)
    _of_compute_row(rows)
    return dict(target=target, target_half=half, target_method=target_method, rows=rows,
                loopback=None if fast is None else dict(method=loopback["method"], loss=fast[0], seconds=fast[1],
                                                        load_avg_before=loopback.get("load_avg_before"),
                                                        load_avg_after=loopback.get("load_avg_after")))


COMPUTE_ROW = "compute-adamw-h50"
"""The race's row of local AdamW with no communication (:class:`lioncub.baselines.local.ComputeOnly`)."""


def _of_compute_row(rows: list[dict]) -> None:
    """Where the race ran :data:`COMPUTE_ROW`: each row's steps per second over that row's, seed by seed (the same
    loop, host and budget in one invocation), mean ± std over the seeds both ran, in ``of_compute_row``
    (``of_compute_row_std``)."""
    ref = next((r for r in rows if r["method"] == COMPUTE_ROW), None)
    for row in rows:
        ratios = [] if ref is None else [ref["per_seed_step_s"][seed] / x for seed, x in row["per_seed_step_s"].items()
                                         if x and ref["per_seed_step_s"].get(seed)]
        row["of_compute_row"], row["of_compute_row_std"] = _mean_std(ratios) if ratios else (None, None)


def _crossing(evals: list[dict], target: float):
    """(seconds, bytes) where the validation loss first reaches ``target``, linear between evaluations."""
    for a, b in zip(evals, evals[1:]):
        if b["val"] <= target:
            f = 1.0 if a["val"] == b["val"] else min(1.0, max(0.0, (a["val"] - target) / (a["val"] - b["val"])))
            return a["t"] + f * (b["t"] - a["t"]), a["tx"] + f * (b["tx"] - a["tx"])
    return None


def _hit(r: dict, ref: dict | None, key: str) -> str:
    t, b = r[f"time_to_{key}"], r[f"bytes_to_{key}"]
    if t is None:
        return "not reached | - | -"
    sp = f"{ref[f'time_to_{key}'] / t:.2f}x" if ref and ref[f"time_to_{key}"] else "-"
    n = r.get("seeds", 1)
    if n == 1:
        return f"{t:.1f} s | {sp} | {b / 1e6:.0f}"
    return (f"{t:.1f} ± {r[f'time_to_{key}_std']:.1f} s ({r[f'reached_{key}']}/{n}) | {sp} | "
            f"{b / 1e6:.0f} ± {r[f'bytes_to_{key}_std'] / 1e6:.0f}")


def table(summary: dict) -> str:
    setter = summary.get("target_method", REFERENCE)
    ref = next((r for r in summary["rows"] if r["method"] == setter), None)
    if ref is None:
        return f"no run of the target's method ({setter})"
    lines = [f"A = {summary['target']:.3f}: {setter}'s (best lr, mean over seeds) val loss at the end of the budget; "
             f"B = {summary['target_half']:.3f}: its val loss at half the budget"]
    fast = summary.get("loopback")
    if fast:
        lines.append(f"x DDP-loopback: time to {fast['loss']:.3f}, the loss {fast['method']} reaches on an unshaped "
                     f"link at half the budget (in {fast['seconds']:.1f} s, mean over seeds), over that time; "
                     f"its host load {fast['load_avg_before'][0]:.1f} -> {fast['load_avg_after'][0]:.1f}")
    lines += ["| method |" + (" x DDP-loopback |" if fast else "") + " best lr | val @ budget | steps | s/step | "
              "of compute rate | of no-comm row | MB/step sent | time to A | x | MB to A | time to B | x | MB to B |",
              "|---|" + ("---|" if fast else "") + "---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(summary["rows"], key=lambda r: r["final_val"]):
        x = ""
        if fast:
            n = r.get("seeds", 1)
            x = (" not reached |" if r.get("x_loopback") is None else f" {r['x_loopback']:.2f}"
                 + (f" ± {r['x_loopback_std']:.2f} ({r['reached_loopback']}/{n})" if n > 1 else "") + " |")
        final = f"{r['final_val']:.3f}" + (f" ± {r['final_val_std']:.3f}" if r.get("seeds", 1) > 1 else "")
        rate = f"{r['compute_rate']:.2f}" if r.get("compute_rate") else "-"  # (races before it: not measured)
        row_rate = (f"{r['of_compute_row']:.2f} ± {r['of_compute_row_std']:.2f}" if r.get("of_compute_row")
                    else "-")  # (only where the race ran the no-communication row)
        lines.append(f"| {r['method']} |{x} {r['lr']:g} | {final} | {r['steps']} | {r['step_s']:.3f} | {rate} | {row_rate} | "
                     f"{r['bytes_per_step'] / 1e6:.2f} | {_hit(r, ref, 'target')} | {_hit(r, ref, 'half')} |")
    return "\n".join(lines)


def mean_curve(runs: list[dict], budget: float, every: float):
    """Seeds of one (method, lr) on a common grid of seconds up to the shortest run (and ``budget``):
    (grid, mean loss, std loss, mean MB sent), each interpolated linearly between evaluations."""
    import numpy as np

    end = min(min(r["evals"][-1]["t"] for r in runs), budget * 1.15)
    grid = np.append(np.arange(0.0, end, every / 2), end)
    vals = np.array([np.interp(grid, [e["t"] for e in r["evals"]], [e["val"] for e in r["evals"]]) for r in runs])
    txs = np.array([np.interp(grid, [e["t"] for e in r["evals"]], [e["tx"] for e in r["evals"]]) for r in runs])
    std = vals.std(0, ddof=1) if len(runs) > 1 else np.zeros_like(grid)
    return grid, vals.mean(0), std, txs.mean(0) / 1e6


def plot(runs: list[dict], summary: dict, path: str, title: str, budget: float, every: float = 5.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    best = [(r["method"], r["lr"], r.get("seeds", 1)) for r in summary["rows"]]
    for i, (name, lr, n) in enumerate(best):
        seeds = [r for r in runs if (r["method"], r["lr"]) == (name, lr)]
        grid, mean, std, mb = mean_curve(seeds, budget, every)
        style = "-" if name.startswith("lion") else "--"
        label = f"{name} (lr {lr:g}" + (f", {n} seeds)" if n > 1 else ")")
        line, = axes[0].plot(grid, mean, style, color=plt.cm.tab20(i / max(1, len(best) - 1)), label=label)
        if n > 1:
            axes[0].fill_between(grid, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)
        axes[1].plot(mb[1:], mean[1:], style, color=line.get_color())  # log axis: the t=0 point (0 bytes) is left out
    for ax, xl in zip(axes, ("training seconds (wall clock, evals excluded)", "MB sent per worker (veth tx)")):
        if summary["target"] is not None:
            ax.axhline(summary["target"], color="k", lw=0.8, ls=":", label="target A (Lion fp32 @ budget)")
            ax.axhline(summary["target_half"], color="grey", lw=0.8, ls=":", label="target B (@ half budget)")
        ax.set_xlabel(xl)
        ax.set_ylabel("validation loss (nats/byte)")
    axes[0].set_xlim(0, budget * 1.15)  # local methods overshoot to their next sync point
    axes[1].set_xscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------- driver


def report(path: str) -> int:
    """Summary, table and plot of a race.json (written back into it), e.g. after changing the report."""
    with open(path) as f:
        res = json.load(f)
    a = res["args"]
    if a.get("steps") is not None:  # a step-matched grid: loss at the same step count, no time targets
        print("| method | lr | seed | steps | val @ end | s/step |\n|---|---|---|---|---|---|")
        for r in sorted(res["runs"], key=lambda r: r["evals"][-1]["val"]):
            last = r["evals"][-1]
            print(f"| {r['method']} | {r['lr']:g} | {r.get('seed', 0)} | {last['step']} | {last['val']:.3f} | "
                  f"{last['t'] / max(1, last['step']):.3f} |")
        return 0
    res["summary"] = summarize(res["runs"], a["budget"], a.get("target") or REFERENCE, res.get("loopback"))
    res["summary"]["regime"] = regime_text(res["runs"])
    print(res["summary"]["regime"])
    print(table(res["summary"]))
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    png = os.path.splitext(path)[0] + ".png"
    plot(res["runs"], res["summary"], png, f"{a['workers']} workers, {res['rate']}, GPT {a['layers']}L/{a['embd']}d "
         f"({res['runs'][0]['n_params'] / 1e6:.2f}M params), {a['batch']}x{a['block']} tokens/worker/step, "
         f"{a['budget']:.0f} s budget" + (f", {a.get('schedule')} lr" if a.get("schedule") else ""), a["budget"],
         a.get("eval_every", 5.0))
    print(f"wrote {path} and {png}")
    return 0
