"""The default ``lioncub train``: the same model and data trained three ways, the choice a user makes —

- ``lion-grad-fp32``: Lion after an fp32 gradient all-reduce every step (what DDP does),
- ``lioncub-onebit-mean``: Lion Cub every step at the setting README recommends, the 1-bit mean
  (``LionCub(vote='onebit', aggregate='mean')``, :data:`lioncub.harness.config.RECOMMENDED`; with ``--vote`` the vote asked for),
- ``localcub-hauto-mean8``: the local-step setting the repository's results recommend where bytes decide
  (``LocalCub``, :data:`LOCALCUB`; bench/README.md, "Local steps under the vote"), with H picked from the
  measured link and compute (``local_steps='auto'``; a step-matched run takes the largest fixed H <= 50 that
  fits its steps),

each for the same seconds of training time (``time_budget``; or step-matched with ``--steps``), then a
summary that leads with time to the same loss (Lion fp32's final validation loss), the per-step table
(printed, ``compare.csv``) and a loss plot (``loss.png``) whose title names the link and the regime."""
from __future__ import annotations

import math
import os

from .config import TrainConfig
from .launch import launch
from .metrics import read_jsonl, write_csv
from .plot import plot_runs
from .train import train_worker

# LocalCub as bench/README.md's race (issue 15, results/race_local_100mbit.json) ran its leader,
# `lcub-mean8-h50-nest0.7-ef-adamw`: first to Lion fp32's loss at 100 Mbit/s, tied with DiLoCo at 1 Gbit/s
# on 3.8x fewer bytes. H = 50 local AdamW steps (lr 1e-3), the deltas summed as an 8-bit L1 lane mean
# with error feedback, a Nesterov outer step of 0.7.
LOCALCUB = dict(local_steps=50, inner="adamw", lr=1e-3, vote="pbit", bits=8, quantizer="l1", aggregate="mean",
                error_feedback=True, outer="nesterov", outer_lr=0.7)
LOCALCUB_NAME = "localcub-h{H}-mean8"
DESCRIPTIONS = {
    "base": "Lion, fp32 gradient all-reduce every step (what DDP does)",
    "cub": "LionCub: Lion Cub's majority vote every step",
    "cub-mean": "LionCub: the 1-bit mean every step (1 bit per element each way, Lion on the decoded mean)",
    "local": "LocalCub: {H} local AdamW steps (lr 1e-3), then the deltas' 8-bit L1 lane mean, error feedback, "
             "Nesterov outer lr 0.7 (bench/README.md, race_local: first to Lion's loss at 100 Mbit/s; 'auto': H from "
             "the measured link: 50, more where a round would cost more than half its compute)",
}


def local_period(config: TrainConfig) -> int | str | None:
    """LocalCub's H in the comparison: ``'auto'`` (picked from the measured link and compute:
    :mod:`lioncub.optim.auto_steps`; at least 50, the H its Nesterov 0.7 was tuned at, more where a round would
    cost more than half its compute), or with a step-matched run the largest H <= 50 (the race's setting) that
    divides ``steps`` and ``eval_every`` (None when only H = 1 would: no LocalCub row)."""
    if config.nodes > 1:  # LocalCub runs flat
        return None
    if config.time_budget is not None:
        return "auto"
    for h in range(LOCALCUB["local_steps"], 1, -1):
        if config.steps % h == 0 and config.eval_every % h == 0:
            return h
    return None


def variants(config: TrainConfig) -> list[TrainConfig]:
    """Lion fp32 (LionCub vote='grad'), LionCub (pbit unless told) and LocalCub (:data:`LOCALCUB`) runs of
    ``config``, each in its own directory under ``config.out``."""
    cub_vote = config.vote if config.vote != "grad" else "pbit"
    base = config.replace(optimizer="lioncub", vote="grad", bits=None, quantizer=None, aggregate="vote", name=None,
                          resume=None)
    cub = config.replace(optimizer="lioncub", vote=cub_vote, name=None, resume=None)
    runs = [base, cub]
    h = local_period(config)
    if h is not None:  # 'auto' from the H its outer rate was tuned at: longer rounds only where the link is slow
        floor = dict(min_local_steps=LOCALCUB["local_steps"]) if h == "auto" else {}
        runs.append(config.replace(**{**LOCALCUB, "local_steps": h, **floor}, optimizer="lioncub",
                                   name=LOCALCUB_NAME.format(H=h),
                                   resume=None, grad_dtype="fp32", momentum_sync="none", overlap=False))
    return [c.replace(out=os.path.join(config.out, c.label)) for c in runs]


def link_text(link: str | None, world: int) -> str:
    """The header's line on the network the workers run behind, with its regime
    r = (fp32 all-reduce time) / (compute time per step)."""
    if link is None:
        return ("link: loopback (no emulated link): the network is not the bottleneck here (r ~ 1), so the "
                "bytes saved hardly show as time")
    if link == "unshaped":
        return f"link: emulated cluster, {world} network namespaces, links unshaped (the CPU-bound floor)"
    return (f"link: emulated cluster, each of {world} workers in its own network namespace behind a {link_rate(link)} "
            f"link (tc tbf): network-bound, regime r = fp32 all-reduce / compute per step ~ {regime_hint(link)} on a "
            "2-core CPU host (measured below); GPUs on 1-10 Gbit/s Ethernet sit at r ~ 20-200, where the gain "
            "is larger")


def link_rate(link: str) -> str:
    """'100mbit' -> '100 Mbit/s'."""
    from ..testbed import parse_rate

    bps = parse_rate(link)[1]
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def regime_hint(link: str) -> str:
    """r for gpt-mini's defaults on a 2-core host: ~7 at 100 Mbit/s (429 ms of all-reduce, 65 ms of compute
    per step, measured), inversely proportional to the rate."""
    from ..testbed import parse_rate

    r = 7 * 100e6 / parse_rate(link)[1]
    return f"{r:.2g}" if r < 10 else f"{r:.0f}"


def run_compare(config: TrainConfig, *, link: str | None = None, echo=print) -> dict:
    """Train every variant, write compare.csv and loss.png under ``config.out``; return the summaries.
    ``link``: the emulated link the workers run behind ('100mbit', 'unshaped'), None: loopback."""
    runs = variants(config)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    world = int(os.environ.get("WORLD_SIZE", config.nproc))
    if rank0:
        echo(header(config, runs, link, world))
    summaries = launch(_compare_worker, config)  # one process group for every run
    if not rank0:  # under torchrun only rank 0 reports
        return {"runs": summaries}
    csv_path = os.path.join(config.out, "compare.csv")
    write_csv(summaries, csv_path)
    r = measured_regime(summaries[0])
    where = "loopback" if link is None else ("unshaped links" if link == "unshaped" else f"{link_rate(link)} links")
    title = (f"{config.model} on {config.data}, {summaries[0]['world_size']} workers, {where}"
             + (f": r = {r:.1f} (fp32 all-reduce / compute per step)" if r is not None else ""))
    png = plot_runs([s["run_dir"] for s in summaries], os.path.join(config.out, "loss.png"), title=title)
    echo("\n" + time_to_loss_text(summaries))
    echo("\n" + format_table(summaries))
    echo(f"\nwrote {csv_path}\nwrote {png}")
    return {"runs": summaries, "csv": csv_path, "plot": png}


def header(config: TrainConfig, runs: list[TrainConfig], link: str | None, world: int) -> str:
    how = (f"{config.time_budget:g} s of training each" if config.time_budget is not None
           else f"{config.steps} steps each")
    lines = [f"lioncub train: {config.model} on {config.data}, {world} workers x {config.batch_size} sequences, "
             f"{how}, {len(runs)} ways:"]
    width = max(len(c.label) for c in runs)
    for key, c in zip(("base", "cub", "local"), runs):
        text = DESCRIPTIONS.get(f"{key}-{c.aggregate}", DESCRIPTIONS[key]).format(H=c.local_steps)
        if key != "local":
            text += f" (lr {c.lr:g})"
        lines.append(f"  {c.label:{width}}  {text}")
    lines.append(link_text(link, world))
    return "\n".join(lines)


def _compare_worker(config: TrainConfig) -> list[dict]:
    return [train_worker(v) for v in variants(config)]


def measured_regime(base: dict) -> float | None:
    """Lion fp32's all-reduce time over its compute time per step (the regime r), or None."""
    vote, compute = base.get("t_vote_ms"), base.get("t_compute_ms")
    if not isinstance(vote, float) or not isinstance(compute, float) or not compute > 0 or math.isnan(vote):
        return None
    return vote / compute


def reached(run_dir: str, target: float) -> tuple[float, float, int] | None:
    """(training seconds, bytes sent by rank 0, step) at the run's first evaluation at or below ``target``,
    or None when none was."""
    records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    for e in (r for r in records if r["kind"] == "eval"):
        if e["val_loss"] <= target:
            sent = sum(r.get("bytes_sent", 0) for r in records if r["kind"] == "step" and r["step"] <= e["step"])
            return e["train_time"], sent, e["step"]
    return None


def time_to_loss_text(summaries: list[dict]) -> str:
    """The summary's lead: how much sooner (and on how many fewer bytes) each run reached Lion fp32's
    final validation loss than Lion fp32 did."""
    base, others = summaries[0], summaries[1:]
    target = base["final_val_loss"]
    ref = reached(base["run_dir"], target)
    if ref is None or not others:
        return f"{base['label']}: final validation loss {target:.4f}"
    t_ref, bytes_ref, _ = ref
    lines = [f"Time to the same loss: {base['label']} (Lion fp32) ended at validation loss {target:.4f} after "
             f"{t_ref:.1f} s of training ({base['steps']} steps, {bytes_ref / 1e6:.1f} MB sent per worker)."]
    width = max(len(s["label"]) for s in others)
    for s in others:
        hit = reached(s["run_dir"], target)
        if hit is None:
            lines.append(f"  {s['label']:{width}}  did not reach it in {s['train_time_s']:.1f} s "
                         f"(final {s['final_val_loss']:.4f})")
            continue
        t, sent, step = hit
        fewer = f"{bytes_ref / sent:.0f}x" if sent > 0 and bytes_ref / sent >= 10 else (
            f"{bytes_ref / sent:.1f}x" if sent > 0 else "-")
        lines.append(f"  {s['label']:{width}}  reached Lion fp32's final validation loss in {t:.1f} s, "
                     f"{t_ref / t:.1f}x sooner, sending {fewer} fewer bytes ({sent / 1e6:.2f} MB; step {step})")
    r = measured_regime(base)
    if r is not None:
        lines.append(f"Regime: {base['label']}'s all-reduce took {r:.1f}x its compute per step "
                     f"({base['t_vote_ms']:.0f} vs {base['t_compute_ms']:.0f} ms): r = {r:.1f}")
    return "\n".join(lines)


def format_table(summaries: list[dict]) -> str:
    """The per-step table printed at the end of the default run."""
    rows = [
        ("final val loss", "final_val_loss", "{:.4f}"),
        ("final train loss", "final_train_loss", "{:.4f}"),
        ("steps", "steps", "{:.0f}"),
        ("bytes sent / step", "bytes_sent_per_step", "{:,.0f}"),
        ("collectives / step", "n_collectives_per_step", "{:.2f}"),
        ("step time (ms)", "t_step_ms", "{:.1f}"),
        ("  compute (fwd+bwd)", "t_compute_ms", "{:.1f}"),
        ("  vote / allreduce", "t_vote_ms", "{:.1f}"),
        ("  other", "t_other_ms", "{:.1f}"),
        ("tokens/s (all workers)", "tokens_per_s", "{:,.0f}"),
        ("images/s (all workers)", "images_per_s", "{:,.0f}"),
        ("training time (s)", "train_time_s", "{:.1f}"),
    ]
    width = max(14, *(len(s["label"]) for s in summaries))
    lines = [f"{'per step':26}" + "".join(f"{s['label']:>{width + 2}}" for s in summaries)]
    for title, key, fmt in rows:
        if not any(key in s for s in summaries):
            continue
        cells = [fmt.format(s[key]) if isinstance(s.get(key), (int, float)) and not math.isnan(s[key]) else "-"
                 for s in summaries]
        lines.append(f"{title:26}" + "".join(f"{c:>{width + 2}}" for c in cells))
    base = summaries[0]
    if len(summaries) > 1:
        lines.append("")
        for other in summaries[1:]:
            if other.get("bytes_sent_per_step") and other.get("t_step_ms"):
                lines.append(f"{other['label']} sends {base['bytes_sent_per_step'] / other['bytes_sent_per_step']:.1f}x "
                             f"fewer bytes per step than {base['label']}; step time ratio "
                             f"{base['t_step_ms'] / other['t_step_ms']:.2f}x")
    for s in summaries:  # a slower worker (the testbed's): what each worker computed and slept, in seconds
        if s.get("stragglers"):
            lines.append(f"{s['label']} ({s['stragglers']}), per worker: compute {s['worker_compute_s']} s, "
                         f"slept {s['worker_slept_s']} s, paused {s['worker_paused_s']} s")
    return "\n".join(lines)
