r"""Distributed Lion by majority vote: the :class:`LionCub` optimizer (docs/design.md §2).

On each of P ranks, for every parameter, with local gradient :math:`g_i` and local
momentum :math:`m_i`::

    c_i = β1·m_i + (1-β1)·g_i                     # local, never communicated in full
    u   = sign(Σ_i q(c_i))                         # majority_vote, 1–8 bits per element
    θ  ← θ·(1 - η·λ) - η·u                         # the same u on every rank
    m_i ← β2·m_i + (1-β2)·g_i                      # momenta stay local and drift apart

Replicas stay bit-identical because every rank applies the same ``u`` to the same
``θ``. ``vote='grad'`` is the baseline (averaged fp32/bf16 gradients, then plain
Lion, identical momenta). The arithmetic lives in :mod:`lioncub.lion` and
:mod:`lioncub.votes` (one object per vote method), the per-bucket work in
:mod:`lioncub.engine.step`; this module holds the step's whole order, top-down (``LionCub._step``:
the checks, the driver's votes, the one agreement, the apply) and the set-up (:func:`configure`).

Buckets: parameters are flattened into buckets of at most ``bucket_mb`` MiB of
fp32, in reverse registration order (the order backward produces gradients, as in
DDP), each with its backend (``fused=``) chosen once; the buckets' votes travel together
in messages of at most ``message_mb`` MiB, one exchange each (one collective, two for
``onebit``).

Missing gradients: at every step the ranks agree (one small all-reduce) on which
parameters have a gradient anywhere. A parameter with no gradient on any rank is
skipped, as :class:`~lioncub.Lion` skips it. A parameter with a gradient on some
ranks only is treated as having a zero gradient on the others (its vote there is
``β1·m_i``), so no rank waits for a collective the others never issue.

Example (``torchrun --nproc-per-node 4 train.py``)::

    dist.init_process_group("gloo")
    model = Net()
    opt = lioncub.LionCub(model.parameters(), lr=3e-4)   # the 1-bit mean (aggregation=lioncub.OneBitMean())
    for x, y in loader:                     # each rank its own shard
        loss_fn(model(x), y).backward()
        opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional, Union

import torch
from torch import Tensor

from ..engine import amp, auto, guard, momentum, shards
from ..engine.shards import Sharded
from .. import comm
from ..fused import warn_if_unavailable
from ..engine.step import GRAD_DTYPES, BucketPlan, Bucketed, BucketStep
from ..comm import CommStats
from ..engine.config import OPTIMIZER_VOTES, StepSettings, VoteConfig
from ..votes.mean import ADAPT_DEFAULT, NORM_DEFAULT, RANGE_DEFAULT, RESTART_DEFAULT
from .checkpoint import StepCheckpoint
from ..engine.shell import NONFINITE_ALIASES, NONFINITE_POLICIES, CheckedGroups, Shell
from ..validate import check_bool, check_hyperparameters
from ..aggregations import Aggregation, aggregation_of
from ..options import STEP_OPTIONS, Options

__all__ = ["LionCub", "OPTIMIZER_VOTES", "GRAD_DTYPES"]

__all__ += ["NONFINITE_POLICIES", "NONFINITE_ALIASES"]


class LionCub(StepCheckpoint, Sharded, Bucketed, CheckedGroups, Shell, StepSettings, torch.optim.Optimizer):
    """Lion with its update agreed across data-parallel ranks every step, in 1-8 bits per element.

    Args:
        params: iterable of parameters or param-group dicts (``lr``, ``betas``,
            ``weight_decay`` per group).
        lr, betas, weight_decay: as :class:`lioncub.Lion`.
        aggregation: how the update travels (:mod:`lioncub.aggregations`): ``OneBitMean()`` (the default,
            ``'onebit-mean'``: a 1-bit compressed mean of the gradients and Lion's exact update on it with a shared
            momentum), ``SignVote(...)`` (``'sign-vote'``: the majority vote of the signs, the paper's Lion Cub),
            or ``Mean()`` (``'mean'``: the fp32 gradient all-reduce, the baseline).
        process_group: where the data-parallel ranks are: None (the world; with FSDP2 (DTensor) parameters the
            replicas' group inferred from their mesh, docs/sharded.md), a process group, or
            :func:`lioncub.node_groups`'s layout (ranks per node: the gradients averaged inside each node, the
            aggregation across nodes, each local rank a shard of the model: a :class:`~lioncub.optim.nodecub.NodeCub`).
        manager: a ``torchft.Manager``: fault tolerance across replica groups (a :class:`~lioncub.ft.FTLionCub`;
            docs/fault_tolerance.md).
        overlap: launch each bucket's agreement from backward hooks once its gradients are ready
            (:mod:`lioncub.engine.overlap`; the same bits as without); accumulate under
            ``with opt.no_sync():``; ``opt.remove_hooks()`` turns it off. Under DDP:
            :func:`lioncub.ddp.hook.register`.
        model: the module the params come from: names parameters in errors, finds the input/output layers
            for ``Options(momentum_sync='io')``.
        options: a :class:`lioncub.Options` (buckets, backends, checks, seed, the link's α and β, the
            momentum sync): docs/api.md.

    Buckets: parameters are flattened into buckets of at most ``bucket_mb`` MiB of fp32 (reverse registration
    order, as DDP), each with its backend chosen once (``backends`` says which and why); the buckets' votes travel
    together in messages of at most ``message_mb`` MiB (with overlap each bucket is its own).

    Attributes: ``aggregation``, ``steps``, ``skipped_steps``, ``last_step_stats``
    (:class:`~lioncub.CommStats`), ``vote_chosen`` (the collective and lane width in use).
    """

    encode_ahead = 4
    """Messages encoded before the has-grad / finite agreement (at most this many times
    ``message_mb`` of kept buffers; 1-bit votes of a 800M-parameter model are 4 messages)."""

    state_key = "lioncub"

    def __new__(cls, *args, **kwargs):
        """``LionCub(..., process_group=node_groups())`` builds the node layout's optimizer
        (:class:`~lioncub.optim.nodecub.NodeCub`), ``LionCub(..., manager=m)`` the torchft one
        (:class:`~lioncub.ft.FTLionCub`): one class for the user, the layout read from its arguments."""
        if cls is LionCub and (_is_layout(kwargs.get("process_group")) or kwargs.get("manager") is not None):
            return _elsewhere(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        aggregation: Union[str, Aggregation] = "onebit-mean",
        process_group=None,
        manager=None,
        overlap: bool = False,
        model: Optional[torch.nn.Module] = None,
        options: Optional[Options] = None,
    ):
        if manager is not None or _is_layout(process_group):  # (a subclass of LionCub got here)
            raise ValueError(f"{type(self).__name__}: manager= and a NodeLayout process_group are LionCub's own "
                             "(it builds the torchft or node optimizer); a subclass takes a process group")
        agg = aggregation_of(aggregation, "LionCub")
        flags = Options.of(options, "LionCub").for_("LionCub", STEP_OPTIONS)
        self.aggregation = agg
        """How the update travels (:mod:`lioncub.aggregations`)."""
        configure(self, params, lr, betas, weight_decay, **agg.for_step(), **flags, process_group=process_group,
                  overlap=overlap, model=model)

    # ------------------------------------------------------------------ settings
    def _set_config(self, config: VoteConfig) -> None:
        """The vote settings and their method object (None for ``'grad'``), for every path's step."""
        self.config = config
        """The validated vote settings (:class:`~lioncub.engine.config.VoteConfig`; ``'auto'`` resolved)."""
        self.method = config.method(self.world_size)
        self.bucket_step.method = self.method
        self.vote_chosen = (config.vote, config.bits)

    # ------------------------------------------------------------------ step
    def new_stats(self) -> CommStats:
        """A step's :class:`CommStats`, timed as ``timing`` says (see the class doc)."""
        return comm.step_stats(self.device, self.timing)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One step for every rank. Collective: every rank must call it every iteration.

        ``grad_scaler``: passed by ``torch.amp.GradScaler.step(opt)`` (this optimizer declares
        ``_step_supports_amp_scaling``): the gradients are unscaled here, the scaler's found-inf
        is agreed by all ranks in the step's one all-reduce, every rank skips or steps
        together, and the agreed flag is written back so ``scaler.update()`` changes every
        rank's scale alike (see :mod:`lioncub.engine.amp`)."""
        with comm.step_context(self.steps):  # a failed collective names this step
            return self._step(closure, grad_scaler)

    _step_supports_amp_scaling = True
    """``GradScaler.step`` always calls :meth:`step` (on every rank) and hands it the scaler."""

    @torch.no_grad()
    def step_agreed(self, verdict: guard.Verdict):
        """One step whose agreement (:func:`~lioncub.engine.guard.agree`: which parameters have a gradient
        anywhere, how many ranks hold a non-finite one) the caller already made over a group that contains
        this optimizer's: NodeCub's one agreement over the world, which its cross-node vote would otherwise
        repeat (an all-reduce and a host read more per step). Collective as :meth:`step`."""
        with comm.step_context(self.steps):
            return self._step(None, None, verdict)

    def _step(self, closure, grad_scaler, verdict: Optional[guard.Verdict] = None):
        """The whole step, top-down (docs/design.md §9): the frozen parameters' check, the closure, FSDP2's local
        gradients onto the shards, the loss scaler's unscale, then the driver's votes settled (overlap, the DDP
        hook: launched during backward) or the first messages encoded ahead (a fused encode checks the gradients
        in the same read), the one agreement (:meth:`_agree`; ``verdict``: the caller's, :meth:`step_agreed`),
        and on its verdict: raise or skip on every rank, or apply, count the step and sync the momenta."""
        self.plan.check_frozen()  # a parameter unfrozen since construction is in no bucket: say so (no device work)
        loss = Shell.run_closure(closure)
        with shards.grads_on_shards(self.sharding):  # FSDP2: each local shard holds its local gradient meanwhile
            stats, driver = self.new_stats(), self._driver
            params, buckets, run = [p for _, p in self.plan.param_entries], self.plan.buckets, self.bucket_step
            if driver is not None and amp.scaling(self, grad_scaler):
                raise ValueError("fp16 loss scaling (GradScaler) with overlap=True or the DDP hook: the votes were "
                                 "encoded during backward from scaled gradients; use bf16 autocast (no scaler), "
                                 "or overlap=False without the DDP hook")
            scaler_inf = amp.unscale(self, grad_scaler, params)  # this rank's found-inf (None without a scaler)
            early = finite = None  # the messages encoded ahead; this rank's "all finite?" when an encode read them
            if driver is not None:
                driver.finish_votes(stats)  # launches what backward did not; nothing in flight past here
                finite = driver.finite() if callable(getattr(driver, "finite", None)) else None
            elif self.method is not None and run.encodes_ahead(buckets):
                early, finite = run.encode_messages(buckets, stats, self.steps, ahead=self.encode_ahead)
                if verdict is None:  # the gradients of the messages beyond the ones ahead
                    rest = [p for msg, buf in early if buf is None for b in msg for p in buckets[b].params]
                    finite = guard.all_finite(finite, guard.grads_finite(rest))
            if verdict is None:  # (NodeCub agrees over the whole world for its voter)
                verdict = self._agree(params, stats, finite, scaler_inf)
            amp.record_agreed(self, grad_scaler, verdict.bad_ranks)
            if verdict.bad_ranks:  # non-finite on some rank: every rank raises, or every rank skips
                if driver is not None:
                    driver.discard()
                if scaler_inf is None:  # (an overflow under a scaler is the scaler's skip, never an error)
                    guard.handle_nonfinite(self.nonfinite, params, verdict.bad_ranks, step=self.steps,
                                          names=self._param_names)
                self.skipped_steps += 1
            else:
                if driver is not None:
                    driver.apply(verdict.active, stats)
                else:  # per message: the exchange (encoded now if not ahead), then each bucket applied
                    run.step_active(buckets, verdict.active, early, stats, self.steps, self.config.grad_dtype)
                self.steps += 1
                self.momentum_sync.after_step(self.steps, self.local_state, stats)
            self.last_step_stats = stats
        return loss

    def _agree(self, params: list[Tensor], stats: CommStats, finite, scaler_inf) -> guard.Verdict:
        """The step's one agreement (:func:`~lioncub.engine.guard.agree`) over ``agree_group``, carrying
        (every ``check_every`` steps) the replica check of the previous step's result and, under a driver,
        whether a rank saw a gradient arrive after its bucket's vote was launched: that rank alone knows, so
        it says so here and every rank raises together, before anything else waits on a collective."""
        check, driver = None, self._driver
        if self.check_due(self.steps) and self._checked != self.steps:
            check = guard.replicas_differ(params, self.group, self.world_size, step=self.steps, stats=stats)
            self._checked = self.steps
        late = getattr(driver, "late", None)
        extra = [] if check is None else [check[0].reshape(-1)]
        if driver is not None:  # (a fill, not a copy from the host: no sync)
            extra.append(torch.zeros(1, dtype=torch.uint8, device=self.device).fill_(0 if late is None else 1))
        verdict = guard.agree(params, self.agree_group, self.agree_size, self.device, stats, finite=finite,
                              extra=torch.cat(extra) if extra else None, scaler_inf=scaler_inf)
        if driver is not None and verdict.extra[-1]:
            driver.discard()
            raise RuntimeError(late or f"overlap: on {int(verdict.extra[-1])} other rank(s) a parameter got its "
                               "gradient after its bucket's vote was launched (see that rank's error)")
        if check is not None and verdict.extra[0]:
            guard.report_replicas(check[1], params, step=self.steps, names=self._param_names)
        return verdict

    # ------------------------------------------------------------------ the driver (overlap, the DDP hook)
    @property
    def driver(self):
        """What launches the votes during backward (overlap, the DDP hook), or None."""
        return self._driver

    def attach_driver(self, driver) -> None:
        """Let ``driver`` (overlap, the DDP hook) launch the votes; ``step()`` then waits for
        them and applies. One driver at a time; the vote method refuses what it cannot run so."""
        if self._driver is not None:
            raise ValueError(f"this LionCub is already driven by {type(self._driver).__name__}; "
                             "remove it first (remove_hooks())")
        why = None if self.method is None else self.method.backward_refusal(type(driver).__name__)
        if why is not None:
            raise ValueError(why)
        self._driver = driver

    def detach_driver(self, driver) -> None:
        """Undo :meth:`attach_driver`; the per-launch buffers go, step() makes its own again."""
        if self._driver is driver:
            self._driver = None
            self.bucket_step.clear_buffers()

    def no_sync(self):
        """Context manager for gradient accumulation: backward passes inside launch no vote
        (overlap / DDP hook). A no-op without them: votes happen in step() anyway."""
        return self._driver.no_sync() if self._driver is not None else contextlib.nullcontext()

    def remove_hooks(self) -> None:
        """Stop overlapping: remove the backward hooks; step() votes after backward again."""
        if self._driver is not None:
            self._driver.remove_hooks()

    def check_replicas(self) -> None:
        """Verify now (a collective: every rank calls it) that every rank holds the same
        parameters; ``check_every`` does this at the start of the step after every k-th."""
        guard.check_replicas([p for _, p in self.param_entries], self.group, self.world_size, step=self.steps,
                             names=self._param_names, stats=self.new_stats())

    # ------------------------------------------------------------------ state
    def fingerprint(self) -> dict:
        return self.config.fingerprint()


def engine_lioncub(params, lr, betas, weight_decay, **flags) -> LionCub:
    """A LionCub from the engine's flat settings (NodeCub's cross-node voter, which takes ``_verified``)."""
    self = torch.optim.Optimizer.__new__(LionCub)
    self.aggregation = None
    configure(self, params, lr, betas, weight_decay, **flags)
    return self


def configure(  # the engine's flat settings (lioncub.optim.flags says which public argument sets each)
    self: LionCub, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
    *, vote: str = "pbit",
    bits: Optional[int] = None,
    quantizer: Optional[str] = None,
    tie: str = "alternate",
    error_feedback: str = "none",
    stochastic_signs: Union[bool, float] = False,
    aggregate: str = "vote",
    mean_adapt: float = ADAPT_DEFAULT,
    mean_range: float = RANGE_DEFAULT,
    mean_norm: str = NORM_DEFAULT,
    mean_restart: int = RESTART_DEFAULT,
    grad_dtype: str = "fp32",
    fused: Optional[bool] = None,
    process_group=None,
    bucket_mb: float = 25.0,
    message_mb: float = 25.0,
    overlap: bool = False,
    maximize: bool = False,
    seed: int = 0,
    momentum_sync="none",
    sync_every: int = 10,
    sync_dtype: str = "fp32",
    model: Optional[torch.nn.Module] = None,
    nonfinite: str = "raise",
    check_every: int = 0,
    alpha: Optional[float] = None,
    beta: Optional[float] = None,
    gamma: Optional[dict] = None,
    timing: Optional[bool] = None,
    _verified: bool = False,
) -> None:
    """LionCub's set-up from the engine's flat settings (``__init__`` turns the public arguments into them,
    :func:`engine_lioncub` takes them as they are): the checks, torch's groups, FSDP2's layout, the bucket
    plan, the shell (world, device, the same-model check and broadcast), the vote method, the driver."""
    check_hyperparameters(lr, betas, weight_decay)
    check_bool("overlap", overlap)  # (timing, maximize and the rest: checked by Options, where they were given)
    config = VoteConfig(vote=vote, bits=bits, quantizer=quantizer, tie=tie, seed=seed, grad_dtype=grad_dtype,
                        fused=fused, bucket_mb=bucket_mb, message_mb=message_mb, error_feedback=error_feedback,
                        stochastic_signs=stochastic_signs, aggregate=aggregate, mean_adapt=mean_adapt,
                        mean_range=mean_range, mean_norm=mean_norm, mean_restart=mean_restart)
    auto.check_auto_args(vote, alpha, beta, gamma)
    defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
    super(LionCub, self).__init__(params, defaults)
    sharding, process_group = self.find_sharding(process_group, momentum_sync=momentum_sync)
    self.plan = BucketPlan(self.param_groups, config.bucket_mb, config.fused, self._local)
    params = [p for _, p in self.plan.param_entries]  # FSDP2's: the local shards
    self.open_shell(params, group=process_group, model=model, nonfinite=nonfinite, check_every=check_every,
                    seed=seed, verify=not _verified, chunks=[b.params for b in self.plan.buckets],
                    sharding=sharding, frozen=self.plan.frozen)  # (NodeCub's vote is ``_verified``)
    if config.votes:
        config.method(self.world_size)  # refuses what cannot be exact for P ranks, before any vote
    self.timing = self.device.type == "cpu" if timing is None else timing
    if fused is None:
        warn_if_unavailable([p for _, p in self.param_entries], "LionCub", stacklevel=2)
    self.steps = 0  # completed steps: sets the tie/zero parity of the 1-bit votes
    self.skipped_steps = 0  # steps skipped by nonfinite='skip' (all ranks agree)
    self._checked, self.last_step_stats = 0, CommStats()  # the steps check_every last verified; stats
    self._driver = None  # attached by lioncub.engine.overlap (overlap=True) or lioncub.ddp.hook
    self.bucket_step = BucketStep(self.local_state, self.world_size, self.group, self.generator,
                                  config.message_mb)
    self.vote_requested = vote
    if vote == "auto":  # the cheapest valid vote over this optimizer's buckets, rank 0's pick for all
        picked, picked_bits, self.auto_alpha_beta = auto.agree_on_vote(
            [b.numel for b in self.buckets], self.world_size, self.group, alpha, beta, gamma=gamma,
            device=self.device)
        config = config.resolved(picked, picked_bits)
    self._set_config(config)
    self.momentum_sync = momentum.MomentumSync(
        momentum_sync, every=sync_every, dtype=sync_dtype, model=model, params=params, group=self.group,
        world_size=self.world_size, chunk_mb=config.bucket_mb)
    self.make_sharded_state()
    if overlap:
        from ..engine.overlap import Overlap  # hooks every param; launches votes during backward

        Overlap(self)


BUILDS: dict = {}
"""What ``LionCub(...)`` builds instead of itself, registered by the modules that define them (which import this
one): ``'nodes'``: (NodeLayout, NodeCub) (:mod:`lioncub.optim.nodecub`), ``'manager'``: FTLionCub
(:mod:`lioncub.optim.replicas`). ``lioncub`` imports both."""


def _is_layout(group) -> bool:
    return "nodes" in BUILDS and isinstance(group, BUILDS["nodes"][0])


def _elsewhere(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, aggregation="onebit-mean",
               process_group=None, manager=None, overlap=False, model=None, options=None):
    """The optimizer ``LionCub(...)`` builds for a node layout or a torchft manager."""
    if manager is not None:
        if _is_layout(process_group):
            raise ValueError("LionCub: a torchft manager with a node layout (replicas of many ranks) is not built "
                             "yet; give one of them, or run LocalCub's rounds with FSDP2 shards inside each replica "
                             "group (docs/fault_tolerance.md)")
        if overlap:
            raise ValueError("LionCub: overlap=True with a torchft manager: the step waits for its quorum first; "
                             "use overlap=False")
        return BUILDS["manager"](params, lr, betas, weight_decay, manager=manager, aggregation=aggregation, model=model,
                         options=options)
    if overlap:
        raise ValueError("LionCub: overlap=True with a node layout: the node mean runs after backward; use "
                         "overlap=False")
    return BUILDS["nodes"][1](params, lr, betas, weight_decay, aggregation=aggregation, layout=process_group, model=model,
                   options=options)
