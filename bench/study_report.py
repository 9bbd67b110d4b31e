"""Tables and plots from the study's raw records (``bench/study.py`` -> ``study.jsonl``).

Each row of the plan (``study_plan.plan``, with ``study_plan.recipe_plan`` for the ``recipe`` part) is
matched to its records by experiment key, so a run shared by two parts (e.g. Lion at β2 = 0.99)
is counted in both; the plan is rebuilt for every seed, step count and recipe step count found
in the records. Per row: final validation loss (and accuracy for images) as mean ± sample std
over seeds, the number of seeds, its Δ to the part's reference row with a verdict (``NOISE_RULE``),
and the mean wall time of one run. The reference row is the part's Lion row (same model, β2,
steps and embedding tying; a part without one, e.g. ``ties``, uses such a Lion row of another
part); for ``recipe`` it is Lion at the grid's best point (``study_plan.LION_GRID[0]``), and every
other recipe row also gets its Δ to the AdamW reference row. Writes the summary JSON, one PNG
per part (final loss bars; mean validation-loss curves with a ± one std band over seeds) and
prints Markdown tables (also to ``--markdown FILE``).

    PYTHONPATH=src python3 -m bench.study_report bench/results/study.jsonl \
        --figures docs/figures/study --summary bench/results/study_summary.json
    PYTHONPATH=src python3 -m bench.study_report bench/results/study_recipe.jsonl \
        --figures docs/figures/study --markdown /tmp/recipe.md
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics

from bench.study_plan import (BATCH_LONG, BATCH_OPTS, BATCH_POINTS, LION_GRID, PARTS, ablate_plan, batch_name,
                              batch_plan, plan, recipe_plan)
from lioncub.harness.metrics import read_jsonl

RECIPE_LION = f"Lion lr={LION_GRID[0][0]:g} wd={LION_GRID[0][1]:g}"  # recipe_plan's label of the best grid point
RECIPE_ADAMW = "AdamW (nanoGPT)"
SCALE_PARTS = ("recipe", "batch", "ablate")  # the runs at the recipe's shape, planned apart from the tiny study
NOISE_RULE = ("Δ = mean − mean of the reference row; beyond noise when |Δ| > 2·sqrt(sd_a²/n_a + sd_b²/n_b) "
              "(sample std sd over n seeds), else within noise; n/a (one seed) when either row has fewer than "
              "2 seeds")
ONE_SEED = "n/a (one seed)"
# The byte-unigram plateau of the recipe-scale runs sits near 3.3 nats; a run has "left" it at its
# first evaluation below this loss.
PLATEAU_EXIT = 3.0


def _ms(xs: list[float]) -> tuple[float, float | None]:
    """(mean, sample std); the std is None for one seed."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def compare(a: dict, b: dict, metric: str = "val_loss") -> dict:
    """Δ of row ``a`` against row ``b`` (mean minus mean) and its verdict by ``NOISE_RULE``."""
    (ma, sa), (mb, sb) = a[metric], b[metric]
    na, nb = len(a["seeds"]), len(b["seeds"])
    out = {"ref": b["label"], "ref_part": b["part"], "delta": ma - mb}
    if na < 2 or nb < 2 or sa is None or sb is None:
        out.update(noise=None, verdict=ONE_SEED)
    else:
        noise = 2 * math.sqrt(sa ** 2 / na + sb ** 2 / nb)
        out.update(noise=noise, verdict="beyond noise" if abs(ma - mb) > noise else "within noise")
    return out


def _specs(records: list[dict]):
    """Every spec the records can belong to: the plan rebuilt per seed (so each seed gets the
    recipe grid's edges too) and per step count found (recipe runs apart from the others)."""
    seeds = sorted({r["seed"] for r in records})
    recipe = sorted({r["steps"] for r in records if r.get("part") == "recipe"})
    other = [r for r in records if r.get("part") not in SCALE_PARTS]
    gpt = sorted({r["steps"] for r in other if r["model"] == "gpt"}) or [0]
    img = sorted({r["steps"] for r in other if r["model"] != "gpt"}) or [0]
    rest = [p for p in PARTS if p not in SCALE_PARTS]
    for steps in recipe:
        for seed in seeds:
            yield from recipe_plan([seed], steps)
    for seed in seeds:  # the batch grid in full for every seed: a record matches whichever lr it ran
        yield from batch_plan([seed], full=True)
        yield from ablate_plan([seed])
    for g in gpt:
        for i in img:
            for seed in seeds:
                yield from plan(rest, [seed], g, i)


def _curve(runs: list[dict]) -> dict:
    """Mean and sample std over seeds of the validation loss at the steps every run evaluated."""
    common = set.intersection(*({c["step"] for c in r["curve"]} for r in runs))
    steps = [c["step"] for c in runs[0]["curve"] if c["step"] in common]
    at = [{c["step"]: c["val_loss"] for c in r["curve"]} for r in runs]
    ms = [_ms([a[s] for a in at]) for s in steps]
    return {"step": steps, "val_loss": [m for m, _ in ms], "val_loss_std": [s for _, s in ms]}


def _reference(row: dict, rows: list[dict], everything: list[dict]) -> dict | None:
    """The row's reference: the recipe's best-grid Lion row, else a Lion row of the same model,
    β2, steps and tying in the same part, else in another part."""
    if row["part"] == "recipe":
        return next((x for x in rows if x["label"] == RECIPE_LION and x["steps"] == row["steps"]), None)
    if row["part"] == "batch":
        return best_batch_row(rows, row["label"].split()[0], "Lion")

    def lion(x):
        return (x["vote"] == "grad" and x["optimizer"] == "lion" and "Lion" in x["label"] and x["model"] == row["model"]
                and x["beta2"] == row["beta2"] and x["steps"] == row["steps"] and x["tied"] == row["tied"])
    return next((x for x in rows if lion(x)), None) or \
        next((x for x in everything if x["part"] != "recipe" and lion(x)), None)


def summarize(records: list[dict]) -> dict[str, list[dict]]:
    """{part: [row, ...]} in plan order; rows without any record are left out."""
    by_key: dict[str, list[dict]] = {}
    for r in records:
        by_key.setdefault(r["key"], []).append(r)
    rows: dict[tuple[str, str, int], dict] = {}
    for spec in _specs(records):
        got = [r for r in by_key.get(spec.key(), []) if r["seed"] == spec.seed][:1]
        for r in got:
            row = rows.setdefault((spec.part, spec.label, spec.steps), {
                "part": spec.part, "label": spec.label, "model": spec.model, "beta2": spec.beta2, "tied": spec.tied,
                "vote": spec.vote, "optimizer": spec.optimizer, "lr": spec.lr, "weight_decay": spec.weight_decay,
                "runs": {}})
            row["runs"].setdefault(r["seed"], r)
    out: dict[str, list[dict]] = {}
    for (part, _, _), row in rows.items():
        by_seed = row.pop("runs")
        runs = [by_seed[s] for s in sorted(by_seed)]
        row["seeds"] = [r["seed"] for r in runs]
        row["steps"] = runs[0]["steps"]
        row["val_loss"] = _ms([r["final"]["val_loss"] for r in runs])
        if "val_acc" in runs[0]["final"]:
            row["val_acc"] = _ms([r["final"]["val_acc"] for r in runs])
        row["left_plateau"] = [left_plateau(r["curve"]) for r in runs]
        row["wall_s"] = statistics.fmean(r["wall_s"] for r in runs)
        row["params"] = runs[0]["params"]
        row["curve"] = _curve(runs)
        spreads = [r["momentum_spread"] for r in runs if "momentum_spread" in r]
        if spreads:
            row["momentum_spread"] = {k: statistics.fmean(s[k] for s in spreads) for k in spreads[0]}
        out.setdefault(part, []).append(row)
    everything = [x for rows_ in out.values() for x in rows_]
    for rows_ in out.values():
        for row in rows_:
            ref = _reference(row, rows_, everything)
            row["vs_ref"] = None if ref is None else compare(row, ref)
            row["gap_to_lion"] = None if ref is None else row["vs_ref"]["delta"]
            if row["part"] in ("recipe", "batch"):
                adamw = best_batch_row(rows_, row["label"].split()[0], "AdamW") if row["part"] == "batch" else \
                    next((x for x in rows_ if x["label"] == RECIPE_ADAMW and x["steps"] == row["steps"]), None)
                row["vs_adamw"] = None if adamw is None or adamw is row else compare(row, adamw)
    return out


def left_plateau(curve: list[dict]) -> int | None:
    """The first evaluated step whose validation loss is below ``PLATEAU_EXIT`` (None: never)."""
    return next((c["step"] for c in curve if c["val_loss"] < PLATEAU_EXIT), None)


def best_batch_row(rows: list[dict], batch: str, opt: str) -> dict | None:
    """The ``batch`` part's row of ``opt`` at global batch ``batch`` ("B=48") with the most seeds,
    then the lowest mean final loss (later seeds run only the first seed's best lr)."""
    mine = [r for r in rows if r["part"] == "batch" and r["label"].split()[:2] == [batch, opt]]
    return min(mine, key=lambda r: (-len(r["seeds"]), r["val_loss"][0])) if mine else None


def batch_table(rows: list[dict]) -> list[str]:
    """Per global batch, each optimizer's best row: mean ± std (seeds), its lr, Δ vs AdamW's best."""
    head = "| global batch (steps) | " + " | ".join(f"{o}: val loss (n) @ lr; Δ vs AdamW" for o in BATCH_OPTS) + " |"
    lines = [head, "|" + "---|" * (len(BATCH_OPTS) + 1)]
    for per_worker, steps, _ in BATCH_POINTS + BATCH_LONG:
        cells = [f"{4 * per_worker} ({steps})"]
        for opt in BATCH_OPTS:
            r = best_batch_row(rows, batch_name(per_worker, steps), opt)
            if r is None:
                cells.append("—")
                continue
            cmp = r.get("vs_adamw")
            d = "" if opt == "AdamW" or cmp is None else f"; {cmp['delta']:+.3f} ({cmp['verdict']})"
            cells.append(f"{_mean_std(r['val_loss'], digits=3)} ({len(r['seeds'])}) @ {r['lr']:g}{d}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _mean_std(ms: tuple[float, float | None], scale: float = 1.0, digits: int = 4) -> str:
    m, s = ms
    return f"{scale * m:.{digits}f} ± " + ("n/a" if s is None else f"{scale * s:.{digits}f}")


def _delta_cells(row: dict, cmp: dict | None, ref_name: str) -> list[str]:
    if cmp is None:
        return [f"n/a (no {ref_name} row)", "n/a"]
    if cmp["ref_part"] == row["part"] and cmp["ref"] == row["label"]:
        return ["0 (reference)", "—"]
    d = f"{cmp['delta']:+.4f}" + ("" if cmp["noise"] is None else f" (2σ {cmp['noise']:.4f})")
    return [d, cmp["verdict"]]


def best_recipe_lion(rows: list[dict]) -> dict | None:
    """The recipe's Lion grid point with the lowest mean final loss among those that have records."""
    grid = {f"Lion lr={lr:g} wd={wd:g}" for lr, wd in LION_GRID}
    lions = [r for r in rows if r["label"] in grid]
    return min(lions, key=lambda r: r["val_loss"][0]) if lions else None


def markdown(summary: dict[str, list[dict]]) -> str:
    """One Markdown table per part, the reference row and the noise rule under it; no nan."""
    lines = []
    for part in PARTS:
        rows = summary.get(part)
        if not rows:
            continue
        acc = any("val_acc" in r for r in rows)
        recipe = part in ("recipe", "batch")
        ref_name = "Lion"
        head = "| run | seeds | steps | val loss (mean ± std) | Δ vs Lion | vs noise |"
        if recipe:
            head += " Δ vs AdamW | vs noise |"
        at_scale = part in SCALE_PARTS
        head += (" val acc |" if acc else "") + (" left the plateau (step, per seed) |" if at_scale else "")
        head += " s/run |"
        lines += [f"### {part}", "", head, "|" + "---|" * (head.count("|") - 1)]
        for r in rows:
            cells = [r["label"], str(len(r["seeds"])), str(r["steps"]), _mean_std(r["val_loss"])]
            cells += _delta_cells(r, r.get("vs_ref"), ref_name)
            if recipe:
                is_ref = r["label"] == RECIPE_ADAMW if part == "recipe" else \
                    r is best_batch_row(rows, r["label"].split()[0], "AdamW")
                cells += ["0 (reference)", "—"] if is_ref else _delta_cells(r, r.get("vs_adamw"), "AdamW")
            if acc:
                cells.append(_mean_std(r["val_acc"], 100, 1) + " %" if "val_acc" in r else "n/a")
            if at_scale:
                cells.append(" / ".join("never" if v is None else str(v) for v in r["left_plateau"]))
            cells.append(f"{r['wall_s']:.0f}")
            lines.append("| " + " | ".join(cells) + " |")
        refs = sorted({(r["vs_ref"]["ref_part"], r["vs_ref"]["ref"]) for r in rows if r.get("vs_ref")})
        lines.append("")
        if refs:
            if part == "batch":
                lines.append("Reference: at each global batch, the Lion (Δ vs Lion) and AdamW (Δ vs AdamW) row "
                             "with the most seeds, then the lowest mean. " + NOISE_RULE + ".")
            else:
                lines.append("Reference (Δ vs Lion): " + "; ".join(f"{lab} ({p})" if p != part else lab
                                                                  for p, lab in refs)
                             + ("; Δ vs AdamW: " + RECIPE_ADAMW if recipe else "") + ". " + NOISE_RULE + ".")
        else:
            lines.append(f"No Lion row to compare with. {NOISE_RULE}.")
        if at_scale:
            lines.append(f"Left the plateau: the first evaluated step with validation loss below {PLATEAU_EXIT} "
                         "(the byte-unigram plateau is near 3.3); never: not within the run.")
        if part == "batch":
            lines += ["", "Best lr per optimizer and global batch (the same ~1.5M tokens each; "
                                  "the 2000-step row at 48 sequences has 4x the tokens):", ""] + batch_table(rows)
        best = best_recipe_lion(rows) if part == "recipe" else None
        if best is not None and best["label"] != RECIPE_LION:
            lines.append(f"Note: the Lion grid point with the lowest mean is {best['label']} "
                         f"({_mean_std(best['val_loss'])}, {len(best['seeds'])} seeds), "
                         f"not the planned best {RECIPE_LION}.")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict[str, list[dict]], fig_dir: str, tag: str = "") -> list[str]:
    """Per part: final val loss (bars, ±std) and mean val-loss curves with a ± one std band over
    seeds; the momentum spread per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(fig_dir, exist_ok=True)
    paths = []
    for part, rows in summary.items():
        metric = "val_acc" if part == "vision" else "val_loss"
        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.2))
        names = [r["label"] for r in rows]
        ys = [(m, s or 0.0) for m, s in (r.get(metric, (float("nan"), None)) for r in rows)]
        colors = ["tab:gray" if "Lion" in n else "tab:orange" if n == RECIPE_ADAMW else "tab:blue" for n in names]
        ax0.barh(range(len(rows)), [y[0] for y in ys], xerr=[y[1] for y in ys], color=colors)
        ax0.set_yticks(range(len(rows)), names, fontsize=8)
        ax0.invert_yaxis()
        finite = [y for y in ys if y[0] == y[0]]
        if finite:
            lo, hi = min(m - s for m, s in finite), max(m + s for m, s in finite)
            ax0.set_xlim(lo - 0.1 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
        ax0.set_xlabel(("validation accuracy" if metric == "val_acc" else "final validation loss") + " (mean ± std)")
        for r in rows:
            c = r["curve"]
            (line,) = ax1.plot(c["step"], c["val_loss"], marker="o", ms=3,
                               label=f"{r['label']} ({len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''})",
                               ls="--" if "Lion" in r["label"] else "-")
            std = c.get("val_loss_std") or []
            if std and all(s is not None for s in std):
                ax1.fill_between(c["step"], [m - s for m, s in zip(c["val_loss"], std)],
                                 [m + s for m, s in zip(c["val_loss"], std)], color=line.get_color(), alpha=0.2)
        ax1.set_xlabel("step")
        ax1.set_ylabel("validation loss (mean over seeds, band ± 1 std)")
        ax1.legend(fontsize=7)
        n_seeds = max(len(r["seeds"]) for r in rows)
        fig.suptitle(f"study: {part} (up to {n_seeds} seed{'s' if n_seeds > 1 else ''} per row, 4 workers)")
        fig.tight_layout()
        path = os.path.join(fig_dir, f"{part}{tag}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    if summary.get("batch"):
        paths.append(_plot_batch(summary["batch"], fig_dir, tag, plt))
    spread = [r for rows in summary.values() for r in rows if "momentum_spread" in r and "sync none" in r["label"]]
    if spread:
        fig, ax = plt.subplots(figsize=(11, 4))
        names = list(dict.fromkeys(n for r in spread for n in r["momentum_spread"]))  # untied adds head.weight
        width = 0.8 / len(spread)
        for i, r in enumerate(spread):
            vals = [r["momentum_spread"].get(n, float("nan")) for n in names]
            ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"{r['part']}: {r['label']}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=70, fontsize=7)
        ax.set_ylabel("max over elements of std across workers")
        ax.set_title("momentum spread per tensor at the end, no sync (paper Fig. 6); tied: wte = head; mean over seeds")
        ax.legend(fontsize=7)
        fig.tight_layout()
        # the recipe-scale runs get their own name, so their report leaves the tiny study's plot alone
        scale = "_recipe" if all(r["part"] in SCALE_PARTS for r in spread) else ""
        path = os.path.join(fig_dir, f"momentum_spread{scale}{tag}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _plot_batch(rows: list[dict], fig_dir: str, tag: str, plt) -> str:
    """Each optimizer's best row per global batch: validation loss against tokens seen and against
    step (mean over seeds, band ± one std); one colour per optimizer, one line style per batch."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = dict(zip(BATCH_OPTS, ("tab:orange", "tab:gray", "tab:blue", "tab:green")))
    styles = ("-", "--", ":", "-.")
    for (per_worker, steps, _), ls in zip(BATCH_POINTS + BATCH_LONG, styles):
        seqs = 4 * per_worker
        for opt in BATCH_OPTS:
            r = best_batch_row(rows, batch_name(per_worker, steps), opt)
            if r is None:
                continue
            c = r["curve"]
            lo = [m - (s or 0.0) for m, s in zip(c["val_loss"], c["val_loss_std"])]
            hi = [m + (s or 0.0) for m, s in zip(c["val_loss"], c["val_loss_std"])]
            for ax, xs in ((axes[0], [st * seqs * 64 / 1e6 for st in c["step"]]), (axes[1], c["step"])):
                ax.plot(xs, c["val_loss"], ls=ls, color=colors[opt],
                        label=f"{opt}, {seqs} seqs x {steps} steps, lr {r['lr']:g} ({len(r['seeds'])} seeds)")
                ax.fill_between(xs, lo, hi, color=colors[opt], alpha=0.15)
    axes[0].set_xlabel("tokens seen (millions)")
    axes[1].set_xlabel("step")
    axes[1].set_xscale("log")
    for ax in axes:
        ax.set_ylabel("validation loss")
    axes[0].legend(fontsize=6)
    fig.suptitle("study: batch size at the recipe's token budget, and 48 sequences for 2000 steps "
                 "(best lr per optimizer and batch)")
    fig.tight_layout()
    path = os.path.join(fig_dir, f"batch_tokens{tag}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="tables and plots from study.jsonl")
    ap.add_argument("records", nargs="?", default="bench/results/study.jsonl")
    ap.add_argument("--figures", default="docs/figures/study")
    ap.add_argument("--summary", default=None, help="summary JSON (default: the records' path with _summary.json)")
    ap.add_argument("--markdown", default=None, help="also write the Markdown tables to this file")
    ap.add_argument("--tag", default="", help="suffix for the PNG names (e.g. _long)")
    a = ap.parse_args(argv)
    records = read_jsonl(a.records, partial=True)
    summary = summarize(records)
    path = a.summary or os.path.splitext(a.records)[0] + "_summary.json"
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    for p in plot(summary, a.figures, a.tag):
        print("wrote", p)
    text = markdown(summary)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text + "\n")
    matched = sum(len(r["seeds"]) for rows in summary.values() for r in rows)
    print(f"{len(records)} records; {matched} (row, seed) entries matched to plan rows")
    print(text)


if __name__ == "__main__":
    main()
