r"""Local steps under the vote: H steps of a local optimizer, then one agreed outer step.

Every worker starts a *round* from the same parameters :math:`\theta_s` and takes ``H``
steps of its own inner optimizer (Lion by default, AdamW allowed) on its own data, with
no communication. Then the workers agree on one outer update::

    Δ_i = θ_s − θ_i                       # this worker's pseudo-gradient
    v_i = Δ_i + e_i                       # + its error-feedback residual (optional)
    u   = sign(Σ_i q(v_i))                # one majority vote (any vote method, 1-8 bits)
    e_i ← v_i − C(v_i)                    # what was meant minus what was sent
    d   = η·u                             # η: the group's lr now (schedules drive both loops)
    θ_s ← θ_s·(1 − α·η·λ)                 # decoupled weight decay, at the outer step
    θ_s ← outer(θ_s, d; α)                # 'sgd', 'nesterov' or 'lion', outer lr α
    θ_i ← θ_s                             # every replica, bit-identical

With ``vote='grad'`` the workers all-reduce Δ (fp32, mean) instead of voting, and
``d`` is that mean (DiLoCo's outer pseudo-gradient). ``C(v)`` is this worker's own
contribution in the units of ``v``: ``mean|v|·sign(v)`` per tensor for the binary votes
(the scaled sign of error-feedback signSGD), the dequantized ``q(v)`` for ``pbit`` with a
quantizer. The inner optimizer's state (Lion's momentum, AdamW's moments) stays local
and persists across rounds.

The outer rules, with ``α`` = ``outer_lr`` (dimensionless: with ``H = 1``, ``outer='sgd'``,
``α = 1``, weight decay as Lion's and a binary vote, a round is exactly one
:class:`~lioncub.LionCub` step)::

    sgd       θ_s ← θ_s − α·d
    nesterov  b ← μ·b + d;  θ_s ← θ_s − α·(d + μ·b)                     μ = outer_momentum
    lion      c = β1·M + (1−β1)·d;  θ_s ← θ_s − α·η·sign(c);  M ← β2·M + (1−β2)·d

Streaming rounds (``delay=1``): the round's agreement is launched asynchronously when the
round ends and completes while the next round's H inner steps run; its outer step is applied
one round late, and the in-flight round's local progress is carried onto the new start::

    round k ends:  Δ_i^k = o_i − θ_i            # o_i: this worker's parameters when round k began
                   wait for round k−1's d; θ_s ← outer(θ_s, d)          (none after round 0)
                   θ_i ← θ_s − Δ_i^k;  o_i ← θ_i                        (the rebase)
                   launch the agreement of v_i = Δ_i^k + e_i; e_i ← v_i − C(v_i)

θ_s is identical on every rank at every agreement; θ_i is θ_s plus this worker's own progress
of the round in flight (the agreed step replaces the worker's own one, never adds to it).
:meth:`LocalCub.flush` applies the round in flight at once (every replica then holds θ_s).

Streaming in fragments (``delay=1, fragments=F``, Streaming DiLoCo's schedule): the model is cut into F
fragments of about equal size (:func:`lioncub.chunks.plan_fragments`); fragment j's round ends every H steps,
staggered, at steps ``(j+1)·H/F`` of each round, and its agreement has the next H/F inner steps to arrive::

    fragment j's round ends:  receive the fragment in flight (launched H/F steps ago), for its elements:
                                  θ_s ← outer(θ_s, d);  θ_i ← θ_s + (θ_i − o_i)   (its progress since the launch)
                              Δ_i = θ_s − θ_i over fragment j (H steps of progress);  o_i ← θ_i
                              launch the agreement of v_i = Δ_i + e_i; e_i ← v_i − C(v_i)

One fragment is in flight at a time, on the link for H/F steps instead of H, so each outer step lands H/F
steps late rather than a round; the bytes per round are those of ``fragments=1``. The agreements run on a
process group of their own (:func:`lioncub.comm.own_group`), so the caller's collectives never queue behind
one in flight; an exchange of two collectives (the scatter mean) launches its second between inner steps, as
soon as its first is complete (:meth:`~lioncub.votes.rounds.Agreement.advance`).

Eager stand-ins (``eager=True``, with ``delay=1`` and a mean): where the rounds above set θ_i to θ_s − Δ_i (the
rebase) or leave it at θ_i (a fragment's launch), each worker instead takes the outer rule's step from θ_s by its
own Δ_i, on a copy (θ_s and the rule's momentum stay as they were)::

    θ_i ← outer(θ_s, Δ_i);  o_i ← θ_i                  (then, as above, launch the agreement of v_i)

so that while the agreed d is in flight the replica already holds the rule's step, its momentum included, with
its own Δ_i standing in for the mean (the eager updates of overlapped DiLoCo). The agreed step replaces the
stand-in when it lands (θ_i ← θ_s + θ_i − o_i), exactly as it replaces the worker's own progress without it.

Example (every rank, inside an initialised process group)::

    opt = LocalCub(model.parameters(), lr=4e-3)   # 5 AdamW steps, then Δ's 2-bit scatter mean, outer SGD
    for x, y in batches:
        loss_fn(model(x), y).backward()
        opt.step()              # communicates only when a round ends
        opt.zero_grad()
        if opt.synced:          # every replica now holds the same parameters
            evaluate(model)
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
from torch import Tensor

from .. import comm, fused, votes
from ..comm import CommStats
from ..engine import amp, auto, guard
from ..engine.config import VoteConfig, VoteSettings
from ..engine import shards
from ..engine.shards import Sharded
from ..engine.shell import Shell
from ..lion import Lion
from ..validate import check_hyperparameters, check_int
from ..votes.pbit import MEAN_CLIP
from ..votes.rounds import ROUND_AGGREGATES as AGGREGATES
from ..votes.rounds import round_aggregation, round_bits
from .outer import OUTER_RULES, make_outer
from .checkpoint import RoundCheckpoint
from .auto_steps import FIRST_ROUND, AutoSteps
from .rounds import OUTER_STATES, Rounds
from .streaming import StreamingRounds
from .pace import Pace, check_timed
from ..aggregations import Aggregation, ScatterMean, SignVote, aggregation_of
from .regime import LOWBIT_BITS, LOWBIT_H, AutoSetting
from .lioncub import _is_layout
from ..options import ROUND_OPTIONS, Options, Outer, Streaming

__all__ = ["LocalCub", "INNER_OPTIMIZERS", "OUTER_RULES", "OUTER_STATES", "LOCAL_VOTES", "AGGREGATES", "MEAN_CLIP"]

INNER_OPTIMIZERS = ("lion", "adamw")
LOCAL_VOTES = ("grad",) + votes.VOTE_METHODS
BUILDS: dict = {}
"""``'manager'``: the class ``LocalCub(..., manager=m)`` builds (FTLocalCub, registered by
:mod:`lioncub.optim.replicas`, which ``lioncub`` imports)."""
DELAYS = (0, 1)
"""``delay=``: 0, every round agreed before the next begins; 1, streaming rounds."""


def _make_inner(inner, groups: list[dict], betas) -> torch.optim.Optimizer:
    """The inner optimizer over our param groups; weight decay is the outer step's job."""
    groups = [dict(g, weight_decay=0.0) for g in groups]
    if inner == "lion":
        return Lion(groups, betas=betas)
    if inner == "adamw":  # fused on CUDA: it skips a non-finite step on the device (fused.adam_step_unless)
        cuda = all(p.device.type == "cuda" for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, betas=betas, fused=True if cuda else None)
    if callable(inner):
        opt = inner(groups)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"inner must return a torch.optim.Optimizer, got {type(opt).__name__}")
        return opt
    raise ValueError(f"inner must be one of {INNER_OPTIMIZERS} or a callable(param_groups) -> Optimizer, "
                     f"got {inner!r}")


class LocalCub(RoundCheckpoint, StreamingRounds, Rounds, Pace, AutoSetting, AutoSteps, Sharded, Shell, VoteSettings, torch.optim.Optimizer):
    """Lion Cub with local steps: ``local_steps`` inner steps per agreed outer step.

    Args:
        params: parameters or param-group dicts (``lr``, ``betas``, ``weight_decay``).
        lr, betas: the inner optimizer's; ``lr`` also sizes the outer step (η above).
        weight_decay: λ, decoupled, applied to θ_s at each outer step as ``α·η·λ`` (the inner optimizer runs
            without weight decay).
        local_steps: H >= 1 inner steps per round (default 5); or ``'auto'``: the first round's steps are
            timed, then H is the smallest whose agreement costs at most ``Options.round_share`` of the round's
            compute on the link's α-β model (:mod:`lioncub.optim.auto_steps`); the pick is in ``steps_pick``.
        aggregation: how a round's Δ travels (:mod:`lioncub.aggregations`): ``ScatterMean(bits=2)`` (the default:
            with H = 5, first at r ≈ 10 and 250 in bench/README.md), ``ScatterMean(bits=4)`` (the long rounds'),
            ``LaneMean(bits=8)`` (``'lane-mean'``),
            ``SignVote(...)`` (the majority vote, ``d = η·u``) or ``Mean()`` (fp32, DiLoCo's); or ``'auto'``
            with ``local_steps='auto'``: the whole setting from the link (:class:`~lioncub.optim.regime.AutoSetting`).
        inner: ``'adamw'`` (default), ``'lion'``, or ``callable(param_groups) -> Optimizer``.
        outer: ``'sgd'`` (default, α = 1: averaging), ``'nesterov'``, ``'lion'``, or :class:`lioncub.Outer`
            with its α, μ, betas (module docstring).
        streaming: False (default: every round agreed before the next begins); True: the round's agreement
            travels during the next round's inner steps, applied one round late; an int F or
            :class:`lioncub.Streaming`: in F fragments, each H/F steps late (module docstring). For the means
            and the one-all-reduce votes.
        process_group: the data-parallel group (default: the world; with FSDP2 parameters the replicas' group
            from their mesh).
        manager: a ``torchft.Manager``: rounds that survive a lost replica (:class:`~lioncub.ft.FTLocalCub`).
        model: the module, to name parameters in errors.
        options: a :class:`lioncub.Options`: ``nonfinite``, ``check_every``, ``seed``, α and β, the ``'auto'``
            bounds, ``outer_state`` (``'host'`` keeps θ_s and the outer state off the device), ``pace``
            (``'timed'``: rounds of a time, each rank's own steps, its Δ weighted by them: docs/stragglers.md).

    Attributes: ``synced`` (the last ``step()`` ended a round: replicas are identical; streaming: the starts
    θ_s are), ``rounds``, ``local_step``, ``last_round_stats``, ``last_step_stats`` (the round's when the step
    ended one, else empty), ``last_round_pace`` (``pace='timed'``: every rank's steps in the last round).

    Memory per parameter: θ_s, plus e_i with error feedback, plus the outer momentum for ``'nesterov'``/``'lion'``,
    plus the inner optimizer's state; streaming also o_i and the message in flight.
    """

    state_key = "local"

    def __new__(cls, *args, **kwargs):
        """``LocalCub(..., manager=m)`` builds the torchft one (:class:`~lioncub.ft.FTLocalCub`)."""
        if cls is LocalCub and kwargs.get("manager") is not None:
            cls = BUILDS["manager"]
        return super().__new__(cls)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        local_steps: Union[int, str] = LOWBIT_H,
        aggregation: Union[str, Aggregation] = ScatterMean(bits=LOWBIT_BITS),
        inner: Union[str, Callable] = "adamw",
        outer: Union[str, Outer] = "sgd",
        streaming: Union[bool, int, Streaming] = False,
        process_group=None,
        manager=None,
        model: Optional[torch.nn.Module] = None,
        options: Optional[Options] = None,
    ):
        agg, flags = round_settings(aggregation, local_steps, outer, streaming, process_group, manager, options)
        self.aggregation = agg  # how a round's Δ travels (lioncub.aggregations); self.exchange runs it
        self._configure(params, lr, betas, weight_decay, local_steps=local_steps, inner=inner, model=model, **flags)
        if aggregation == "auto":  # the first round is the low-bit rounds', timed; then the pick (AutoSetting)
            self.steps_pick["setting"] = None

    def _configure(  # the engine's flat settings (lioncub.optim.flags says which public argument sets each)
        self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
        *, local_steps: Union[int, str] = 10, inner: Union[str, Callable] = "lion",
        vote: str = "onebit",
        bits: Optional[int] = None,
        quantizer: Optional[str] = None,
        outer: str = "sgd",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.9,
        outer_betas: tuple[float, float] = (0.9, 0.99),
        error_feedback: bool = False,
        aggregate: str = "vote",
        tie: str = "alternate",
        seed: int = 0,
        process_group=None,
        nonfinite: str = "raise",
        check_every: int = 0,
        delay: int = 0,
        fragments: int = 1,
        eager: bool = False,
        model: Optional[torch.nn.Module] = None,
        alpha: Optional[float] = None,
        beta: Optional[float] = None,
        gamma: Optional[dict] = None,
        round_share: Optional[float] = None,
        min_local_steps: Optional[int] = None,
        max_local_steps: Optional[int] = None,
        outer_state: str = "device",
        pace: Optional[str] = None,
    ):
        check_hyperparameters(lr, betas, weight_decay)
        self.outer_state = outer_state
        self.steps_pick, self.H = self._init_steps(local_steps, round_share, max_local_steps, vote, alpha, beta, gamma,
                                                   min_local_steps)
        self.error_feedback = error_feedback  # (the settings were checked by the aggregation object: for_round)
        self.aggregate = aggregate
        self.round_bits = round_bits(vote, aggregate, quantizer, bits)
        """The code width of the round's own aggregation (the scatter mean's 1-8 bits), or None: ``bits`` is the
        vote's lane width."""
        config = VoteConfig(vote=vote, bits=None if self.round_bits else bits, quantizer=quantizer, tie=tie, seed=seed)
        self.rule = make_outer(outer, lr=outer_lr, momentum=outer_momentum, betas=outer_betas)
        """The outer rule object (:mod:`lioncub.optim.outer`)."""
        self.delay = check_int("delay", delay, min(DELAYS), max(DELAYS), what="rounds an outer step is applied late")
        if delay and vote == "auto":
            raise ValueError("delay=1 needs a fixed vote, got vote='auto' (it may pick a vote of several collectives)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.inner = _make_inner(inner, self.param_groups, tuple(betas))
        self._restore_weight_decay()
        self.param_groups = self.inner.param_groups  # one set of groups: schedulers drive both loops
        sharding, process_group = self.find_sharding(process_group, momentum_sync="none")
        self.params = [self._local(p) for g in self.param_groups for p in g["params"]]  # FSDP2: local shards
        self._open_pace(pace, sharding)  # (Options.pace: lioncub.optim.pace)
        self.open_shell(self.params, group=process_group, model=model, nonfinite=nonfinite,
                        check_every=check_every, seed=seed, sharding=sharding)
        if config.votes:
            config.method(self.world_size)  # refuses what cannot be exact for P ranks
        self.vote_requested = vote
        if vote == "auto":  # one vote per round of H steps: the per-step price is the round's / H
            n = sum(p.numel() for p in self.params)
            picked, picked_bits, ab = auto.agree_on_vote([n], self.world_size, self.group, alpha, beta, gamma=gamma,
                                                         device=self.device)
            self.auto_alpha_beta = ab
            costs = auto.vote_costs([n], self.world_size, *ab, gamma=gamma)
            self.round_costs = {k: dict(v, per_step_s=v["total_s"] / self.H) for k, v in costs.items()}
            config = config.resolved(picked, picked_bits)
        self._set_config(config)
        self._open_streaming(fragments, vote, quantizer, eager)
        self.owner_residuals: dict[int, Tensor] = {}
        """The aggregation's state per chunk of the round, kept from round to round (the scatter mean's owner
        residuals: :meth:`Rounds._owner_state`)."""
        """delay=1: the last round's agreements (one per chunk), launched and not yet applied."""
        for p in self.params:
            self._outer_state(p)
        if self.steps_pick is not None:
            self._measure_link()
        self.rounds, self.local_step, self.synced = 0, 0, False
        self.skipped_rounds, self._bad_round = 0, False
        self.last_round_stats = self.last_step_stats = CommStats()

    # ------------------------------------------------------------------ settings
    def _set_config(self, config: VoteConfig) -> None:
        """The vote settings and the one vote method object every round uses (None: ``'grad'``)."""
        self.config = config
        self.method = config.method(self.world_size)
        self.exchange = round_aggregation(config.vote, self.method, self.world_size, self.aggregate,
                                             bits=self.round_bits)
        """How a round's v_i become d (:mod:`lioncub.votes.rounds`)."""
        self.vote_chosen = (config.vote, config.bits)

    outer = property(lambda self: self.rule.name, doc="The outer rule's name.")
    bits = property(lambda self: self.round_bits or self.config.bits,
                    doc="The scatter mean's code width, or ``pbit``'s lane width (None: the smallest valid).")
    outer_lr = property(lambda self: self.rule.lr, doc="α, the outer rule's step scale.")

    # ------------------------------------------------------------------ set-up
    def _restore_weight_decay(self) -> None:
        """The inner groups got weight_decay=0; keep λ in a key of our own for the outer step."""
        for mine, theirs in zip(self.param_groups, self.inner.param_groups):
            theirs["outer_weight_decay"] = mine["weight_decay"]

    def _outer_state(self, p: Tensor) -> dict:
        state = self.local_state[p]
        if not state:
            placed = self._placed()  # (made there: the host state never passes through the device whole)
            state["start"] = torch.empty_like(p, **placed).copy_(p.detach())
            if self.delay:  # o_i: where this worker's round in flight began (fragments: its last launch)
                state["origin"] = torch.empty_like(p, **placed).copy_(p.detach())
            if self.error_feedback:
                state["residual"] = torch.zeros_like(p, dtype=torch.float32, **placed)
            self.rule.init_state(p, state, **placed)
        return state

    # ------------------------------------------------------------------ step
    _step_supports_amp_scaling = True
    """``GradScaler.step`` always calls :meth:`step` on every rank (see :mod:`lioncub.engine.amp`)."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One inner step; when it completes a round of ``local_steps``, the outer step.

        ``grad_scaler`` (passed by ``GradScaler.step``): the gradients are unscaled here; an
        overflow on this rank skips this rank's inner step only (inner steps are local, so
        the ranks' loss scales need not agree, and agreeing would cost a collective per
        step); the round's collectives run on every rank regardless."""
        loss = self.run_closure(closure)
        self._mark_step()
        with shards.grads_on_shards(self.sharding):  # FSDP2: the local shards hold their gradients for the inner step's checks
            self._inner_step(grad_scaler)
        self.local_step += 1
        self.synced = self._round_due()  # H steps, or Options(pace='timed')'s round time (optim.pace)
        self.last_step_stats = comm.step_stats(self.device)
        self._round_ends()
        if self.synced:
            self.local_step = 0
            self._pace_restart()
            if self.steps_pick is not None and self.steps_pick["H"] is None:
                self._pick_steps()
            self.last_step_stats = self.last_round_stats
        if self._unreported is not None:  # a checkpoint's collectives since the last step (RoundCheckpoint)
            self.last_step_stats.add(self._unreported)
            self._unreported = None
        return loss

    def _inner_step(self, grad_scaler) -> None:
        """This rank's inner step, unless its gradients (or the scaler) say non-finite: a NaN must not reach the
        inner optimizer's state (the round's end then decides on every rank at once). Lion on CUDA and a fused AdamW
        decide on the device (:mod:`lioncub.fused`'s ``*_step_unless``); otherwise one host read (free on CPU)."""
        present = [p for p in self.params if p.grad is not None]
        scaler_inf = amp.unscale(self, grad_scaler, self.params)
        if scaler_inf is not None:  # an overflow skips this rank's inner step only; update() backs off its scale
            skip = scaler_inf.sum() > 0
        else:
            finite = guard.grads_finite(present)
            skip = None if finite is True else torch.logical_not(finite) if isinstance(finite, Tensor) else True
        if isinstance(skip, Tensor) and any(decide(self.inner, skip) for decide in fused.STEP_UNLESS):
            if scaler_inf is None:  # the round is marked on the device, read at its end
                self._bad_round = skip if self._bad_round is False else torch.logical_or(self._bad_round, skip)
        elif skip is None or not bool(skip):
            self.inner.step()
        elif scaler_inf is None:
            self._bad_round = True

    # ------------------------------------------------------------------ state
    def fingerprint(self) -> dict:
        if self.steps_pick is not None and "setting" in self.steps_pick:  # (whatever the link picks)
            return dict(local_steps="auto", aggregation="auto", tie=self.tie, delay=self.delay, **self._pace_key())
        return dict(local_steps="auto" if self.steps_pick else self.H, vote=self.vote, bits=self.bits, quantizer=self.quantizer, tie=self.tie,
                    outer=self.outer, error_feedback=self.error_feedback, aggregate=self.aggregate, delay=self.delay,
                    fragments=self.fragments, **({"eager": True} if self.eager else {}),
                    **self._pace_key())


def round_settings(aggregation=ScatterMean(bits=LOWBIT_BITS), local_steps=LOWBIT_H, outer="sgd", streaming=False,
                   process_group=None, manager=None, options=None) -> tuple:
    """LocalCub's public arguments as (the aggregation object, the engine's flat settings), refusing in one line
    what they cannot run together; nothing here needs the parameters, so the harness checks a run's settings with
    it before any worker starts. ``'auto'``'s first round is the low-bit rounds'
    (:class:`lioncub.optim.regime.AutoSetting`)."""
    if _is_layout(process_group):
        raise ValueError("LocalCub: a node layout is LionCub's (a node mean every step); for local steps with "
                         "many ranks per node shard the model inside the node with FSDP2 (docs/sharded.md)")
    flags = Options.of(options, "LocalCub").for_("LocalCub", ROUND_OPTIONS)
    if aggregation == "auto":
        if local_steps != "auto" or outer != "sgd" or streaming is not False or "min_local_steps" in flags:
            raise ValueError("LocalCub: aggregation='auto' picks the whole setting from the link (H, the round's code, "
                             "the outer rule): give local_steps='auto' and leave outer, streaming and "
                             "Options.min_local_steps at their defaults")
        aggregation = ScatterMean(bits=LOWBIT_BITS)  # the first round: the low-bit rounds', timed (AutoSetting)
        flags["min_local_steps"] = LOWBIT_H
    agg = aggregation_of(aggregation, "LocalCub")
    rule, stream = Outer.of(outer), Streaming.of(streaming)
    if stream is not None and stream.eager and isinstance(agg, SignVote):
        raise ValueError(f"LocalCub: Streaming's eager=True stands in this worker's own Δ for the agreed mean: it "
                         f"needs a mean (Mean, LaneMean or ScatterMean), got {agg!r}")
    if flags.get("pace") == "timed":
        check_timed(agg, local_steps, stream, manager, SignVote, flags.get("min_local_steps", FIRST_ROUND))
    if manager is not None:
        flags["manager"] = manager
    elif "max_attempts" in flags:
        raise ValueError("LocalCub: Options.max_attempts counts a torchft manager's agreements; give manager=")
    flags.update(agg.for_round(), outer=rule.rule, outer_lr=rule.lr, outer_momentum=rule.momentum,
                 outer_betas=rule.betas, **(stream.flags() if stream else {}), process_group=process_group)
    return agg, flags
