"""Tables and plots from the study's raw records (``bench/study.py`` -> ``study.jsonl``).

Each row of the plan (``study.plan``) is matched to its records by experiment key, so a run
shared by two parts (e.g. Lion at β2 = 0.99) is counted in both. Per row: final validation
loss (and accuracy for images) as mean ± sample std over seeds, its gap to the part's Lion
row, and the mean wall time of one run. Writes ``summary.json`` and one PNG per part.

    PYTHONPATH=src python3 bench/study_report.py bench/results/study.jsonl \
        --figures docs/figures/study --summary bench/results/study_summary.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from study import PARTS, load_records, plan  # noqa: E402


def _ms(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def summarize(records: list[dict]) -> dict[str, list[dict]]:
    """{part: [row, ...]} in plan order; rows without any record are left out."""
    by_key: dict[str, list[dict]] = {}
    for r in records:
        by_key.setdefault(r["key"], []).append(r)
    seeds = sorted({r["seed"] for r in records})
    gpt = [r["steps"] for r in records if r["model"] == "gpt"]
    img = [r["steps"] for r in records if r["model"] != "gpt"]
    specs = plan(PARTS, seeds, gpt[0] if gpt else 0, img[0] if img else 0)
    rows: dict[tuple[str, str], dict] = {}
    for spec in specs:
        for r in by_key.get(spec.key(), [])[:1]:
            row = rows.setdefault((spec.part, spec.label), {"part": spec.part, "label": spec.label,
                                                            "model": spec.model, "beta2": spec.beta2, "runs": []})
            row["runs"].append(r)
    out: dict[str, list[dict]] = {}
    for (part, _), row in rows.items():
        runs = row.pop("runs")
        row["seeds"] = sorted(r["seed"] for r in runs)
        row["steps"] = runs[0]["steps"]
        row["val_loss"] = _ms([r["final"]["val_loss"] for r in runs])
        if "val_acc" in runs[0]["final"]:
            row["val_acc"] = _ms([r["final"]["val_acc"] for r in runs])
        row["wall_s"] = statistics.fmean(r["wall_s"] for r in runs)
        row["params"] = runs[0]["params"]
        steps = [c["step"] for c in runs[0]["curve"]]
        row["curve"] = {"step": steps, "val_loss": [statistics.fmean(r["curve"][i]["val_loss"] for r in runs)
                                                     for i in range(len(steps))]}
        spreads = [r["momentum_spread"] for r in runs if "momentum_spread" in r]
        if spreads:
            row["momentum_spread"] = {k: statistics.fmean(s[k] for s in spreads) for k in spreads[0]}
        out.setdefault(part, []).append(row)
    for rows_ in out.values():  # gap to the Lion row with the same model and β2
        for row in rows_:
            ref = [x for x in rows_ if "Lion" in x["label"] and x["model"] == row["model"]
                   and x["beta2"] == row["beta2"]]
            row["gap_to_lion"] = row["val_loss"][0] - ref[0]["val_loss"][0] if ref else float("nan")
    return out


def markdown(summary: dict[str, list[dict]]) -> str:
    """One Markdown table per part."""
    lines = []
    for part in PARTS:
        rows = summary.get(part)
        if not rows:
            continue
        acc = any("val_acc" in r for r in rows)
        head = "| run | seeds | steps | val loss (mean ± std) | Δ vs Lion |" + (" val acc |" if acc else "") + " s/run |"
        lines += [f"### {part}", "", head, "|" + "---|" * (head.count("|") - 1)]
        for r in rows:
            m, s = r["val_loss"]
            cells = [r["label"], str(len(r["seeds"])), str(r["steps"]), f"{m:.4f} ± {s:.4f}", f"{r['gap_to_lion']:+.4f}"]
            if acc:
                am, asd = r.get("val_acc", (float("nan"),) * 2)
                cells.append(f"{100 * am:.1f} ± {100 * asd:.1f} %")
            cells.append(f"{r['wall_s']:.0f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict[str, list[dict]], fig_dir: str, tag: str = "") -> list[str]:
    """Per part: final val loss (bars, ±std) and mean val-loss curves; the momentum spread per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(fig_dir, exist_ok=True)
    paths = []
    for part, rows in summary.items():
        metric = "val_acc" if part == "vision" else "val_loss"
        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.2))
        names = [r["label"] for r in rows]
        ys = [r.get(metric, (float("nan"),) * 2) for r in rows]
        ax0.barh(range(len(rows)), [y[0] for y in ys], xerr=[0 if y[1] != y[1] else y[1] for y in ys],
                 color=["tab:gray" if "Lion" in n else "tab:blue" for n in names])
        ax0.set_yticks(range(len(rows)), names, fontsize=8)
        ax0.invert_yaxis()
        lo = min(y[0] - (y[1] if y[1] == y[1] else 0) for y in ys)
        hi = max(y[0] + (y[1] if y[1] == y[1] else 0) for y in ys)
        ax0.set_xlim(lo - 0.1 * (hi - lo + 1e-9), hi + 0.1 * (hi - lo + 1e-9))
        ax0.set_xlabel(("validation accuracy" if metric == "val_acc" else "final validation loss") + " (mean ± std)")
        for r in rows:
            ax1.plot(r["curve"]["step"], r["curve"]["val_loss"], marker="o", ms=3, label=r["label"],
                     ls="--" if "Lion" in r["label"] else "-")
        ax1.set_xlabel("step")
        ax1.set_ylabel("validation loss (mean over seeds)")
        ax1.legend(fontsize=7)
        fig.suptitle(f"study: {part} ({len(rows[0]['seeds'])} seeds, 4 workers)")
        fig.tight_layout()
        path = os.path.join(fig_dir, f"{part}{tag}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
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
        path = os.path.join(fig_dir, f"momentum_spread{tag}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="tables and plots from study.jsonl")
    ap.add_argument("records", nargs="?", default="bench/results/study.jsonl")
    ap.add_argument("--figures", default="docs/figures/study")
    ap.add_argument("--summary", default="bench/results/study_summary.json")
    ap.add_argument("--tag", default="", help="suffix for the PNG names (e.g. _long)")
    a = ap.parse_args(argv)
    summary = summarize(load_records(a.records))
    with open(a.summary, "w") as f:
        json.dump(summary, f, indent=1)
    for p in plot(summary, a.figures, a.tag):
        print("wrote", p)
    print(markdown(summary))


if __name__ == "__main__":
    main()
