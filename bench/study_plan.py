"""What the convergence study runs: every run as a ``Spec``, part by part (``plan``).

Parts (docs/design.md §2, §4, §5; the paper's Table 2 / Figs. 4, 5, 9, 10, 14):

0. ``recipe`` — the shape of nanoGPT's CPU recipe for Shakespeare (``RECIPE``: 4 layers, 4 heads,
   width 128, block 64, 4 workers x 3 sequences, 2000 steps, warm-up 100, cosine to 0.1 of the
   peak): AdamW at nanoGPT's settings (lr 1e-3, wd 0.1) as the reference row; Lion on a grid of
   (lr, wd) with lr·wd = 1e-4 and of wd alone at the best lr (``LION_GRID``; all but the best on the
   first seed only); Lion Cub 1-bit, 4-bit binary and 8-bit L1 lanes at Lion's best. Written to its
   own JSONL (``--out``).
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
   lanes with momentum sync none / all / io / adaptive at β2 = 0.99 and 0.95; issue 34's error
   feedback and stochastic signs on the 1-bit and 4-bit binary votes (``VOTE_QUALITY``). Runs equal to a
   recipe run (Lion, 1-bit, 4-bit binary, 8-bit L1) are the same experiment and reuse its record.

1. ``quant``  — the vote through sign / Linf / L1 / L0 in 4- and 8-bit p-bit lanes vs Lion.
2. ``ties``   — the 1-bit vote (``onebit``) whose ties and zeros go to +1, to -1, or alternate
   by step: ``LionCub(vote='onebit', tie=...)``.
3. ``msync``  — β2 ∈ {0.95, 0.99} × momentum sync none / all / io every 10 / adaptive.
4. ``vision`` — a small ResNet and a small ViT on digits: Lion, 1-bit, 4-bit, 8-bit L1.
5. ``tied``   — untied vs tied GPT embeddings (byte vocabulary, 256): does io sync still match?

The runs themselves are ``bench/study.py``'s; ``bench/study_report.py`` matches records to
these plans by experiment key (``Spec.key``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

PARTS = ("recipe", "batch", "ablate", "quant", "ties", "msync", "tied", "vision")
BLOCK = 32  # GPT context; with width 32 and 2 layers the GPT has ~35k params (CPU is scarce)
TIE_RULES = ("plus", "minus", "alternate")  # the library's lioncub.votes.api.TIE_RULES, in table order


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
    error_feedback: str = "none"  # LionCub's error_feedback / stochastic_signs (issue 34)
    stochastic_signs: bool | float = False  # a float k: M = k·mean|v|
    aggregate: str = "vote"  # LionCub's aggregate: 'mean' is the 1-bit compressed mean (issue 34)
    mean_adapt: float = 1.25  # its γ and R (LionCub's mean_adapt / mean_range)
    mean_range: float = 30.0
    mean_norm: str = "arithmetic"  # LionCub's mean_norm
    mean_restart: int = 0  # LionCub's mean_restart (its default is 50; the first runs had none)
    momentum_restart: int = 0  # the momenta set to zero before this step: the control of mean_restart on Lion, the vote
    beta1: float = 0.9  # Lion's β1: the weight 1 − β1 of the step's gradient against the momentum
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

    def __post_init__(self):
        if self.momentum_restart and (self.aggregate == "mean" or self.optimizer != "lion"):
            raise ValueError(f"momentum_restart zeroes the momenta of Lion and the votes; the 1-bit mean restarts with "
                             f"mean_restart, got aggregate={self.aggregate!r}, optimizer={self.optimizer!r}")

    def key(self) -> str:
        """Identity of the run without its part/label: equal keys are the same experiment.
        Fields at their tiny-study defaults are left out, so earlier records keep their keys."""
        d = asdict(self)
        del d["part"], d["label"]
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return json.dumps(d, sort_keys=True)


_LATER_FIELDS = dict(optimizer="lion", layers=2, heads=4, embd=32, block=BLOCK, batch=8, weight_decay=0.1, warmup=10,
                     error_feedback="none", stochastic_signs=False, aggregate="vote",
                     mean_adapt=1.25, mean_range=30.0, mean_norm="arithmetic", mean_restart=0,
                     momentum_restart=0, beta1=0.9)
# nanoGPT's CPU recipe for Shakespeare: gpt-mini's shape, a global batch of 12 sequences of 64 tokens
RECIPE = dict(layers=4, heads=4, embd=128, block=64, batch=3, warmup=100, steps=2000)
ADAMW = dict(optimizer="adamw", lr=1e-3, weight_decay=0.1)
# Lion (lr, wd), the best first: lr·wd = 1e-4 along the first three, then the decay alone at the best lr
LION_GRID = ((1e-4, 1.0), (3e-5, 3.0), (3e-4, 0.3), (1e-4, 0.3), (1e-4, 3.0), (1e-4, 0.1))  # 0.1 as 0.3 won seed 0


def recipe_plan(seeds, steps: int = RECIPE["steps"]) -> list[Spec]:
    """The ``recipe`` part, seed by seed (a study stopped early holds whole seeds)."""
    out = []
    shape = dict(RECIPE, steps=steps)
    best_lr, best_wd = LION_GRID[0]
    lion = dict(shape, lr=best_lr, weight_decay=best_wd)
    for seed in seeds:
        out.append(Spec("recipe", "AdamW (nanoGPT)", seed=seed, **dict(shape, **ADAMW)))
        for lr, wd in LION_GRID if seed == seeds[0] else LION_GRID[:1]:
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
    (3, "AdamW"): (4e-3, 8e-3),  # 2e-3 best of 5e-4 / 1e-3 / 2e-3 at 12 sequences (not nanoGPT's 1e-3); then 4e-3
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


# Issue 34's mechanisms on the binary votes (lioncub.votes.feedback): (label, vote, Spec fields);
# run one with ``--parts ablate --only "1-bit EF (onebit-ef)"``.
VOTE_QUALITY = (
    ("1-bit EF (onebit-ef)", "onebit", dict(error_feedback="worker")),
    ("1-bit EF worker+server (onebit-ef2)", "onebit", dict(error_feedback="both")),
    ("1-bit EF server (onebit-efs)", "onebit", dict(error_feedback="server")),
    ("1-bit stochastic (onebit-stoch)", "onebit", dict(stochastic_signs=True)),
    ("1-bit EF + stochastic (onebit-ef-stoch)", "onebit", dict(error_feedback="worker", stochastic_signs=True)),
    ("4-bit binary EF (pbit-ef)", "pbit", dict(bits=4, error_feedback="worker")),
    # the next round (docs/results.md "Closing the gap"): server EF at a larger lr (its steps shrink where the
    # workers split; the decay lr·wd kept at 1e-4), and stochastic signs scaled to a typical magnitude
    ("1-bit EF server lr=2e-4 wd=0.5 (onebit-efs-lr2)", "onebit", dict(error_feedback="server", lr=2e-4,
                                                                        weight_decay=0.5)),
    ("1-bit EF server lr=4e-4 wd=0.25 (onebit-efs-lr4)", "onebit", dict(error_feedback="server", lr=4e-4,
                                                                         weight_decay=0.25)),
    ("1-bit stochastic M=0.5 mean (onebit-stoch-m0.5)", "onebit", dict(stochastic_signs=0.5)),
    ("1-bit stochastic M=1 mean (onebit-stoch-m1)", "onebit", dict(stochastic_signs=1.0)),
    ("1-bit stochastic M=2 mean (onebit-stoch-m2)", "onebit", dict(stochastic_signs=2.0)),
    ("1-bit, ties hold the last vote (onebit-hold)", "onebit", dict(tie_rule="hold")),
    # the third round: the same two 1-bit collectives carry an error-fed compressed mean of the gradients'
    # innovation, and every rank runs exact Lion on the decoded mean with a shared momentum
    ("1-bit mean, Lion on a shared momentum (onebit-mean)", "onebit", dict(aggregate="mean")),
    ("1-bit mean, flat scales (onebit-mean-flat)", "onebit", dict(aggregate="mean", mean_adapt=1.0)),
    ("1-bit mean, gamma=1.15 (onebit-mean-g1.15)", "onebit", dict(aggregate="mean", mean_adapt=1.15)),
    ("1-bit mean, gamma=1.5 (onebit-mean-g1.5)", "onebit", dict(aggregate="mean", mean_adapt=1.5)),
    ("1-bit mean, R=100 (onebit-mean-r100)", "onebit", dict(aggregate="mean", mean_range=100.0)),
    ("1-bit mean, R=10 (onebit-mean-r10)", "onebit", dict(aggregate="mean", mean_range=10.0)),
    # the fourth round: h's geometric mean held at 1, not its arithmetic mean
    ("1-bit mean, geometric norm (onebit-mean-geo)", "onebit", dict(aggregate="mean", mean_norm="geometric")),
    # Lion's β1 for the mean: the decoded innovation ĝ − m carries the compression's error on top of the
    # gradient noise, and 1 − β1 is its weight in the step's sign
    ("1-bit mean, beta1=0.95 (onebit-mean-b0.95)", "onebit", dict(aggregate="mean", beta1=0.95)),
    # the momentum and both residuals restart from zero at step 50, the magnitudes h kept (LionCub's default
    # mean_restart), and the same restart of Lion's momentum: does the restart help any Lion, or the mean?
    ("1-bit mean, restart at 50 (onebit-mean-rs50)", "onebit", dict(aggregate="mean", mean_restart=50)),
    ("1-bit mean, restart at 25 (onebit-mean-rs25)", "onebit", dict(aggregate="mean", mean_restart=25)),
    ("1-bit mean, restart at 100 (onebit-mean-rs100)", "onebit", dict(aggregate="mean", mean_restart=100)),
    ("Lion, momentum restart at 50 (lion-rs50)", "grad", dict(momentum_restart=50)),
    ("1-bit, momentum restart at 50 (onebit-rs50)", "onebit", dict(momentum_restart=50)),
    # ... and at 48 sequences (12 per worker) for the recipe's 2000 steps: part B's B=48@2000 point, whose
    # best lr for Lion and the 1-bit vote was the recipe's 1e-4 (Lion and the vote: part B's records)
    ("B=48@2000 1-bit mean, restart at 50 (onebit-mean-rs50-b48)", "onebit",
     dict(aggregate="mean", mean_restart=50, batch=12)),
    ("B=48@2000 Lion, momentum restart at 50 (lion-rs50-b48)", "grad", dict(momentum_restart=50, batch=12)),
)


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
        for label, vote, extra in VOTE_QUALITY:
            out.append(Spec("ablate", label, vote=vote, **dict(g, **extra)))
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
