"""Convergence study at CPU scale: the paper's ablations, on tiny models and on nanoGPT's CPU recipe.

Parts: ``bench/study_plan.py`` (what each part runs, as ``Spec``s).

Driver: one group of ``--nproc`` gloo workers is spawned with the harness's launcher
(``lioncub.harness.launch.spawn_local``) and runs every (config, seed) in turn, so the
~2 s torch start-up is paid once, not per run. Each run is the harness's loop
(:class:`lioncub.harness.loop.Loop`) on the harness's optimizer factory
(:func:`lioncub.harness.method.make_method`, configured by ``config_for(spec)``), on the study's own
model shapes and data shards (``_model``, ``_data``): what ``lioncub train`` runs with the same
settings. "Lion" is ``LionCub(vote='grad')``: fp32 gradient all-reduce then plain Lion, identical
momenta on every rank; "AdamW" the harness's ``--optimizer adamw`` (AdamW after an fp32 all-reduce).

Rank 0 appends one JSON line per finished run to ``--out`` (so a killed study keeps what it
finished and a rerun skips it); ``bench/study_report.py`` turns that file into tables and plots.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 -m bench.study --parts quant,ties --seeds 0,1,2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from bench.study_plan import PARTS, RECIPE, Spec, best_batch_lrs, plan
from lioncub.harness.config import TrainConfig
from lioncub.harness.data import (ImageLoader, TokenLoader, ensure_prepared, eval_batches,
                                  image_eval_batches, load_images)
from lioncub.harness.data.text import read_meta
from lioncub.harness.launch import spawn_local
from lioncub.harness.metrics import read_jsonl
from lioncub.harness.models import param_groups
from lioncub.harness.models.gpt import GPT, GPTConfig
from lioncub.harness.models.resnet import BasicBlock, ResNet
from lioncub.harness.models.vit import ViT
from lioncub.harness.loop import Loop
from lioncub.harness.method import make_method, make_optimizer
from lioncub.harness.schedule import lr_at
from lioncub.harness.train import evaluate


# ----------------------------------------------------------------------------- the optimizer of a run
def config_for(spec: Spec) -> TrainConfig:
    """The harness's configuration of ``spec``'s optimizer and schedule, for its one factory
    (:func:`lioncub.harness.method.make_method`): ``LionCub`` with the spec's vote, lanes, tie rule, error
    feedback, stochastic signs or 1-bit mean, β1/β2, seed and momentum sync (every 10 steps), skipping
    non-finite steps; or (``optimizer='adamw'``) AdamW after the harness's fp32 gradient all-reduce.
    ``model`` names only which loss the harness takes (a GPT's or an image model's): the study builds its
    own shapes (``_model``)."""
    shape = dict(model="gpt-mini" if spec.model == "gpt" else "resnet18", lr=spec.lr, weight_decay=spec.weight_decay,
                 betas=(spec.beta1, spec.beta2), seed=spec.seed, steps=spec.steps, warmup_steps=spec.warmup,
                 min_lr_ratio=0.1, batch_size=spec.batch, block_size=spec.block, tied_embeddings=spec.tied)
    if spec.optimizer == "adamw":
        return TrainConfig(optimizer="adamw", **shape)
    mean = {}
    if spec.aggregate != "vote":  # the 1-bit mean's own settings (the spec's restart defaults to none, LionCub's to 50)
        mean = dict(mean_adapt=spec.mean_adapt, mean_range=spec.mean_range, mean_norm=spec.mean_norm,
                    mean_restart=spec.mean_restart)
    return TrainConfig(optimizer="lioncub", vote=spec.vote, bits=spec.bits, quantizer=spec.quantizer,
                       tie=spec.tie_rule or "alternate", vote_error_feedback=spec.error_feedback,
                       stochastic_signs=spec.stochastic_signs, aggregate=spec.aggregate, momentum_sync=spec.sync,
                       sync_every=10, nonfinite="skip_step", **mean, **shape)


def run_optimizer(spec: Spec, params, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer a run of ``spec`` trains with (the harness's factory on :func:`config_for`)."""
    return make_optimizer(config_for(spec), params, model)


# ----------------------------------------------------------------------------- one run, per rank
def _model(spec: Spec, info: dict) -> torch.nn.Module:
    if spec.model == "gpt":  # default: 2 layers, 4 heads, width 32: 35k params tied (8k the byte embedding)
        return GPT(GPTConfig(n_layer=spec.layers, n_head=spec.heads, n_embd=spec.embd, vocab_size=info["vocab_size"],
                             block_size=spec.block, tied_embeddings=spec.tied))
    kw = dict(num_classes=info["num_classes"], in_channels=info["channels"])
    if spec.model == "resnet":  # 3 stages of one basic block, width 8 (~20k params)
        return ResNet(BasicBlock, [1, 1, 1], width=8, **kw)
    return ViT(image_size=info["image_size"], patch=2, dim=32, depth=2, heads=4, **kw)  # ~27k params


def _data(spec: Spec, rank: int, world: int, cache_dir: str):
    """(train loader, fixed val batches, info) for this rank."""
    if spec.model == "gpt":
        d = ensure_prepared("shakespeare", cache_dir)
        info = read_meta(d)
        loader = TokenLoader(os.path.join(d, "train.bin"), block_size=spec.block, batch_size=spec.batch, rank=rank,
                             world_size=world, seed=spec.seed)
        val = list(eval_batches(os.path.join(d, "val.bin"), block_size=spec.block, batch_size=16, n_batches=8,
                                rank=rank, world_size=world))
        return loader, val, info
    images = load_images("digits", seed=0)  # same split for every seed; seed moves init and order
    loader = ImageLoader(images.x_train, images.y_train, batch_size=32, rank=rank, world_size=world, seed=spec.seed)
    val = list(image_eval_batches(images.x_val, images.y_val, batch_size=128, n_batches=4, rank=rank,
                                  world_size=world))
    return loader, val, images.info


def _momentum_spread(opt, model) -> dict[str, float]:
    """Per named parameter: max over elements of the std across ranks of the momentum (Fig. 6)."""
    world = dist.get_world_size()
    out, seen = {}, set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        m = opt.state[p]["exp_avg"].reshape(-1).float()
        gathered = [torch.empty_like(m) for _ in range(world)]
        dist.all_gather(gathered, m)
        out[name] = torch.stack(gathered).std(0).max().item()
    return out


def train_one(spec: Spec, cache_dir: str, eval_every: int, probe=None) -> dict:
    """Train ``spec`` on this rank (inside the process group) through the harness's loop and optimizer
    factory; every rank returns the same record. ``probe(step, opt)``, if given, runs on every rank after
    ``backward()`` and before ``opt.step()`` (an instrument; it must not touch the model, the optimizer or
    the global RNG)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.seed)
    loader, val, info = _data(spec, rank, world, cache_dir)
    model = _model(spec, info)
    is_gpt = spec.model == "gpt"
    groups = param_groups(model, lr=spec.lr, weight_decay=spec.weight_decay)
    method = make_method(config_for(spec), model, groups)
    opt = method.opt
    curve, losses, t0 = [], [], time.perf_counter()

    def before_update(step, _method):
        if spec.momentum_restart and step == spec.momentum_restart:  # the control of LionCub's mean_restart
            # (Lion's momentum; each worker's own under a vote)
            for state in opt.state.values():
                state["exp_avg"].zero_()
        if probe is not None:
            probe(step, opt)

    def on_eval(record):
        curve.append({"step": record["step"], **{k: v for k, v in record.items() if k.startswith("val_")}})
        if os.environ.get("LIONCUB_STUDY_PROGRESS") and rank == 0:  # one line per evaluation, to stderr
            print(f"[study] {spec.label} seed {spec.seed} step {record['step']}: {curve[-1]}", file=sys.stderr,
                  flush=True)

    loop = Loop(lr=lambda step, clock: spec.lr * lr_at(step, spec.steps, spec.warmup, floor=0.1), steps=spec.steps,
                eval_every=max(1, spec.steps // 20) if spec.part == "batch" else eval_every,  # 20 points on a batch's curve
                probe=before_update, on_step=lambda info: losses.append(info.loss.item()), on_eval=on_eval)
    loop.run(method, loader, lambda: evaluate(model, val, is_gpt))
    train_loss = torch.tensor(sum(losses[-20:]) / len(losses[-20:]), dtype=torch.float64)
    dist.all_reduce(train_loss)
    rec = {"key": spec.key(), **asdict(spec), "world": world, "final": curve[-1],
           "train_loss_last20": train_loss.item() / world, "curve": curve,
           "skipped_steps": method.traffic.get("skipped_steps", 0), "wall_s": time.perf_counter() - t0,
           "params": sum(p.numel() for p in model.parameters())}
    if spec.vote != "grad" and spec.part in ("msync", "tied", "ablate"):
        rec["momentum_spread"] = _momentum_spread(opt, model)
    return rec


@dataclass
class Job:
    """What the spawned group runs: the specs, where results go. ``device`` is for the launcher."""

    specs: list
    out: str
    cache_dir: str
    eval_every: int = 50
    device: str = "cpu"
    done: list = field(default_factory=list)


def study_worker(job: Job) -> list[dict]:
    """Every rank runs every spec in order; rank 0 appends each record to ``job.out``."""
    records = []
    for spec in job.specs:
        rec = train_one(spec, job.cache_dir, job.eval_every)
        records.append(rec)
        if dist.get_rank() == 0:
            with open(job.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"[study] {spec.part:6s} {spec.label:28s} seed {spec.seed}: "
                  f"val {rec['final']['val_loss']:.4f} ({rec['wall_s']:.0f} s)", flush=True)
    return records


def run_study(parts, seeds, *, gpt_steps=150, img_steps=100, nproc=4, out="bench/results/study.jsonl",
              cache_dir=None, eval_every=50, only=None, recipe_steps=RECIPE["steps"]) -> list[dict]:
    """Run what ``out`` lacks (by experiment key), in one spawned group; return all records.

    ``only``: a set of run labels to restrict the plan to (None: all)."""
    from lioncub.harness.config import default_cache_dir

    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"parts must be among {PARTS}, got {bad}")
    cache_dir = cache_dir or default_cache_dir()
    ensure_prepared("shakespeare", cache_dir)  # tokenise once, before the workers start
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    # Two rounds: the batch part's later seeds need the first seed's best lrs, known after round one.
    for _ in range(2):
        records = [r for r in read_jsonl(out, partial=True) if r.get("world") == nproc]
        best = best_batch_lrs(records, seeds[0]) if "batch" in parts else None
        todo, seen = [], {r["key"] for r in records}
        for spec in plan(parts, seeds, gpt_steps, img_steps, recipe_steps, batch_best=best):
            if spec.key() not in seen and (only is None or spec.label in only):
                seen.add(spec.key())
                todo.append(spec)
        if not todo:
            break
        spawn_local(study_worker, Job(todo, out, cache_dir, eval_every), nproc)
    return read_jsonl(out, partial=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list from {PARTS}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--gpt-steps", type=int, default=150)
    ap.add_argument("--img-steps", type=int, default=100)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--recipe-steps", type=int, default=RECIPE["steps"], help="steps of the recipe part's runs")
    ap.add_argument("--out", default="bench/results/study.jsonl")
    ap.add_argument("--only", default=None, help="';'-separated run labels to restrict the plan to")
    ap.add_argument("--report-only", metavar="JSONL", help="print the tables of a study's records "
                    "(bench/study_report.py's markdown); run nothing")
    a = ap.parse_args(argv)
    if a.report_only:
        from bench import study_report

        print(study_report.markdown(study_report.summarize(read_jsonl(a.report_only, partial=True))))
        return
    t0 = time.perf_counter()
    run_study(a.parts.split(","), [int(s) for s in a.seeds.split(",")], gpt_steps=a.gpt_steps,
              img_steps=a.img_steps, nproc=a.nproc, out=a.out, eval_every=a.eval_every, recipe_steps=a.recipe_steps,
              only=None if a.only is None else set(a.only.split(";")))
    print(f"[study] done in {time.perf_counter() - t0:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
