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
:mod:`lioncub.engine.step`; this class plans the buckets, checks, agrees and orchestrates.

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
    opt = lioncub.LionCub(model.parameters(), lr=3e-4, vote="pbit")  # 4-bit lanes
    for x, y in loader:                     # each rank its own shard
        loss_fn(model(x), y).backward()
        opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Callable, Iterable, Optional, Union

import torch
from torch import Tensor

from ..engine import amp, auto, guard, momentum, resume
from .. import comm, fused
from ..engine.step import GRAD_DTYPES, Bucket, BucketPlan, BucketStep
from ..comm import CommStats
from ..engine.config import OPTIMIZER_VOTES, VoteConfig, VoteSettings
from ..votes.mean import ADAPT_DEFAULT, NORM_DEFAULT, RANGE_DEFAULT, RESTART_DEFAULT
from ..engine.shell import NONFINITE_ALIASES, NONFINITE_POLICIES, Shell
from ..validate import check_bool, check_hyperparameters, check_optional_bool

__all__ = ["LionCub", "OPTIMIZER_VOTES", "GRAD_DTYPES"]

__all__ += ["NONFINITE_POLICIES", "NONFINITE_ALIASES"]


class LionCub(Shell, VoteSettings, torch.optim.Optimizer):
    """Lion with a compressed majority vote across data-parallel ranks.

    Args:
        params: iterable of parameters or param-group dicts (``lr``, ``betas``,
            ``weight_decay`` per group).
        lr, betas, weight_decay: as :class:`lioncub.Lion`.
        vote: ``'grad'`` (gradient all-reduce baseline), ``'sign_allreduce'``,
            ``'gather'``, ``'onebit'``, ``'pbit'`` (see :mod:`lioncub.votes`) or ``'auto'``:
            the cheapest binary-sign vote for this world size by the α-β model plus
            per-method local cost (:mod:`lioncub.engine.auto`); the pick is ``vote_chosen``.
        alpha, beta, gamma: ``vote='auto'`` only: latency (s) and seconds per bit of
            the link (both None: measured by :func:`lioncub.engine.cost.calibrate`), and
            per-method local costs overriding :data:`lioncub.engine.auto.DEFAULT_GAMMA`.
        bits: ``pbit`` lane width (2, 4 or 8); None picks the smallest valid one.
        quantizer: ``pbit`` only: None (binary signs, the paper's 4-bit Lion Cub),
            or one of ``'sign', 'l1', 'lp', 'l0', 'linf', 'log'``.
        tie: where zeros of ``c`` and tied votes go on the 1-bit paths (:data:`lioncub.votes.TIE_RULES`):
            ``'alternate'`` (the paper's: +1 on even steps, −1 on odd; the default), ``'plus'``
            (always +1) or ``'minus'`` (always −1). ``onebit``: zeros and ties; ``gather`` and
            ``pbit`` with ``quantizer=None``: zeros (ties vote 0). Other votes (and ``'auto'``,
            which may pick ``sign_allreduce``) accept only ``'alternate'``. ``'hold'`` (``onebit``
            only): a tied count repeats the element's last vote, which its chunk owner keeps
            (N/P bytes per message, saved in ``state_dict``, not resharded; zeros of c alternate;
            not with server error feedback, overlap or the DDP hook).
        error_feedback: ``'none'`` (default) or ``'worker'``: each rank votes on ``v = c + e``
            and keeps the residual ``e ← v − s·sign(v)`` (``s`` = mean|v| per tensor, kept
            local; ``state[p]['ef_residual']``). Binary-sign votes only (``onebit``, ``gather``,
            ``pbit`` with ``quantizer=None``). ``'server'``: ``onebit`` only; the owner of each
            chunk sends ``σ = sign(a + r)`` of the mean sign ``a = (2k − P)/P`` and keeps
            ``r ← a + r − σ`` (per message, ``8N/P`` fp32, saved in ``state_dict``; a checkpoint
            does not reshard to another world size). ``'both'``: the two residuals. The bytes
            are the plain vote's. See :mod:`lioncub.votes.feedback`.
        stochastic_signs: send +1 with probability (1 + v/M)/2 (``True``: ``M`` = max|v| per
            tensor; a float k > 0: ``M`` = k·mean|v| per tensor, v/M clipped to [−1, 1]),
            drawn from this rank's generator (``seed + rank``, saved), so the expected message
            is v/M. Binary-sign votes only. With either option the bucket's encode runs as torch
            ops after the step's agreement (no fused one-pass encode, nothing encoded ahead) and
            ``overlap`` / the DDP hook are refused.
        aggregate: ``'vote'`` (the default: the majority vote of the signs of ``c``) or ``'mean'``
            (``vote='onebit'`` only): the same two 1-bit collectives carry a compressed mean of the
            gradients instead, with error feedback on the workers and on the chunk owners (plus 4
            bytes per tensor per chunk for the scales), and every rank runs Lion's exact update on
            the decoded mean with a momentum that is the same on every rank
            (:mod:`lioncub.votes.mean`). Residuals: one per element (``state[p]['ef_residual']``)
            and the owner's ``8N/P`` fp32 (saved, not resharded). Not with ``error_feedback``,
            ``stochastic_signs``, ``tie='hold'``, overlap or the DDP hook.
        mean_adapt, mean_range: ``aggregate='mean'`` only: each element's magnitude, shared by all
            ranks and read from the signs every rank receives, grows by ``mean_adapt`` (γ ≥ 1) where
            the sign repeats and shrinks by it where the sign flips, within ``[1/mean_range,
            mean_range]`` of its tensor's mean (γ = 1: one flat scale per tensor).
        mean_norm: ``aggregate='mean'`` only: which mean of a tensor's magnitudes is held at 1,
            ``'arithmetic'`` (the default) or ``'geometric'`` (the range centred on the typical
            element in log scale).
        mean_restart: ``aggregate='mean'`` only: after this many steps (default 50; 0: never) the
            shared momentum and both residuals restart from zero, keeping the adapted magnitudes:
            what the first steps put there was compressed with magnitudes still flat.
        grad_dtype: ``vote='grad'`` only: ``'fp32'`` or ``'bf16'`` all-reduce.
        fused: the backend of the per-parameter passes, chosen once per bucket here, as
            ``torch.optim`` optimizers take it: None (default) the fused loops of
            :mod:`lioncub.fused` wherever they run (contiguous fp32 on CPU with a C compiler,
            on CUDA with Triton), the torch ops elsewhere; True requires the fused loops
            (``ValueError`` if a bucket cannot take them); False the torch ops. Both give the
            same bits; ``backends`` holds each bucket's choice and why.
        process_group: the data-parallel group (default: the world).
        bucket_mb: bucket size in MiB of fp32 elements (the scratch ``c`` is one bucket).
        message_mb: without overlap, the buckets' votes travel together, in messages of
            at most this many MiB on the wire (one exchange per message: 1-bit votes of a
            100M-parameter model are one 12 MiB message); with overlap each bucket is its
            own message, launched during backward. Up to ``encode_ahead`` (4) messages are
            written before the step's has-grad/finite agreement and kept between steps.
        maximize: maximise the objective.
        seed: seeds the stochastic quantizer's generator (``seed + rank``).
        momentum_sync: which momenta to average across ranks every ``sync_every``
            steps: ``'none'``, ``'all'``, ``'io'`` (input embedding + output layer,
            needs ``model``), ``'adaptive'``, or an explicit list of parameter names
            or tensors (see :mod:`lioncub.engine.momentum`).
        sync_every, sync_dtype: period (steps) and dtype (``'fp32'``/``'bf16'``) of
            the momentum all-reduce.
        model: the module the params come from; used to name parameters and to find
            the input/output layers.
        nonfinite: ``'raise'`` or ``'skip'`` (all ranks skip the step; ``'skip_step'`` is an
            older spelling) when any rank's gradient holds NaN or Inf; the decision is agreed
            by all ranks (see :mod:`lioncub.engine.guard`).
        check_every: every k steps verify that replicas are identical (0 = never): the
            checksums of the parameters after step k are gathered at the start of the next
            ``step()`` and read with its one agreement (a divergence raises there).
        timing: measure the time split of ``last_step_stats`` (``t_*``). None (default):
            on CPU always (it costs nothing); on CUDA never (the times stay 0: NCCL calls
            return at launch, so honest times need a device synchronise around every part).
            True on CUDA synchronises before each clock read: exact wire and kernel times,
            slower steps. Bytes and collective counts are always exact.
        overlap: launch each bucket's vote from backward hooks as soon as its last
            gradient is accumulated (:mod:`lioncub.engine.overlap`); step() then waits only for
            votes still in flight and applies. Same parameters, bit for bit, for every
            binary-sign vote. For gradient accumulation run all micro-batches but the last
            under ``with opt.no_sync():``. ``opt.remove_hooks()`` turns it off. Under DDP use
            :func:`lioncub.ddp.hook.register` instead (DDP's buckets, DDP's hooks).
    """

    encode_ahead = 4
    """Messages encoded before the has-grad / finite agreement (at most this many times
    ``message_mb`` of kept buffers; 1-bit votes of a 800M-parameter model are 4 messages)."""

    state_key = "lioncub"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        vote: str = "pbit",
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
    ):
        check_hyperparameters(lr, betas, weight_decay)
        check_optional_bool("timing", timing)
        check_bool("maximize", maximize)
        check_bool("overlap", overlap)
        config = VoteConfig(vote=vote, bits=bits, quantizer=quantizer, tie=tie, seed=seed, grad_dtype=grad_dtype,
                            fused=fused, bucket_mb=bucket_mb, message_mb=message_mb,
                            error_feedback=error_feedback, stochastic_signs=stochastic_signs,
                            aggregate=aggregate, mean_adapt=mean_adapt, mean_range=mean_range,
                            mean_norm=mean_norm, mean_restart=mean_restart)
        auto.check_auto_args(vote, alpha, beta, gamma)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)
        self._check_params()
        # a NodeCub's vote (``_verified``): NodeCub checked and broadcast the model over the whole world
        params = [p for g in self.param_groups for p in g["params"]]
        self.plan = BucketPlan(self.param_groups, config.bucket_mb, config.fused)
        self.open_shell(params, group=process_group, model=model, nonfinite=nonfinite, check_every=check_every,
                        seed=seed, verify=not _verified, chunks=[b.params for b in self.plan.buckets])
        if config.votes:
            config.method(self.world_size)  # refuses what cannot be exact for P ranks, before any vote
        self.timing = self.device.type == "cpu" if timing is None else timing
        if fused is None:
            self._warn_if_slow_path()
        self.steps = 0  # completed steps: sets the tie/zero parity of the 1-bit votes
        self.skipped_steps = 0  # steps skipped by nonfinite='skip' (all ranks agree)
        self._checked = 0  # the step count whose replicas check_every last verified
        self.last_step_stats = CommStats()
        self._driver = None  # attached by lioncub.engine.overlap (overlap=True) or lioncub.ddp.hook
        self.bucket_step = BucketStep(self.state, self.world_size, self.group, self.generator, config.message_mb)
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
        if overlap:
            from ..engine.overlap import Overlap  # hooks every param; launches votes during backward

            Overlap(self)

    # ------------------------------------------------------------------ settings
    def _set_config(self, config: VoteConfig) -> None:
        """The vote settings and their method object (None for ``'grad'``), for every path's step."""
        self.config = config
        """The validated vote settings (:class:`~lioncub.engine.config.VoteConfig`; ``'auto'`` resolved)."""
        self.method = config.method(self.world_size)
        self.bucket_step.method = self.method
        self.vote_chosen = (config.vote, config.bits)

    grad_dtype = property(lambda self: self.config.grad_dtype, doc="``vote='grad'``'s all-reduce dtype.")
    fused = property(lambda self: self.config.fused, doc="The requested backend (None: fused where it runs).")
    bucket_mb = property(lambda self: self.config.bucket_mb, doc="Bucket size, MiB of fp32 elements.")
    message_mb = property(lambda self: self.config.message_mb, doc="Message size on the wire, MiB.")
    error_feedback = property(lambda self: self.config.error_feedback,
                              doc="``'none'``, ``'worker'`` (each rank's residual of its scaled sign), ``'server'`` "
                                  "(each chunk owner's residual of its voted sign) or ``'both'``.")
    aggregate = property(lambda self: self.config.aggregate,
                         doc="``'vote'`` (the majority vote of signs) or ``'mean'`` (the 1-bit compressed mean).")
    stochastic_signs = property(lambda self: self.config.stochastic_signs,
                                doc="Whether the binary signs are drawn, +1 with probability (1 + v/M)/2.")

    # ------------------------------------------------------------------ set-up
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]  # now filled with defaults
        try:
            check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
            if hasattr(self, "device"):  # a group added after construction: the same one device
                for i, p in enumerate(g["params"]):
                    if p.device != self.device:
                        raise ValueError(f"parameter {i} of the new group is on {p.device}, this optimizer's "
                                         f"parameters on {self.device}: one optimizer communicates on one device")
        except (TypeError, ValueError) as exc:
            self.param_groups.pop()
            raise type(exc)(f"param group {len(self.param_groups)}: {exc}") from None

    @property
    def param_entries(self) -> list[tuple[dict, Tensor]]:
        """(param group, parameter) in registration order (the plan's)."""
        return self.plan.param_entries

    @property
    def buckets(self) -> list[Bucket]:
        """The plan's buckets, last-registered parameters first (:class:`~lioncub.engine.step.BucketPlan`)."""
        return self.plan.buckets

    @property
    def backends(self) -> list[str]:
        """Per bucket, the backend chosen (``fused=``) and why: ``'fused: ...'`` or ``'torch: ...'``."""
        return self.plan.backends

    def plan_bucket(self, idx: list[int]) -> Bucket:
        """The :class:`~lioncub.engine.step.Bucket` of parameters ``idx`` (indices into
        ``param_entries``; the DDP hook's buckets are DDP's), made once and kept."""
        return self.plan.bucket(idx)

    @property
    def driver(self):
        """What launches the votes during backward (overlap, the DDP hook), or None."""
        return self._driver

    def attach_driver(self, driver) -> None:
        """Let ``driver`` (overlap, the DDP hook) launch the votes; ``step()`` then waits for
        them and applies. One driver at a time."""
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

    def _warn_if_slow_path(self) -> None:
        """fp32 CPU params but the fused loops failed to build: say so once, with why."""
        why = fused.status()
        if why.startswith("unavailable") and any(p.device.type == "cpu" and p.dtype == torch.float32
                                                 for _, p in self.param_entries):
            warnings.warn(f"LionCub: the fused CPU loops are {why}. The torch path runs instead (same results, "
                          "3-10x slower local work per step). Set LIONCUB_FUSED=0 to choose it and silence this.",
                          RuntimeWarning, stacklevel=3)

    def _check_params(self) -> None:
        for i, p in enumerate(p for g in self.param_groups for p in g["params"]):
            if not torch.is_floating_point(p):
                raise TypeError(f"parameter {i} has dtype {p.dtype}; LionCub needs floating-point params")
            if p.is_sparse:
                raise TypeError(f"parameter {i} is sparse; LionCub supports dense parameters only")

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
        """One step whose agreement (:func:`~lioncub.engine.guard.agree`: which parameters have a
        gradient anywhere, how many ranks hold a non-finite one) the caller already made over a
        group that contains this optimizer's: NodeCub's one agreement over the world, which its
        cross-node vote would otherwise repeat (an all-reduce and a host read more per step).
        Collective as :meth:`step`."""
        with comm.step_context(self.steps):
            return self._step(None, None, verdict)

    def _step(self, closure, grad_scaler=None, verdict: Optional[guard.Verdict] = None):
        loss = self.run_closure(closure)
        stats = self.new_stats()
        params = [p for _, p in self.param_entries]
        driver = self._driver  # overlap / DDP hook: votes already launched during backward
        if driver is not None and amp.scaling(self, grad_scaler):
            raise ValueError("fp16 loss scaling (GradScaler) with overlap=True or the DDP hook: the votes were "
                             "encoded during backward from scaled gradients; use bf16 autocast (no scaler), or "
                             "overlap=False without the DDP hook")
        scaler_inf = amp.unscale(self, grad_scaler, params)  # None without a scaler
        run, buckets = self.bucket_step, self.buckets
        if driver is not None:
            driver.finish_votes(stats)  # nothing in flight before the next collective
        early = None  # fused encode first: it checks every gradient in the same read
        finite = None
        if driver is None and self.method is not None and run.encodes_ahead(buckets):
            early, finite = run.encode_messages(buckets, stats, self.steps, ahead=self.encode_ahead)
            if verdict is None:  # messages beyond the ones ahead
                rest = [p for msg, buf in early if buf is None for b in msg for p in buckets[b].params]
                finite = guard.all_finite(finite, guard.grads_finite(rest))
        elif driver is not None:
            finite = driver.finite() if callable(getattr(driver, "finite", None)) else None
        if verdict is None:  # (NodeCub agrees over the whole world for its voter)
            check = None  # the replica check of the previous step's result, read with the agreement
            if self.check_due(self.steps) and self._checked != self.steps:
                check = guard.replicas_differ(params, self.group, self.world_size, step=self.steps, stats=stats)
                self._checked = self.steps
            verdict = guard.agree(params, self.group, self.world_size, self.device, stats, finite=finite,
                                  extra=None if check is None else check[0], scaler_inf=scaler_inf)
            if any(verdict.extra):
                guard.report_replicas(check[1], params, step=self.steps, names=self._param_names)
        active, bad_ranks = verdict.active, verdict.bad_ranks
        amp.record_agreed(self, grad_scaler, bad_ranks)
        if bad_ranks:
            if driver is not None:
                driver.discard()
            if scaler_inf is None:
                guard.handle_nonfinite(self.nonfinite, params, bad_ranks, step=self.steps,
                                      names=self._param_names)  # raises, or we skip this step
            self.skipped_steps += 1
            self.last_step_stats = stats
            return loss
        if driver is not None:
            driver.apply(active, stats)
        elif early is not None and all(active):
            run.exchange_messages(buckets, early, stats, self.steps)
        else:  # (and when no rank has a gradient for some param: encoded again without it)
            parts = [b if all(active[i] for i in b.index) else b.only([k for k, i in enumerate(b.index) if active[i]])
                     for b in buckets]
            parts = [b for b in parts if b.entries]
            if self.method is None:
                for bucket in parts:
                    run.step_grad(bucket, self.grad_dtype, stats)
            else:
                run.step_messages(parts, stats, self.steps)
        self.steps += 1
        self.momentum_sync.after_step(self.steps, self.state, stats)
        self.last_step_stats = stats
        return loss

    def check_replicas(self) -> None:
        """Verify now (a collective: every rank calls it) that every rank holds the same
        parameters; ``check_every`` does this at the start of the step after every k-th."""
        guard.check_replicas([p for _, p in self.param_entries], self.group, self.world_size, step=self.steps,
                             names=self._param_names, stats=self.new_stats())

    def messages(self) -> list[list[int]]:
        """How the buckets travel without overlap: bucket indices grouped into messages of
        at most ``message_mb`` MiB on the wire (:meth:`BucketStep.messages
        <lioncub.engine.step.BucketStep.messages>`)."""
        return self.bucket_step.messages(self.buckets)

    def message_elements(self) -> list[int]:
        """Per message (all parameters active), the element count whose single vote moves
        the same bytes: what :func:`lioncub.engine.cost.predicted_bytes` takes."""
        method = self.method
        return [method.elements(sum(method.part_nbytes(self.buckets[b].numel) for b in msg))
                for msg in self.messages()]

    # ------------------------------------------------------------------ state
    def fingerprint(self) -> dict:
        return self.config.fingerprint()

    def state_dict(self) -> dict:
        sd = super().state_dict()
        server = self.method is not None and self.method.owner_state  # the chunk owners' residuals / held votes
        sd[self.state_key] = self.envelope(dict(steps=self.steps, skipped_steps=self.skipped_steps),
                                           vote_requested=self.vote_requested,
                                           momentum_sync=self.momentum_sync.state_dict(),
                                           **(dict(server_residuals=self.bucket_step.server_state()) if server else {}))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        if isinstance(state_dict, dict) and isinstance(state_dict.get(self.state_key), dict):
            state_dict = {**state_dict, self.state_key: resume.upgrade_envelope(state_dict[self.state_key])}
        extra = state_dict.get(self.state_key) if isinstance(state_dict, dict) else None
        if isinstance(extra, dict) and "server_residuals" in extra:  # before the rank check: say why
            resume.check_server_world(extra["config"]["error_feedback"], extra["world_size"], self.world_size,
                                      tie=extra["config"].get("tie", "alternate"),
                                      aggregate=extra["config"].get("aggregate", "vote"))
        if extra is not None and self.vote_requested == "auto" and extra.get("vote_requested") == "auto":
            saved = extra["config"]  # resume with the run's pick
            self._set_config(self.config.resolved(saved["vote"], saved["bits"]))
        extra = resume.check_loadable(self, state_dict)  # settings, rank, world, shapes, finite momenta: once
        # a copy: torch keeps same-dtype tensors by reference, which would share momenta
        base = copy.deepcopy({k: v for k, v in state_dict.items() if k != self.state_key})
        super().load_state_dict(base)
        self.plan = BucketPlan(self.param_groups, self.config.bucket_mb, self.config.fused)  # torch's new groups
        self.bucket_step.state = self.state  # torch's new state dict
        self.steps = int(extra["counters"]["steps"])
        self.skipped_steps = int(extra["counters"].get("skipped_steps", 0))
        comm.restore_generator(self.generator, extra["generator"])
        self.momentum_sync.load_state_dict(extra.get("momentum_sync", {}))
        self.bucket_step.load_server_state(extra.get("server_residuals", []), self.device)
