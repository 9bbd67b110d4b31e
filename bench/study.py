"""Convergence study at CPU scale: the paper's ablations, on tiny models and on nanoGPT's CPU recipe.

Parts (docs/design.md §2, §4, §5; the paper's Table 2 / Figs. 4, 5, 9, 10, 14):

0. ``recipe`` — the shape of nanoGPT's CPU recipe for Shakespeare (``RECIPE``: 4 layers, 4 heads,
   width 128, block 64, 4 workers x 3 sequences, 2000 steps, warm-up 100, cosine to 0.1 of the
   peak): AdamW at nanoGPT's settings (lr 1e-3, wd 0.1) as the reference row; Lion on a grid of
   (lr, wd) with lr·wd = 1e-4 (``LION_GRID``; the edges on seed 0 only); Lion Cub 1-bit, 4-bit
   binary and 8-bit L1 lanes at Lion's best. Written to its own JSONL (``--out``).
0b. ``batch`` — the recipe's token budget (~1.5M tokens) at global batches of 12, 48 and 192
   sequences (``BATCH_POINTS``: 2000 / 500 / 125 steps, warm-up 5% of them): AdamW, Lion, Lion
   Cub 1-bit and 4-bit binary, each on its own 3-point lr grid around a centre that grows as the
   square root of the batch (``batch_lrs``), extended by doubling or halving where the first seed's
   best sat on an edge (``BATCH_EXTEND``; ``batch_grid``). The grid runs on the first seed; later
   seeds run only each optimizer's best lr of the first seed, read from the records
   (``best_batch_lrs``). Beyond the budget (``BATCH_LONG``), 48 sequences for 2000 steps at
   each optimizer's best lrs at 48 sequences (500 steps) and at 12 (2000 steps) compare the
   optimizers per step (labels "B=48@2000 ...").
0c. ``ablate`` — the paper's ablations at the recipe's scale, at Lion's best recipe settings:
   8-bit L1 / L0 / L∞ and 4-bit binary / L∞ / L1 lanes; the 1-bit vote's tie rules; 4-bit
   lanes with momentum sync none / all / io / adaptive at β2 = 0.99 and 0.95. Runs equal to a
   recipe run (Lion, 1-bit, 4-bit binary, 8-bit L1) are the same experiment and reuse its record.

1. ``quant``  — the vote through sign / Linf / L1 / L0 in 4- and 8-bit p-bit lanes vs Lion.
2. ``ties``   — the 1-bit vote (``onebit``) whose ties and zeros go to +1, to -1, or alternate
   by step: ``LionCub(vote='onebit', tie=...)``.
3. ``msync``  — β2 ∈ {0.95, 0.99} × momentum sync none / all / io every 10 / adaptive.
4. ``vision`` — a small ResNet and a small ViT on digits: Lion, 1-bit, 4-bit, 8-bit L1.
5. ``tied``   — untied vs tied GPT embeddings (byte vocabulary, 256): does io sync still match?

Driver: one group of ``--nproc`` gloo workers is spawned with the harness's launcher
(``lioncub.harness.launch.spawn_local``) and runs every (config, seed) in turn, so the
~2 s torch start-up is paid once, not per run. The loop is a lean copy of the harness's
(its models, data loaders and lr schedule), because ``harness.run(config)`` has no
momentum-sync, tie-rule or model-width options. "Lion" is ``LionCub(vote='grad')``: fp32
gradient all-reduce then plain Lion, identical momenta on every rank.

Rank 0 appends one JSON line per finished run to ``--out`` (so a killed study keeps what it
finished and a rerun skips it); ``bench/study_report.py`` turns that file into tables and plots.

    OMP_NUM_THREADS=1 PYTHONPATH=src python3 bench/study.py --parts quant,ties --seeds 0,1,2
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lioncub import LionCub
from lioncub.harness.data import (ImageLoader, TokenLoader, ensure_prepared, eval_batches,
                                  image_eval_batches, load_images)
from lioncub.harness.data.text import read_meta
from lioncub.harness.launch import spawn_local
from lioncub.harness.models import param_groups
from lioncub.harness.models.gpt import GPT, GPTConfig
from lioncub.harness.models.resnet import BasicBlock, ResNet
from lioncub.harness.models.vit import ViT

PARTS = ("recipe", "batch", "ablate", "quant", "ties", "msync", "tied", "vision")
BLOCK = 32  # GPT context; with width 32 and 2 layers the GPT has ~35k params (CPU is scarce)
TIE_RULES = ("plus", "minus", "alternate")  # the library's lioncub.vote.TIE_RULES, in table order


@dataclass(frozen=True)
class Spec:
    """One training run. ``tie_rule`` (``vote='onebit'`` only) is LionCub's ``tie``."""

    part: str
    label: str
    model: str = "gpt"  # gpt | resnet | vit
    vote: str = "grad"
    bits: int | None = None
    quantizer: str | None = None
    tie_rule: str | None = None
    beta2: float = 0.99
    sync: str = "none"
    tied: bool = True
    seed: int = 0
    steps: int = 150
    lr: float = 2e-3
    optimizer: str = "lion"  # lion: LionCub(vote=...); adamw: AdamW after an fp32 gradient all-reduce
    layers: int = 2
    heads: int = 4
    embd: int = 32
    block: int = BLOCK
    batch: int = 8  # sequences per worker per step
    weight_decay: float = 0.1
    warmup: int = 10

    def key(self) -> str:
        """Identity of the run without its part/label: equal keys are the same experiment.
        Fields at their tiny-study defaults are left out, so earlier records keep their keys."""
        d = asdict(self)
        del d["part"], d["label"]
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return json.dumps(d, sort_keys=True)


_LATER_FIELDS = dict(optimizer="lion", layers=2, heads=4, embd=32, block=BLOCK, batch=8, weight_decay=0.1, warmup=10)
# nanoGPT's CPU recipe for Shakespeare: gpt-mini's shape, a global batch of 12 sequences of 64 tokens
RECIPE = dict(layers=4, heads=4, embd=128, block=64, batch=3, warmup=100, steps=2000)
ADAMW = dict(optimizer="adamw", lr=1e-3, weight_decay=0.1)
LION_GRID = ((1e-4, 1.0), (3e-5, 3.0), (3e-4, 0.3))  # (lr, wd), the best first; lr·wd = 1e-4


def recipe_plan(seeds, steps: int = RECIPE["steps"]) -> list[Spec]:
    """The ``recipe`` part, seed by seed (a study stopped early holds whole seeds)."""
    out = []
    shape = dict(RECIPE, steps=steps)
    best_lr, best_wd = LION_GRID[0]
    lion = dict(shape, lr=best_lr, weight_decay=best_wd)
    for seed in seeds:
        out.append(Spec("recipe", "AdamW (nanoGPT)", seed=seed, **dict(shape, **ADAMW)))
        for lr, wd in LION_GRID[: 3 if seed == seeds[0] else 1]:
            out.append(Spec("recipe", f"Lion lr={lr:g} wd={wd:g}", seed=seed, **dict(shape, lr=lr, weight_decay=wd)))
        out.append(Spec("recipe", "1-bit (onebit)", vote="onebit", seed=seed, **lion))
        out.append(Spec("recipe", "4-bit binary (pbit)", vote="pbit", bits=4, seed=seed, **lion))
        out.append(Spec("recipe", "8-bit L1 (pbit)", vote="pbit", bits=8, quantizer="l1", seed=seed, **lion))
    return out


# (sequences per worker, steps, warm-up steps): global batches of 12, 48, 192 at 12·64·2000 tokens
BATCH_POINTS = ((3, 2000, 100), (12, 500, 25), (48, 125, 6))
BATCH_OPTS = ("AdamW", "Lion", "1-bit", "4-bit")
BATCH_WD = {"AdamW": 0.1, "Lion": 1.0}  # nanoGPT's AdamW; the recipe grid's best Lion decay (lion family)
# Beyond the token budget: 48 sequences for the recipe's 2000 steps (4x the tokens), to compare the
# optimizers per step. Each runs only its best lr of the 500-step grid at 48 sequences and its best
# lr at 12 sequences (2000 steps), no grid of its own.
BATCH_LONG = ((12, 2000, 100),)


def batch_name(per_worker: int, steps: int) -> str:
    """The label prefix of a batch point: "B=48" at the token budget, "B=48@2000" beyond it."""
    budget = any((per_worker, steps) == (p, n) for p, n, _ in BATCH_POINTS)
    return f"B={4 * per_worker}" if budget else f"B={4 * per_worker}@{steps}"


def batch_lrs(opt: str, per_worker: int) -> tuple[float, ...]:
    """The 3-point lr grid of ``opt`` at ``per_worker`` sequences: the batch-12 centre (AdamW 1e-3,
    the Lion family 1e-4) times sqrt(batch / 12), times 1/2, 1, 2."""
    centre = (1e-3 if opt == "AdamW" else 1e-4) * (per_worker / 3) ** 0.5
    return tuple(float(f"{centre * f:.3g}") for f in (0.5, 1.0, 2.0))


# Grid points added on the first seed because its best sat on an edge of ``batch_lrs``:
# {(sequences per worker, optimizer): (lr, ...)}.
BATCH_EXTEND: dict[tuple[int, str], tuple[float, ...]] = {
    (48, "AdamW"): (1e-3,),  # 2e-3 best of 2e-3 / 4e-3 / 8e-3 at 192 sequences
    (48, "4-bit"): (1.6e-3,),  # 8e-4 best of 2e-4 / 4e-4 / 8e-4
    (12, "Lion"): (8e-4,),  # 4e-4 best of 1e-4 / 2e-4 / 4e-4 at 48 sequences
    (48, "Lion"): (1.6e-3, 3.2e-3),  # 8e-4 best of 2e-4 / 4e-4 / 8e-4 (on the plateau at 125 steps); then 1.6e-3
}


def batch_grid(opt: str, per_worker: int) -> tuple[float, ...]:
    """Every lr the first seed runs for ``opt`` at ``per_worker`` sequences: ``batch_lrs`` and its
    extensions, ascending."""
    return tuple(sorted(batch_lrs(opt, per_worker) + BATCH_EXTEND.get((per_worker, opt), ())))


def _batch_spec(opt: str, per_worker: int, steps: int, warmup: int, lr: float, seed: int) -> Spec:
    shape = dict(RECIPE, batch=per_worker, steps=steps, warmup=warmup)
    wd = BATCH_WD["AdamW" if opt == "AdamW" else "Lion"]
    label = f"{batch_name(per_worker, steps)} {opt} lr={lr:g}"
    extra = {"AdamW": dict(optimizer="adamw"), "Lion": {}, "1-bit": dict(vote="onebit"),
             "4-bit": dict(vote="pbit", bits=4)}[opt]
    return Spec("batch", label, seed=seed, **dict(shape, lr=lr, weight_decay=wd), **extra)


def batch_plan(seeds, best: dict | None = None, full: bool = False) -> list[Spec]:
    """The ``batch`` part. The first seed runs every grid point; a later seed runs each
    (per-worker batch, optimizer)'s lr from ``best`` (absent: not yet known, so not planned),
    or, with ``full``, every grid point (what the report matches records against). The
    ``BATCH_LONG`` points run, on every seed, the best lrs of the same per-worker batch and of the
    budget point with the same step count only."""
    out = []
    for i, seed in enumerate(seeds):
        for long, points in ((False, BATCH_POINTS), (True, BATCH_LONG)):
            for per_worker, steps, warmup in points:
                for opt in BATCH_OPTS:
                    # a long point: the best lr at its batch, and the best at the budget point of its
                    # step count (Lion's 500-step best need not suit 2000 steps)
                    keys = [(per_worker, opt)] + [(p, opt) for p, n, _ in BATCH_POINTS if long and n == steps]
                    known = sorted({(best or {})[k] for k in keys if k in (best or {})})
                    lrs = batch_grid(opt, per_worker) if full or (i == 0 and not long) else known
                    out += [_batch_spec(opt, per_worker, steps, warmup, lr, seed) for lr in lrs]
    return out


def best_batch_lrs(records: list[dict], seed: int) -> dict:
    """{(per-worker batch, optimizer): lr} with the lowest final val loss among ``seed``'s records
    of the ``batch`` grid (matched by experiment key, so reused recipe runs count)."""
    got = {r["key"]: r for r in records if r["seed"] == seed}
    best = {}
    for per_worker, steps, warmup in BATCH_POINTS:
        for opt in BATCH_OPTS:
            runs = [(got[s.key()]["final"]["val_loss"], s.lr) for s in
                    (_batch_spec(opt, per_worker, steps, warmup, lr, seed) for lr in batch_grid(opt, per_worker))
                    if s.key() in got]
            if runs:
                best[(per_worker, opt)] = min(runs)[1]
    return best


def ablate_plan(seeds) -> list[Spec]:
    """The ``ablate`` part: the paper's ablations at the recipe's shape, at Lion's best (lr, wd)."""
    lr, wd = LION_GRID[0]
    out = []
    for seed in seeds:
        g = dict(RECIPE, lr=lr, weight_decay=wd, seed=seed)
        out.append(Spec("ablate", f"Lion lr={lr:g} wd={wd:g}", **g))
        for bits, quants in ((8, ("l1", "l0", "linf")), (4, (None, "linf", "l1"))):
            for q in quants:
                name = "binary" if q is None else {"l1": "L1", "l0": "L0", "linf": "Linf"}[q]
                out.append(Spec("ablate", f"{bits}-bit {name}", vote="pbit", bits=bits, quantizer=q, **g))
        out.append(Spec("ablate", "1-bit, ties alternate (default)", vote="onebit", **g))
        for rule in ("plus", "minus"):
            out.append(Spec("ablate", f"1-bit, ties {rule}", vote="onebit", tie_rule=rule, **g))
        for b2 in (0.99, 0.95):
            if b2 != 0.99:
                out.append(Spec("ablate", f"Lion b2={b2}", beta2=b2, **g))
            for sync in ("none", "all", "io", "adaptive"):
                if not (b2 == 0.99 and sync == "none"):  # = "4-bit binary" above
                    out.append(Spec("ablate", f"4-bit, sync {sync}, b2={b2}", vote="pbit", bits=4, beta2=b2,
                                    sync=sync, **g))
    return out


def plan(parts, seeds, gpt_steps: int, img_steps: int, recipe_steps: int = RECIPE["steps"],
         batch_best: dict | None = None) -> list[Spec]:
    """Every run of the requested parts (a run shared by two parts appears once per part)."""
    out = recipe_plan(seeds, recipe_steps) if "recipe" in parts else []
    if "batch" in parts:
        out += batch_plan(seeds, batch_best)
    if "ablate" in parts:
        out += ablate_plan(seeds)
    for seed in seeds:
        g = dict(seed=seed, steps=gpt_steps)
        if "quant" in parts:
            out.append(Spec("quant", "Lion (grad all-reduce)", **g))
            out.append(Spec("quant", "sign 4b", vote="pbit", bits=4, quantizer="sign", **g))
            # 4-bit lanes leave s = 1 level for P = 4 (2sP <= 15): every quantizer is then
            # ternary; only Linf's (the most collapsed) is kept, to fit the CPU budget.
            out.append(Spec("quant", "linf 4b", vote="pbit", bits=4, quantizer="linf", **g))
            for q in ("linf", "l1", "l0"):
                out.append(Spec("quant", f"{q} 8b", vote="pbit", bits=8, quantizer=q, **g))
        if "ties" in parts:
            for rule in TIE_RULES:
                out.append(Spec("ties", f"1-bit, ties {rule}", vote="onebit", tie_rule=rule, **g))
            out.append(Spec("ties", "ties -> 0 (4-bit pbit)", vote="pbit", bits=4, **g))
        if "msync" in parts or "tied" in parts:
            tied_opts = ([True] if "msync" in parts else []) + ([False] if "tied" in parts else [])
            for tied in tied_opts:
                part = "msync" if tied else "tied"
                betas = (0.95, 0.99) if tied else (0.95,)
                for b2 in betas:
                    # β2 = 0.99 without sync already matches Lion in the paper: only "none" is run
                    syncs = ("none", "io") if not tied else ("none",) if b2 == 0.99 else \
                        ("none", "all", "io", "adaptive")
                    out.append(Spec(part, f"Lion b2={b2}", beta2=b2, tied=tied, **g))
                    for s in syncs:
                        out.append(Spec(part, f"4-bit, sync {s}, b2={b2}", vote="pbit", bits=4, beta2=b2,
                                        sync=s, tied=tied, **g))
        if "vision" in parts:
            for m in ("resnet", "vit"):
                v = dict(model=m, seed=seed, steps=img_steps, lr=1e-3)
                out.append(Spec("vision", f"{m}: Lion", **v))
                out.append(Spec("vision", f"{m}: 1-bit", vote="onebit", **v))
                out.append(Spec("vision", f"{m}: 4-bit", vote="pbit", bits=4, **v))
                out.append(Spec("vision", f"{m}: 8-bit L1", vote="pbit", bits=8, quantizer="l1", **v))
    return out


# ----------------------------------------------------------------------------- the optimizer of a run
class AllReduceAdamW(torch.optim.AdamW):
    """AdamW after an fp32 mean all-reduce of the gradients (what DDP + AdamW computes)."""

    skipped_steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
        return super().step(closure)


def make_optimizer(spec: Spec, params, **kw) -> torch.optim.Optimizer:
    """The run's optimizer: ``LionCub`` with the spec's vote, lane width, quantizer and tie rule,
    or (``optimizer='adamw'``) AdamW after a gradient all-reduce."""
    if spec.optimizer == "adamw":
        return AllReduceAdamW(params, lr=kw["lr"], betas=kw.get("betas", (0.9, 0.999)))
    extra = dict(bits=spec.bits, quantizer=spec.quantizer) if spec.vote == "pbit" else {}
    if spec.tie_rule is not None:
        extra["tie"] = spec.tie_rule
    return LionCub(params, vote=spec.vote, **extra, **kw)


def run_optimizer(spec: Spec, params, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer a run trains with: ``make_optimizer`` with the spec's lr, β2, seed and
    momentum sync (every 10 steps), skipping non-finite steps."""
    return make_optimizer(spec, params, lr=spec.lr, betas=(0.9, spec.beta2), seed=spec.seed, model=model,
                          momentum_sync=spec.sync, sync_every=10, nonfinite="skip_step")


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


def _loss(model, x, y, is_gpt):
    if is_gpt:
        return model(x, y)[1], None
    logits = model(x)
    return F.cross_entropy(logits, y), (logits.argmax(-1) == y).sum()


@torch.no_grad()
def _evaluate(model, val, is_gpt) -> dict:
    model.eval()
    tot = torch.zeros(3, dtype=torch.float64)  # loss·n, correct, n
    for x, y in val:
        loss, correct = _loss(model, x, y, is_gpt)
        tot += torch.tensor([loss.item() * len(y), 0 if correct is None else correct.item(), len(y)], dtype=torch.float64)
    dist.all_reduce(tot)
    model.train()
    out = {"val_loss": (tot[0] / tot[2]).item()}
    if not is_gpt:
        out["val_acc"] = (tot[1] / tot[2]).item()
    return out


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


def _lr_scale(step: int, steps: int, warmup: int = 10, floor: float = 0.1) -> float:
    import math
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train_one(spec: Spec, cache_dir: str, eval_every: int) -> dict:
    """Train ``spec`` on this rank (inside the process group); every rank returns the same record."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.seed)
    loader, val, info = _data(spec, rank, world, cache_dir)
    model = _model(spec, info)
    is_gpt = spec.model == "gpt"
    groups = param_groups(model, lr=spec.lr, weight_decay=spec.weight_decay)
    base = [g["lr"] for g in groups]
    opt = run_optimizer(spec, groups, model)
    every = max(1, spec.steps // 20) if spec.part == "batch" else eval_every  # 20 points on every batch's curve
    curve, losses, t0 = [], [], time.perf_counter()
    for step in range(spec.steps):
        for g, b in zip(opt.param_groups, base):
            g["lr"] = b * _lr_scale(step, spec.steps, warmup=spec.warmup)
        x, y = loader.next_batch()
        loss, _ = _loss(model, x, y, is_gpt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        done = step + 1
        if done % every == 0 or done == spec.steps:
            curve.append({"step": done, **_evaluate(model, val, is_gpt)})
    train_loss = torch.tensor(sum(losses[-20:]) / len(losses[-20:]), dtype=torch.float64)
    dist.all_reduce(train_loss)
    rec = {"key": spec.key(), **asdict(spec), "world": world, "final": curve[-1],
           "train_loss_last20": train_loss.item() / world, "curve": curve,
           "skipped_steps": opt.skipped_steps, "wall_s": time.perf_counter() - t0,
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


def load_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
        records = [r for r in load_records(out) if r.get("world") == nproc]
        best = best_batch_lrs(records, seeds[0]) if "batch" in parts else None
        todo, seen = [], {r["key"] for r in records}
        for spec in plan(parts, seeds, gpt_steps, img_steps, recipe_steps, batch_best=best):
            if spec.key() not in seen and (only is None or spec.label in only):
                seen.add(spec.key())
                todo.append(spec)
        if not todo:
            break
        spawn_local(study_worker, Job(todo, out, cache_dir, eval_every), nproc)
    return load_records(out)


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
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    run_study(a.parts.split(","), [int(s) for s in a.seeds.split(",")], gpt_steps=a.gpt_steps,
              img_steps=a.img_steps, nproc=a.nproc, out=a.out, eval_every=a.eval_every, recipe_steps=a.recipe_steps,
              only=None if a.only is None else set(a.only.split(";")))
    print(f"[study] done in {time.perf_counter() - t0:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
