"""Writers for the instruments' results (:mod:`lioncub.instruments`): JSON, CSV, and PNG plots.

Kept out of the core package: nothing the optimizer imports needs ``csv`` or matplotlib
(imported only when a plot is drawn). ``lioncub analyze`` (:mod:`lioncub.harness.analyze`)
writes its figures with these.
"""
from __future__ import annotations

import json

from .metrics import write_csv

__all__ = ["write_json", "write_csv", "plot_distribution", "plot_sign_match", "plot_layers", "plot_series"]


def write_json(obj, path: str) -> None:
    """``obj`` as indented JSON (tensors' floats as numbers)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=float)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_distribution(d: dict, path: str, *, title: str = "update vector c") -> None:
    """Bar histogram of :func:`lioncub.instruments.update_distribution` (log y), with kurtosis and max/mean."""
    plt = _pyplot()
    edges, counts = d["hist_edges"], d["hist_counts"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(edges[:-1], counts, width=edges[1] - edges[0], align="edge")
    ax.set_yscale("log")
    ax.set_xlabel("c / mean|c|  (ends hold the clipped tails)")
    ax.set_title(f"{title}: kurtosis {d['kurtosis']:.1f}, max/mean {d['max_over_mean']:.1f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sign_match(rows: list[dict], path: str) -> None:
    """Stacked bars of match / flip / zero per row of :func:`lioncub.instruments.sign_match`."""
    plt = _pyplot()
    names = [r["name"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows)), 3.8))
    bottom = [0.0] * len(rows)
    for key in ("match", "zero", "flip", "spurious"):
        vals = [r[key] for r in rows]
        ax.bar(names, vals, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("fraction of coordinates vs sign(Σ c_i)")
    ax.tick_params(axis="x", rotation=70)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layers(values: dict, path: str, *, ylabel: str, title: str = "", log: bool = False) -> None:
    """One bar per layer (``{name: value}``) in model order."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(values)), 4))
    ax.bar(list(values), list(values.values()))
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=80, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_series(xs: list, series: dict, path: str, *, xlabel: str = "step", ylabel: str = "", log: bool = False) -> None:
    """Lines ``{label: [y per x]}`` against ``xs``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, label=label)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

