"""Overlay runs: validation (and smoothed training) loss against step and against training time.

``plot_runs([RUN_DIR, ...], "loss.png")`` reads each run's metrics.jsonl and
writes one PNG with two panels (loss vs step, loss vs seconds of training).
"""
from __future__ import annotations

import os

from .metrics import read_jsonl


def _label(run_dir: str, records: list[dict]) -> str:
    return os.path.basename(os.path.normpath(run_dir))


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_runs(run_dirs: list[str], out_png: str, *, title: str | None = None) -> str:
    """Write the two-panel loss plot of ``run_dirs`` to ``out_png``; returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install matplotlib (or lioncub[plot])") from None
    if not run_dirs:
        raise ValueError("plot: give at least one run directory")
    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, run_dir in enumerate(run_dirs):
        path = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            raise ValueError(f"plot: {run_dir!r} has no metrics.jsonl")
        records = read_jsonl(path)
        steps = [r for r in records if r["kind"] == "step"]
        evals = [r for r in records if r["kind"] == "eval"]
        color, name = f"C{i}", _label(run_dir, records)
        if steps:
            loss = _smooth([r["loss"] for r in steps], max(1, len(steps) // 25))
            ax_step.plot([r["step"] for r in steps], loss, color=color, alpha=0.45, lw=1, label=f"{name} train")
            ax_time.plot([r["train_time"] for r in steps], loss, color=color, alpha=0.45, lw=1)
        if evals:
            ax_step.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", color=color, ms=3,
                         label=f"{name} val")
            ax_time.plot([r["train_time"] for r in evals], [r["val_loss"] for r in evals], "o-", color=color, ms=3)
    ax_step.set(xlabel="step", ylabel="loss", title="loss vs step")
    ax_time.set(xlabel="training time (s)", ylabel="loss", title="loss vs time")
    for ax in (ax_step, ax_time):
        ax.grid(alpha=0.3)
    ax_step.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
