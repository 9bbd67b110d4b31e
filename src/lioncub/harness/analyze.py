"""``lioncub analyze``: the paper's instruments on a small GPT trained with LionCub.

On ``workers`` local gloo processes, a ``model`` GPT is trained with LionCub
(``momentum_sync='none'``) and measured (``examples/instruments_gpt.py`` is a thin
wrapper of this module):

* every ``tie_every`` steps, the live tie rate of the vote (overall and per layer);
* every ``every`` steps (:func:`lioncub.instruments.analyze`): the distribution of the
  pre-sign update c (Fig. 3), sign match / flip / zero per quantizer and bit width
  (Fig. 4), per-layer momentum std across workers (Fig. 6), and the adaptive policy's
  sketched divergence beside the exact one;
* then (``adaptive_run``) a second run with ``momentum_sync=Adaptive(threshold)``
  counting which tensors the adaptive policy averaged and what it cost.

Writes ``instruments.json`` (with a ``summary``), ``sign_match.csv``,
``momentum_std.csv``, ``tie_rate.csv`` and PNGs into ``out``. Python entry:
``run(AnalyzeConfig(...)) -> record``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass

import torch

from .. import LionCub, comm
from ..optim.flags import step_kwargs
from .. import instruments as ins
from . import report
from ..optim.lioncub import OPTIMIZER_VOTES
from ..engine.momentum import Adaptive, MomentumSync
from .models.gpt import GPT_SIZES, build_gpt

_VOTES = tuple(v for v in OPTIMIZER_VOTES if v not in ("grad", "auto"))  # the instruments need a sign vote


@dataclass(kw_only=True)
class AnalyzeConfig:
    workers: int = 4
    """gloo processes on 127.0.0.1."""
    steps: int = 300
    """Training steps of the measured run (and of the adaptive run)."""
    model: str = "gpt-tiny"
    """A GPT size from lioncub.harness.models.gpt.GPT_SIZES."""
    tied: bool = False
    """Tie the input embedding and the output head."""
    data: str = "shakespeare"
    """Text corpus for lioncub.harness.data (falls back to random tokens if unavailable)."""
    batch_size: int = 4
    block_size: int = 64
    lr: float = 1e-3
    beta2: float = 0.99
    vote: str = "pbit"
    """LionCub vote method."""
    every: int = 50
    """Run all instruments every this many steps."""
    tie_every: int = 5
    """Measure the tie rate every this many steps."""
    threshold: float = 0.25
    """Adaptive policy threshold on the relative divergence r."""
    sync_every: int = 10
    """Adaptive run: check divergence every this many steps."""
    adaptive_run: bool = True
    """Also train with momentum_sync=Adaptive(threshold) and report what it synced."""
    seed: int = 0
    """Seed of model init, data order and quantizer RNGs."""
    cache_dir: str | None = None
    """Where the tokenised corpus goes (None: $LIONCUB_CACHE or ~/.cache/lioncub)."""
    out: str = "docs/figures/instruments"
    """Directory for instruments.json, the CSVs and PNGs."""

    def __post_init__(self) -> None:
        for name in ("workers", "steps", "batch_size", "block_size", "every", "tie_every", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2 (instruments run from step 1), got {self.steps}")
        if self.vote not in _VOTES:
            raise ValueError(f"vote must be one of {', '.join(_VOTES)}; got {self.vote!r}")
        if self.model not in GPT_SIZES:
            raise ValueError(f"model must be one of {', '.join(GPT_SIZES)}; got {self.model!r}")


def _batches(cfg: AnalyzeConfig, rank: int, world: int):
    """(next_batch, source): the harness's token loader on this rank's shard, or random tokens."""
    try:
        from .config import default_cache_dir
        from .data import TokenLoader, ensure_prepared

        path = os.path.join(ensure_prepared(cfg.data, cfg.cache_dir or default_cache_dir()), "train.bin")
        loader = TokenLoader(path, block_size=cfg.block_size, batch_size=cfg.batch_size, rank=rank,
                             world_size=world, seed=cfg.seed)
        return loader.next_batch, f"{cfg.data} (byte-level, vocab 256, disjoint shard per rank)"
    except (ImportError, ValueError, OSError) as exc:
        g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)

        def rand():
            x = torch.randint(0, 256, (cfg.batch_size, cfg.block_size + 1), generator=g)
            return x[:, :-1], x[:, 1:]

        return rand, f"random tokens (corpus unavailable: {exc})"


def _train(cfg: AnalyzeConfig, rank: int, world: int, *, measure: bool) -> dict:
    torch.manual_seed(cfg.seed)
    model = build_gpt(cfg.model, vocab_size=256, block_size=cfg.block_size, tied_embeddings=cfg.tied)
    policy = "none" if measure else Adaptive(threshold=cfg.threshold)
    opt = LionCub(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2), **step_kwargs(dict(
        vote=cfg.vote, model=model, momentum_sync=policy, sync_every=cfg.sync_every)))
    probe = MomentumSync(Adaptive(threshold=cfg.threshold), model=model, params=list(model.parameters()),
                         group=opt.group, world_size=opt.world_size)
    next_batch, source = _batches(cfg, rank, world)
    out = {"data": source, "loss": [], "ties": [], "records": [], "bytes_per_step": []}
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        x, y = next_batch()
        loss = model(x, y)[1]
        loss.backward()
        if measure and step % cfg.tie_every == 0:
            out["ties"].append({"step": step, **ins.live_tie_rate(opt, model)})
        if measure and (step % cfg.every == 0 or step == cfg.steps - 1) and step > 0:
            rec = ins.analyze(opt, model, seed=cfg.seed)
            idx = [i for i, p in enumerate(model.parameters()) if "exp_avg" in opt.state[p]]
            r = probe.divergence(opt.state, idx)  # what the adaptive policy would see (not counted)
            rec["adaptive_r"] = {probe.names[i]: v for i, v in r.items()}
            if step != cfg.steps - 1:
                rec["distribution"].pop("all")  # keep one full histogram: the last
            out["records"].append(rec)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["bytes_per_step"].append(opt.last_step_stats.bytes_sent)
        if step % 10 == 0 or step == cfg.steps - 1:
            mean = loss.detach().clone()
            comm.all_reduce(mean)  # on the model's device, as the loss is
            out["loss"].append({"step": step, "loss": float(mean) / world})
    out["wall_s"] = time.perf_counter() - t0
    out["momentum_sync"] = opt.momentum_sync.state_dict()
    out["n_params"] = sum(p.numel() for p in model.parameters())
    return out


def _worker(rank: int, world: int, cfg: AnalyzeConfig):
    result = {"measured": _train(cfg, rank, world, measure=True)}
    if cfg.adaptive_run:
        result["adaptive"] = _train(cfg, rank, world, measure=False)
    return json.loads(json.dumps(result, default=float)) if rank == 0 else None  # plain JSON values


def run(cfg: AnalyzeConfig) -> dict:
    """Train on ``cfg.workers`` gloo processes; write JSON/CSV/PNGs to ``cfg.out``; return the record."""
    from ..testbed.launch import spawn

    t0 = time.perf_counter()  # one CPU thread and gloo per rank (the launcher's default)
    result = spawn(_worker, cfg.workers, cfg, timeout_s=1800.0, deadline_s=float("inf"))[0]
    result["config"] = dataclasses.asdict(cfg)
    result["wall_s"] = time.perf_counter() - t0
    write_outputs(result, cfg.out)
    return result


def _summary(result: dict) -> dict:
    m = result["measured"]
    last = m["records"][-1]
    std = last["momentum_std"]
    ranked = sorted(std, key=lambda n: -std[n]["max_std"])
    ties = [t["all"] for t in m["ties"][1:]] or [float("nan")]  # step 0 has no momentum yet
    rows = {r["name"]: r for r in last["sign_match"]}
    out = {"step": last["step"], "final_loss": m["loss"][-1]["loss"], "data": m["data"],
           "layers_by_max_std": [(n, std[n]["max_std"], std[n]["relative"] ** 2) for n in ranked],
           "tie_rate_mean": sum(ties) / len(ties), "tie_rate_last": m["ties"][-1]["all"],
           "c_kurtosis": last["distribution"]["all"]["kurtosis"],
           "c_max_over_mean": last["distribution"]["all"]["max_over_mean"],
           "sign_match": {k: {x: rows[k][x] for x in ("match", "flip", "zero", "spurious", "kept")} for k in rows},
           "adaptive_would_sync": sorted(n for n, r in last["adaptive_r"].items() if r > result["config"]["threshold"])}
    if "adaptive" in result:
        a = result["adaptive"]
        n_steps = len(a["bytes_per_step"])
        out["adaptive_run"] = {"sync_counts": a["momentum_sync"]["sync_counts"],
                               "checks": a["momentum_sync"]["n_checks"],
                               "momentum_bytes_per_step": a["momentum_sync"]["bytes_sent"] / n_steps,
                               "vote_bytes_per_step": m["bytes_per_step"][-1],
                               "final_loss": a["loss"][-1]["loss"]}
    return out


def write_outputs(result: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    result["summary"] = _summary(result)
    report.write_json(result, os.path.join(out, "instruments.json"))
    m = result["measured"]
    last = m["records"][-1]
    report.write_csv([{"step": r["step"], **row} for r in m["records"] for row in r["sign_match"]],
                  os.path.join(out, "sign_match.csv"))
    report.write_csv([{"step": r["step"], "layer": n, **s, "r_exact": s["relative"] ** 2, "r_sketch": r["adaptive_r"].get(n)}
                   for r in m["records"] for n, s in r["momentum_std"].items()], os.path.join(out, "momentum_std.csv"))
    report.write_csv([{"step": t["step"], "all": t["all"], **t["layers"]} for t in m["ties"]],
                  os.path.join(out, "tie_rate.csv"))
    report.plot_distribution(last["distribution"]["all"], os.path.join(out, "c_distribution.png"),
                          title=f"c at step {last['step']} (rank 0)")
    report.plot_sign_match(last["sign_match"], os.path.join(out, "sign_match.png"))
    report.plot_layers({n: s["max_std"] for n, s in last["momentum_std"].items()},
                    os.path.join(out, "momentum_std_layers.png"), ylabel="max over elements of std across workers",
                    title=f"momentum std across {result['config']['workers']} workers, step {last['step']}", log=True)
    steps = [r["step"] for r in m["records"]]
    report.plot_series(steps, {n: [r["momentum_std"][n]["max_std"] for r in m["records"]] for n in last["momentum_std"]},
                    os.path.join(out, "momentum_std_over_time.png"), ylabel="max std across workers", log=True)
    report.plot_series([t["step"] for t in m["ties"]],
                    {k: [t["layers"][k] if k != "all" else t["all"] for t in m["ties"]]
                     for k in ["all"] + [n for n in m["ties"][0]["layers"] if n.startswith(("wte", "wpe", "head"))]},
                    os.path.join(out, "tie_rate.png"), ylabel="tie rate of the vote")
    report.plot_layers(last["adaptive_r"], os.path.join(out, "adaptive_divergence.png"),
                    ylabel="relative divergence r (sketch)", title=f"threshold {result['config']['threshold']}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per :class:`AnalyzeConfig` field (``--no-flag`` for booleans)."""
    for f in dataclasses.fields(AnalyzeConfig):
        flag = "--" + f.name.replace("_", "-")
        doc = _FIELD_HELP.get(f.name, "").replace("%", "%%")
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=doc)
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(flag, type=kind, default=f.default, help=f"{doc} (default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> AnalyzeConfig:
    """The config from parsed flags (extra attributes such as ``func`` are ignored)."""
    names = {f.name for f in dataclasses.fields(AnalyzeConfig)}
    return AnalyzeConfig(**{k: v for k, v in vars(args).items() if k in names})


def main_run(cfg: AnalyzeConfig) -> int:
    """Run, print the summary and where the files went; exit code 0."""
    result = run(cfg)
    print(json.dumps(result["summary"], indent=1, default=float))
    print(f"wrote {cfg.out} in {result['wall_s']:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0].strip("`"))
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return main_run(cfg)


def _field_docs() -> dict[str, str]:
    """Field docstrings of AnalyzeConfig (the string literal after each field), for --help."""
    import ast
    import inspect

    try:
        source = inspect.getsource(AnalyzeConfig)
    except (OSError, TypeError):  # no source (a frozen install): flags without help text
        return {}
    docs, prev = {}, None
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign):
            prev = node.target.id
        elif prev and isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant):
            docs[prev] = " ".join(str(node.value.value).split())
            prev = None
    return docs


_FIELD_HELP = _field_docs()
