"""The training harness's typed configuration (filled by ``lioncub train``).

One keyword-only dataclass, one docstring per field, validated in
``__post_init__`` so a bad value fails before any worker starts.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ..testbed.straggler import check_workers
from ..votes.mean import MEAN_DEFAULTS
from ..optim.flags import node_kwargs, round_kwargs, step_kwargs
from ..optim.lioncub import NONFINITE_ALIASES, NONFINITE_POLICIES, OPTIMIZER_VOTES

GPT_MODELS = ("gpt-tiny", "gpt-mini", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b")
IMAGE_MODELS = ("resnet18", "resnet50", "vit-tiny")
MODELS = GPT_MODELS + IMAGE_MODELS
OPTIMIZERS = ("lion", "lioncub", "adamw")
VOTES = tuple(OPTIMIZER_VOTES)  # whatever LionCub accepts: grad, sign_allreduce, gather, onebit, pbit, ...
QUANTIZERS = (None, "sign", "l1", "lp", "l0", "linf", "log")
DEVICES = ("auto", "cpu", "cuda")
MOMENTUM_SYNCS = ("none", "all", "io", "adaptive")
NONFINITE = tuple(NONFINITE_POLICIES) + tuple(NONFINITE_ALIASES)  # the older spellings still accepted


def default_cache_dir() -> str:
    """Where ``prepare`` writes token files: $LIONCUB_CACHE or ~/.cache/lioncub."""
    return os.environ.get("LIONCUB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lioncub")


RECOMMENDED = dict(vote="onebit", aggregate="mean")
"""LionCub's every-step setting in ``lioncub train``'s default comparison, README's recommendation: one bit
per element in each of onebit's two collectives, carrying a compressed mean of the gradients (docs/votes.md)."""


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs; ``lioncub train`` fills it from flags."""

    model: str = "gpt-mini"
    """Model name, one of ``MODELS``."""
    data: str | None = None
    """Data set: ``shakespeare`` (text), ``digits`` (images), a directory of nanoGPT-style ``train.bin``/``val.bin``,
    a ``.txt`` file (tokenised to bytes), an ``.npz`` image array file (x, y[, x_val, y_val]) or an image folder
    (class sub-folders). None: ``shakespeare`` for GPT models, ``digits`` otherwise."""
    cache_dir: str = field(default_factory=default_cache_dir)
    """Where ``prepare`` writes train.bin/val.bin for text corpora."""
    steps: int = 250
    """Optimizer steps to train (a resumed run continues up to this step; with ``time_budget``: at most)."""
    time_budget: float | None = None
    """Train for this many seconds of training time instead of to ``steps`` (then a cap): every rank stops at the
    same step (local steps: a round's end) of the agreed clock, the slowest rank's; a constant lr after warm-up."""
    eval_every_s: float = 0.0
    """With ``time_budget``: also evaluate every this many seconds of the agreed clock (0: never)."""
    batch_size: int = 8
    """Sequences (or images) per worker per step."""
    block_size: int = 64
    """GPT context length in tokens."""
    vocab_size: int | None = None
    """GPT vocabulary; None reads the data's meta.json (256 for byte-level text)."""
    tied_embeddings: bool = True
    """Share the GPT input embedding with the output head."""
    width: int = 64
    """ResNet base channel width (64 is the published size; smaller runs faster on a CPU)."""
    dropout: float = 0.0
    """Dropout probability in the models."""
    lr: float = 3e-4
    """Peak learning rate for parameters outside embeddings and head."""
    lr_embed: float | None = None
    """Peak learning rate for input embeddings (None: ``lr``)."""
    lr_head: float | None = None
    """Peak learning rate for the output head (None: ``lr``; tied heads use ``lr_embed``)."""
    weight_decay: float = 0.1
    """Decoupled weight decay for matrices (biases and norms get none)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Lion's (beta1, beta2), or AdamW's."""
    warmup_steps: int = 10
    """Linear warm-up steps before the cosine decay to ``min_lr_ratio * lr``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    optimizer: str = "lioncub"
    """``lion`` or ``adamw`` (one process's optimizer after the harness's fp32 gradient allreduce), ``lioncub``."""
    vote: str = "pbit"
    """LionCub vote: ``grad`` is the gradient-allreduce baseline; see ``VOTES``."""
    bits: int | None = None
    """LionCub p-bit lane width (2/4/8); None picks the smallest valid."""
    quantizer: str | None = None
    """LionCub p-bit quantizer; None sends binary signs (the paper's 4-bit)."""
    grad_dtype: str = "fp32"
    """Gradient allreduce dtype for vote='grad': ``fp32`` or ``bf16``."""
    momentum_sync: str = "none"
    """LionCub: which momenta to average across ranks every ``sync_every`` steps:
    ``none``, ``all``, ``io`` (input embedding + output head) or ``adaptive``."""
    sync_every: int = 10
    """LionCub: period in steps of the momentum synchronisation."""
    tie: str = "alternate"
    """LionCub every step: where the 1-bit wire cannot carry 0 (exact zeros of c, onebit's tied votes), ``alternate``
    (+1 on even steps, -1 on odd ones: the paper's rule), ``plus``, ``minus`` or ``hold`` (LionCub's ``tie``)."""
    vote_error_feedback: str = "none"
    """LionCub every step: the vote's error feedback, ``none``, ``worker``, ``server`` or ``both`` (LionCub's
    ``error_feedback``; ``error_feedback`` above is LocalCub's residual of a round)."""
    stochastic_signs: bool | float = False
    """LionCub every step: signs drawn by magnitude (a float k: M = k·mean|v|; LionCub's ``stochastic_signs``)."""
    mean_adapt: float = MEAN_DEFAULTS["mean_adapt"]
    """``aggregate='mean'`` every step: the magnitudes' adaptation factor gamma (LionCub's ``mean_adapt``)."""
    mean_range: float = MEAN_DEFAULTS["mean_range"]
    """``aggregate='mean'`` every step: the magnitudes' range R (LionCub's ``mean_range``)."""
    mean_norm: str = MEAN_DEFAULTS["mean_norm"]
    """``aggregate='mean'`` every step: which mean of the magnitudes is held at 1 (LionCub's ``mean_norm``)."""
    mean_restart: int = MEAN_DEFAULTS["mean_restart"]
    """``aggregate='mean'`` every step: the step at which the shared momentum and the residuals restart from
    zero (0: never; LionCub's ``mean_restart``)."""
    nonfinite: str = "raise"
    """LionCub: on a NaN/Inf gradient on any rank, ``raise`` (naming the parameter) or
    ``skip_step`` (every rank skips the step; counted in ``skipped_steps``)."""
    check_every: int = 0
    """LionCub: verify every this many steps that replicas are identical (0: never)."""
    overlap: bool = False
    """LionCub: launch each bucket's vote from backward hooks (overlaps compute)."""
    local_steps: int | str = 1
    """LionCub: inner steps per agreed outer step; > 1 trains with ``lioncub.LocalCub`` (the vote
    then runs on the pseudo-gradients once per round; ``eval_every`` and ``steps`` must be multiples);
    ``'auto'``: LocalCub picks H from the measured link and compute (``LocalCub(local_steps='auto')``; the
    run stops at the first round's end at or after ``steps``, evaluations by the clock, not ``eval_every``)."""
    min_local_steps: int = 10
    """``local_steps='auto'``: the smallest H it picks (the H the outer rule's rate was tuned at)."""
    local_setting: str = "given"
    """``given`` (these fields) or ``link``: LocalCub's own ``aggregation='auto'`` (with ``local_steps='auto'``, AdamW
    inside at the lr its rounds were raced at): the setting picked from the measured link (:mod:`lioncub.optim.regime`)."""
    inner: str = "lion"
    """Local steps: the inner optimizer, ``lion`` or ``adamw``."""
    outer: str = "nesterov"
    """Local steps: the outer rule, ``sgd``, ``nesterov`` or ``lion``."""
    outer_lr: float = 1.0
    """Local steps: the outer learning rate (dimensionless; see docs/local_steps.md)."""
    error_feedback: bool = False
    """Local steps: keep each worker's compression residual."""
    aggregate: str = "vote"
    """Local steps: ``vote`` (a sign step) or ``mean`` (summed L1 lanes: needs vote='pbit', quantizer='l1')."""
    delay: int = 0
    """Local steps: 1 streams rounds (``LocalCub(delay=1)``: a round's exchange overlaps the next round's steps)."""
    fragments: int = 1
    """Local steps with ``delay=1``: stream the model in this many fragments (``LocalCub(fragments=...)``)."""
    eager: bool = False
    """Local steps with ``delay=1`` and a mean: the outer step by the worker's own Δ stands in (``LocalCub(eager=)``)."""
    pace: str = "slowest"
    """LocalCub: ``'slowest'`` (every rank H steps a round) or ``'timed'`` (``Options(pace='timed')``: each rank as
    many steps as fit the round's time, its Δ weighted by them; docs/stragglers.md; ``local_steps='auto'`` then picks
    H at the rounds' pace). A timed run stops and evaluates on the agreed clock: the race's budget or
    ``time_budget`` (``lioncub train --pace timed --budget S``), not ``steps``."""
    nodes: int = 1
    """LionCub: split the workers into this many nodes of consecutive ranks (equal sizes):
    gradients are averaged inside a node, the vote runs across nodes (``lioncub.NodeCub``).
    1 = every worker votes (flat)."""
    shard: bool = True
    """Nodes: each rank of a node votes on its own share of the parameters, then the node
    all-gathers the update (False: every rank of a node votes on all of them)."""
    timeout: float = 600.0
    """Process-group timeout in seconds: how long a collective waits for a dead or stuck rank before failing (then
    the process exits; torchrun may restart it)."""
    nproc: int = 4
    """Local workers to spawn when not under torchrun."""
    slow_workers: tuple[tuple[int, float], ...] = ()
    """Testbed: ``(rank, factor)`` pairs, one per rank (``--slow-worker RANK:FACTOR``): that worker's compute takes
    ``factor``× as long (>= 1): after each backward it sleeps ``(factor - 1)`` × the step's measured forward +
    backward, freeing its cores as a slower GPU would (:mod:`lioncub.testbed.straggler`, docs/stragglers.md).
    Under ``--ft`` the rank is the replica."""
    pause_workers: tuple[tuple[int, float, float], ...] = ()
    """Testbed: ``(rank, seconds, every)`` triples, one per rank (``--pause-worker RANK:S:T``): that worker pauses
    ``seconds`` every ``every`` seconds of its training time (its pauses not counted), after a backward."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``."""
    seed: int = 0
    """Seed for model init, data order and every RNG."""
    eval_every: int = 50
    """Evaluate validation loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 4
    """Validation batches per worker per evaluation."""
    log_every: int = 1
    """Write a step record to metrics.jsonl every this many steps."""
    ckpt_every: int = 0
    """Checkpoint every this many steps (0: never)."""
    keep_ckpts: int = 2
    """How many checkpoints to keep in ``out/ckpt``."""
    resume: str | None = None
    """Checkpoint directory, or a run directory (its latest checkpoint), to continue from.
    The world size may differ from the saved one (see ``checkpoint.load_checkpoint``)."""
    auto_resume: bool = False
    """Continue from ``out``'s latest checkpoint when there is one, else start afresh: a job restarted with the same
    arguments (``torchrun --max-restarts=N``) picks up where it stopped."""
    out: str = "runs/lioncub"
    """Run directory: metrics.jsonl, summary.csv, ckpt/."""
    name: str | None = None
    """Run label in summaries and plots (None: derived from optimizer/vote/bits)."""
    progress: bool = True
    """Progress bar (tqdm) on a TTY (always off when CI=true)."""
    tensorboard: str | None = None
    """Also write TensorBoard event files under ``tensorboard/LABEL`` (one run each, so runs
    overlay): loss, lr, bytes per step, the step-time split, validation loss (needs the
    ``tensorboard`` package)."""

    def __post_init__(self) -> None:
        _choice("model", self.model, MODELS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("device", self.device, DEVICES)
        _choice("momentum_sync", self.momentum_sync, MOMENTUM_SYNCS)
        _check_numbers(self)
        self.slow_workers, self.pause_workers = check_workers(self.slow_workers, self.pause_workers)
        if self.optimizer != "lioncub":
            changed = [f"{n}={getattr(self, n)!r}" for n, d in _LIONCUB_ONLY.items() if getattr(self, n) != d]
            if changed:
                raise ValueError(f"{', '.join(changed)} apply to optimizer='lioncub' only, got "
                                 f"optimizer={self.optimizer!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        _check_local_steps(self)
        _check_nodes(self)
        self.betas = tuple(float(b) for b in self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.data is None:
            self.data = "shakespeare" if self.is_gpt else "digits"
        if self.optimizer == "lioncub":  # the library's objects check the optimizer's settings, once
            library_arguments(self)

    @property
    def is_gpt(self) -> bool:
        return self.model in GPT_MODELS

    @property
    def round_bits(self):
        """The code width ``bits`` gives a LocalCub round's own aggregation (the scatter mean: ``--vote onebit
        --aggregate mean``), or None when ``bits`` is the vote's lane width (:func:`lioncub.votes.rounds.round_bits`)."""
        from ..votes.rounds import round_class

        if not self.local or self.vote in ("grad", "auto") or self.vote not in VOTES:
            return None
        if not round_class(self.vote, self.aggregate, self.quantizer).takes_bits:
            return None
        return 1 if self.bits is None else self.bits

    @property
    def local(self) -> bool:
        """Whether the run takes local steps (LocalCub): ``local_steps`` > 1 or ``'auto'``."""
        return self.local_steps == "auto" or self.local_steps > 1

    @property
    def label(self) -> str:
        """Run label: ``name`` or e.g. ``lioncub-pbit`` / ``lion-grad`` / ``adamw``."""
        if self.name:
            return self.name
        if self.optimizer == "lioncub" and self.local_setting == "link":
            return "lioncub-link"  # (LocalCub's aggregation='auto': the setting is picked in the run)
        if self.optimizer == "lioncub":
            stream = (("-streaming" if self.delay else "") + (f"-f{self.fragments}" if self.fragments > 1 else "")
                      + ("-eager" if self.eager else ""))
            if self.vote == "grad":  # with local steps: the mean of the pseudo-gradients (DiLoCo's)
                return f"lion-grad-{self.grad_dtype}" + (f"-h{self.local_steps}" if self.local else "") + stream
            bits = f"-{self.bits}b" if self.bits else ""
            quant = f"-{self.quantizer}" if self.quantizer else ""
            local = f"-h{self.local_steps}-{self.aggregate}" if self.local else ""
            local += f"-{self.aggregate}" if not self.local and self.aggregate != "vote" else ""
            local += stream
            nodes = f"-{self.nodes}nodes{'' if self.shard else '-unsharded'}" if self.nodes > 1 else ""
            return f"lioncub-{self.vote}{bits}{quant}{local}{nodes}"
        return self.optimizer

    def mean_options(self) -> dict:
        """The ``mean_*`` settings, as LionCub takes them."""
        return {name: getattr(self, name) for name in MEAN_DEFAULTS}

    def replace(self, **changes) -> "TrainConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_LOCAL_ONLY = {"inner": "lion", "outer": "nesterov", "outer_lr": 1.0, "error_feedback": False, "aggregate": "vote",
               "delay": 0, "fragments": 1, "eager": False, "local_setting": "given",
               "pace": "slowest"}
_LINK_PICKS = ("vote", "bits", "quantizer", "aggregate", "error_feedback", "outer", "outer_lr", "delay", "fragments",
               "eager", "min_local_steps")
"""What ``local_setting='link'`` picks (LocalCub's ``aggregation='auto'``), so a run may not set it too."""
_STEP_ONLY = {"tie": "alternate", "vote_error_feedback": "none", "stochastic_signs": False, **MEAN_DEFAULTS}
_LIONCUB_ONLY = {**_STEP_ONLY, "bits": None, "quantizer": None, "momentum_sync": "none", "nonfinite": "raise", "check_every": 0,
                 "overlap": False, "local_steps": 1, "nodes": 1, "shard": True, **_LOCAL_ONLY}


def _choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {shown}; got {value!r}")


def _check_numbers(config: TrainConfig) -> None:
    """Refuse counts, rates and durations out of their range."""
    for name in ("steps", "batch_size", "block_size", "width", "nproc", "eval_batches", "log_every", "keep_ckpts", "sync_every"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    for name in ("eval_every", "ckpt_every", "warmup_steps", "check_every"):
        if getattr(config, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(config, name)}")
    for name in ("lr", "lr_embed", "lr_head"):
        value = getattr(config, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if config.time_budget is not None and not config.time_budget > 0:
        raise ValueError(f"time_budget must be > 0 seconds (or None), got {config.time_budget}")
    if not config.eval_every_s >= 0:
        raise ValueError(f"eval_every_s must be >= 0, got {config.eval_every_s}")
    if config.eval_every_s and config.time_budget is None:
        raise ValueError("eval_every_s applies to a time_budget run only")
    if not config.timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {config.timeout}")


def _check_local_steps(config: TrainConfig) -> None:
    """Refuse local-step options on an every-step run and every-step options on local steps."""
    _choice("local_setting", config.local_setting, ("given", "link"))
    if config.local_steps != "auto" and (isinstance(config.local_steps, bool) or not isinstance(config.local_steps, int)
                                         or config.local_steps < 1):
        raise ValueError(f"local_steps must be >= 1 or 'auto', got {config.local_steps!r}")
    if not config.outer_lr > 0:
        raise ValueError(f"outer_lr must be > 0, got {config.outer_lr}")
    if not config.local:
        # aggregate='mean' every step is LionCub's 1-bit mean (vote='onebit'; LionCub checks the rest)
        changed = [f"{n}={getattr(config, n)!r}" for n, d in _LOCAL_ONLY.items()
                   if getattr(config, n) != d and n != "aggregate"]
        if changed:
            raise ValueError(f"{', '.join(changed)} apply to local_steps > 1 only")
        return  # (the aggregation object checks itself: library_arguments)
    changed = [f"{n}={getattr(config, n)!r}" for n, d in _STEP_ONLY.items() if getattr(config, n) != d]
    if changed:
        raise ValueError(f"{', '.join(changed)} apply to local_steps=1 only (LionCub every step)")
    for name, default in (("momentum_sync", "none"), ("overlap", False), ("grad_dtype", "fp32")):
        if getattr(config, name) != default:
            raise ValueError(f"{name}={getattr(config, name)!r} is not supported with local_steps > 1")
    if config.local_setting == "link":
        if config.local_steps != "auto":
            raise ValueError(f"local_setting='link' picks H too: give local_steps='auto', got {config.local_steps!r}")
        fields = TrainConfig.__dataclass_fields__
        changed = [f"{n}={getattr(config, n)!r}" for n in _LINK_PICKS if getattr(config, n) != fields[n].default]
        if changed:
            raise ValueError(f"local_setting='link' picks the round's aggregation and the outer rule (LocalCub's "
                             f"aggregation='auto'): leave {', '.join(changed)} at the default")
    if config.local_steps != "auto" and config.min_local_steps != 10:
        raise ValueError(f"min_local_steps={config.min_local_steps} applies to local_steps='auto' only")
    if config.local_steps == "auto":
        if isinstance(config.min_local_steps, bool) or not isinstance(config.min_local_steps, int) \
                or config.min_local_steps < 1:
            raise ValueError(f"min_local_steps must be an int >= 1, got {config.min_local_steps!r}")
        if config.eval_every:
            raise ValueError(f"eval_every={config.eval_every} needs a fixed local_steps: with 'auto' a round ends where "
                             "the picked H falls (evaluate by the clock: time_budget with eval_every_s)")
        return
    for name in ("eval_every", "steps"):
        if getattr(config, name) % config.local_steps:
            raise ValueError(f"{name}={getattr(config, name)} must be a multiple of local_steps={config.local_steps} "
                             "(evaluations run on the model the workers agree on, at the end of a round)")


def _check_nodes(config: TrainConfig) -> None:
    """Refuse what NodeCub does not run."""
    if isinstance(config.nodes, bool) or not isinstance(config.nodes, int) or config.nodes < 1:
        raise ValueError(f"nodes must be an int >= 1, got {config.nodes!r}")
    if config.nodes == 1:
        if not config.shard:
            raise ValueError("shard=False applies to nodes > 1 only")
        return
    for name, default in (("local_steps", 1), ("overlap", False), ("momentum_sync", "none")):
        if getattr(config, name) != default:
            raise ValueError(f"{name}={getattr(config, name)!r} is not supported with nodes > 1")


def aggregation_fields(name, args, *, local: bool) -> dict:
    """``--aggregation NAME`` as the run's settings: the object (:mod:`lioncub.aggregations`) with ``--bits`` (and,
    for ``'sign-vote'``, ``--vote`` as its transport) builds its own engine settings, which name the fields;
    {} without it. Refuses ``--aggregate`` beside it, and ``--vote`` beside another aggregation."""
    if name is None:
        return {}
    if args.aggregate != "vote":
        raise ValueError("--aggregation names the aggregation; --aggregate is its older spelling: give one")
    from ..aggregations import AGGREGATIONS

    cls = AGGREGATIONS[name]
    fields = cls.__dataclass_fields__  # what the object takes decides which flags it reads
    if args.vote is not None and "transport" not in fields:
        raise ValueError(f"--vote picks the collective of --aggregation sign-vote, got --aggregation {name}")
    kw = {"bits": args.bits} if args.bits is not None and "bits" in fields else {}
    if args.vote is not None:
        kw["transport"] = args.vote
    if "dtype" in fields:
        kw["dtype"] = args.grad_dtype
    obj = cls(**kw)
    flags = obj.for_round() if local else obj.for_step()
    out = {k: flags[k] for k in ("vote", "bits", "quantizer", "aggregate") if k in flags}
    if local:
        out["error_feedback"] = flags.get("error_feedback", False)
    else:
        for key, field_name in (("tie", "tie"), ("error_feedback", "vote_error_feedback"),
                                ("stochastic_signs", "stochastic_signs"), ("grad_dtype", "grad_dtype")):
            if key in flags:
                out[field_name] = flags[key]
        out.update({k: v for k, v in flags.items() if k.startswith("mean_")})
    return out


def library_arguments(config: TrainConfig) -> tuple[str, dict]:
    """The run's optimizer as the library takes it: ``('localcub' | 'nodecub' | 'lioncub', its public keyword
    arguments)`` (the aggregation object, :class:`~lioncub.Outer`, :class:`~lioncub.Streaming`,
    :class:`~lioncub.Options`), without the parameters, the model or the node layout. Building them is the check:
    each object refuses its own bad settings in one line, and the harness repeats none of it."""
    lanes = {k: getattr(config, k) for k in ("bits", "quantizer") if getattr(config, k) is not None}  # (refused
    # by the object where they do not apply)
    checks = dict(nonfinite=config.nonfinite, check_every=config.check_every)
    if config.pace != "slowest":  # (LocalCub's only: TrainConfig refuses it without local steps)
        checks["pace"] = config.pace
    if config.local and config.local_setting == "link":  # the optimizer's own setting from the link
        from ..options import Options

        # (pace='timed' too: its first round times both, 'auto' picks H at the rounds' pace: lioncub.optim.pace)
        return "localcub", dict(local_steps="auto", aggregation="auto", inner=config.inner, options=Options(**checks))
    if config.local:
        from ..optim.localcub import round_settings

        kwargs = round_kwargs(dict(
            local_steps=config.local_steps, inner=config.inner, vote=config.vote, outer=config.outer,
            outer_lr=config.outer_lr, error_feedback=config.error_feedback, aggregate=config.aggregate,
            delay=config.delay, fragments=config.fragments, eager=config.eager, **checks,
            **(dict(min_local_steps=config.min_local_steps) if config.local_steps == "auto" else {}), **lanes))
        round_settings(**{k: v for k, v in kwargs.items() if k != "inner"})
        return "localcub", kwargs
    votes = dict(vote=config.vote, grad_dtype=config.grad_dtype, seed=config.seed, aggregate=config.aggregate,
                 tie=config.tie, error_feedback=config.vote_error_feedback, stochastic_signs=config.stochastic_signs,
                 **config.mean_options(), **checks, **lanes)
    if config.nodes > 1:
        return "nodecub", node_kwargs(dict(votes, shard=config.shard))
    kwargs = step_kwargs(dict(votes, momentum_sync=config.momentum_sync, sync_every=config.sync_every,
                              overlap=config.overlap))
    kwargs["aggregation"].for_step()
    return "lioncub", kwargs
