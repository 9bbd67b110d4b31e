"""The default ``lioncub train``: the same model and data trained twice, with
Lion's gradient allreduce (vote='grad') and with Lion Cub, then a side-by-side
summary (printed, ``compare.csv``) and a loss plot (``loss.png``)."""
from __future__ import annotations

import math
import os

from .config import TrainConfig
from .metrics import write_csv
from .plot import plot_runs
from .launch import launch
from .train import train_worker


def variants(config: TrainConfig) -> list[TrainConfig]:
    """Baseline (LionCub vote='grad', fp32) and the Lion Cub run of ``config`` (pbit unless told)."""
    cub_vote = config.vote if config.vote != "grad" else "pbit"
    base = config.replace(optimizer="lioncub", vote="grad", bits=None, quantizer=None, name=None, resume=None)
    cub = config.replace(optimizer="lioncub", vote=cub_vote, name=None, resume=None)
    return [c.replace(out=os.path.join(config.out, c.label)) for c in (base, cub)]


def run_compare(config: TrainConfig, *, echo=print) -> dict:
    """Train every variant, write compare.csv and loss.png under ``config.out``; return the summaries."""
    summaries = launch(_compare_worker, config)  # one process group for both runs
    if int(os.environ.get("RANK", 0)) != 0:  # under torchrun only rank 0 reports
        return {"runs": summaries}
    csv_path = os.path.join(config.out, "compare.csv")
    write_csv(summaries, csv_path)
    png = plot_runs([s["run_dir"] for s in summaries], os.path.join(config.out, "loss.png"),
                    title=f"{config.model} on {config.data}, {summaries[0]['world_size']} workers")
    echo(format_table(summaries))
    echo(f"\nwrote {csv_path}\nwrote {png}")
    return {"runs": summaries, "csv": csv_path, "plot": png}


def _compare_worker(config: TrainConfig) -> list[dict]:
    return [train_worker(v) for v in variants(config)]


def format_table(summaries: list[dict]) -> str:
    """The side-by-side summary printed at the end of the default run."""
    rows = [
        ("final val loss", "final_val_loss", "{:.4f}"),
        ("final train loss", "final_train_loss", "{:.4f}"),
        ("bytes sent / step", "bytes_sent_per_step", "{:,.0f}"),
        ("collectives / step", "n_collectives_per_step", "{:.0f}"),
        ("step time (ms)", "t_step_ms", "{:.1f}"),
        ("  compute (fwd+bwd)", "t_compute_ms", "{:.1f}"),
        ("  vote / allreduce", "t_vote_ms", "{:.1f}"),
        ("  other", "t_other_ms", "{:.1f}"),
        ("tokens/s (all workers)", "tokens_per_s", "{:,.0f}"),
        ("images/s (all workers)", "images_per_s", "{:,.0f}"),
        ("training time (s)", "train_time_s", "{:.1f}"),
    ]
    width = max(14, *(len(s["label"]) for s in summaries))
    lines = [f"{'':26}" + "".join(f"{s['label']:>{width + 2}}" for s in summaries)]
    for title, key, fmt in rows:
        if not any(key in s for s in summaries):
            continue
        cells = [fmt.format(s[key]) if isinstance(s.get(key), (int, float)) and not math.isnan(s[key]) else "-"
                 for s in summaries]
        lines.append(f"{title:26}" + "".join(f"{c:>{width + 2}}" for c in cells))
    base, other = summaries[0], summaries[-1]
    if len(summaries) > 1 and other.get("bytes_sent_per_step"):
        lines.append(f"\n{other['label']} sends {base['bytes_sent_per_step'] / other['bytes_sent_per_step']:.1f}x "
                     f"fewer bytes per step than {base['label']}; step time ratio "
                     f"{base['t_step_ms'] / other['t_step_ms']:.2f}x")
    return "\n".join(lines)
