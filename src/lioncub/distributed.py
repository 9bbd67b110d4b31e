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
:mod:`lioncub.bucket_step`; this class plans the buckets, checks, agrees and orchestrates.

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
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import amp, auto, comm, fused, guard, momentum, resume, votes
from .bucket_step import GRAD_DTYPES, Bucket, BucketStep, choose_backend
from .comm import CommStats
from .lion import _validate_hyperparameters
from .quantize import QUANTIZERS
from .votes import VOTE_METHODS

__all__ = ["LionCub", "OPTIMIZER_VOTES", "GRAD_DTYPES"]

OPTIMIZER_VOTES = ("grad",) + VOTE_METHODS + ("auto",)
NONFINITE_POLICIES = ("raise", "skip_step")


def _world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class LionCub(torch.optim.Optimizer):
    """Lion with a compressed majority vote across data-parallel ranks.

    Args:
        params: iterable of parameters or param-group dicts (``lr``, ``betas``,
            ``weight_decay`` per group).
        lr, betas, weight_decay: as :class:`lioncub.Lion`.
        vote: ``'grad'`` (gradient all-reduce baseline), ``'sign_allreduce'``,
            ``'gather'``, ``'onebit'``, ``'pbit'`` (see :mod:`lioncub.votes`) or ``'auto'``:
            the cheapest binary-sign vote for this world size by the α-β model plus
            per-method local cost (:mod:`lioncub.auto`); the pick is ``vote_chosen``.
        alpha, beta, gamma: ``vote='auto'`` only: latency (s) and seconds per bit of
            the link (both None: measured by :func:`lioncub.cost.calibrate`), and
            per-method local costs overriding :data:`lioncub.auto.DEFAULT_GAMMA`.
        bits: ``pbit`` lane width (2, 4 or 8); None picks the smallest valid one.
        quantizer: ``pbit`` only: None (binary signs, the paper's 4-bit Lion Cub),
            or one of ``'sign', 'l1', 'lp', 'l0', 'linf', 'log'``.
        tie: where zeros of ``c`` and tied votes go on the 1-bit paths (:data:`lioncub.votes.TIE_RULES`):
            ``'alternate'`` (the paper's: +1 on even steps, −1 on odd; the default), ``'plus'``
            (always +1) or ``'minus'`` (always −1). ``onebit``: zeros and ties; ``gather`` and
            ``pbit`` with ``quantizer=None``: zeros (ties vote 0). Other votes (and ``'auto'``,
            which may pick ``sign_allreduce``) accept only ``'alternate'``.
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
            or tensors (see :mod:`lioncub.momentum`).
        sync_every, sync_dtype: period (steps) and dtype (``'fp32'``/``'bf16'``) of
            the momentum all-reduce.
        model: the module the params come from; used to name parameters and to find
            the input/output layers.
        nonfinite: ``'raise'`` or ``'skip_step'`` when any rank's gradient holds NaN or
            Inf; the decision is agreed by all ranks (see :mod:`lioncub.guard`).
        check_every: every k steps verify that replicas are identical (0 = never): the
            checksums of the parameters after step k are gathered at the start of the next
            ``step()`` and read with its one agreement (a divergence raises there).
        timing: measure the time split of ``last_step_stats`` (``t_*``). None (default):
            on CPU always (it costs nothing); on CUDA never (the times stay 0: NCCL calls
            return at launch, so honest times need a device synchronise around every part).
            True on CUDA synchronises before each clock read: exact wire and kernel times,
            slower steps. Bytes and collective counts are always exact.
        overlap: launch each bucket's vote from backward hooks as soon as its last
            gradient is accumulated (:mod:`lioncub.overlap`); step() then waits only for
            votes still in flight and applies. Same parameters, bit for bit, for every
            binary-sign vote. For gradient accumulation run all micro-batches but the last
            under ``with opt.no_sync():``. ``opt.remove_hooks()`` turns it off. Under DDP use
            :func:`lioncub.ddp_hook.register` instead (DDP's buckets, DDP's hooks).
    """

    encode_ahead = 4
    """Messages encoded before the has-grad / finite agreement (at most this many times
    ``message_mb`` of kept buffers; 1-bit votes of a 800M-parameter model are 4 messages)."""

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
    ):
        _validate_hyperparameters(lr, betas, weight_decay)
        if timing is not None and not isinstance(timing, bool):
            raise TypeError(f"timing must be None, True or False, got {timing!r}")
        if vote not in OPTIMIZER_VOTES:
            raise ValueError(f"vote must be one of {OPTIMIZER_VOTES}, got {vote!r}")
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype must be one of {tuple(GRAD_DTYPES)}, got {grad_dtype!r}")
        if quantizer is not None and quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be None or one of {QUANTIZERS}, got {quantizer!r}")
        votes.check_lane_options(vote, bits, quantizer)
        votes.check_tie(tie, vote, quantizer)
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be None, True or False, got {fused!r}")
        for name, mb in (("bucket_mb", bucket_mb), ("message_mb", message_mb)):
            if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0:
                raise ValueError(f"{name} must be a number > 0, got {mb!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"check_every must be an int >= 0 (0 = never), got {check_every!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if not isinstance(maximize, bool):
            raise TypeError(f"maximize must be a bool, got {maximize!r}")
        if vote != "auto" and (alpha is not None or beta is not None or gamma is not None):
            raise ValueError(f"alpha, beta and gamma apply to vote='auto' only, got vote={vote!r}")
        if (alpha is None) != (beta is None):
            raise ValueError("give both alpha and beta (skips the probe), or neither (calibrate)")
        self.rank, self.world_size = _world(process_group)
        if vote in votes.METHODS:
            votes.make(vote, self.world_size, bits, quantizer, tie)  # refuses what cannot be exact for P ranks
        self.vote, self.bits, self.quantizer, self.grad_dtype = vote, bits, quantizer, grad_dtype
        self.tie = tie
        self.group, self.bucket_mb, self.seed = process_group, float(bucket_mb), seed
        self.message_mb = float(message_mb)
        self.nonfinite, self.check_every = nonfinite, check_every
        self.skipped_steps = 0  # steps skipped by nonfinite='skip_step' (all ranks agree)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)
        self._check_params()
        self.device = comm.comm_device([p for g in self.param_groups for p in g["params"]], process_group)
        """The one device of the parameters, momenta, messages and every collective."""
        self.timing = self.device.type == "cpu" if timing is None else timing
        self.fused = fused
        self._plan()
        if fused is None:
            self._warn_if_slow_path()
        self.generator = comm.make_generator(self.device, seed + self.rank)  # on the device, saved
        self.steps = 0  # completed steps: sets the tie/zero parity of the 1-bit votes
        self._checked = 0  # the step count whose replicas check_every last verified
        self.last_step_stats = CommStats()
        self._driver = None  # attached by lioncub.overlap (overlap=True) or lioncub.ddp_hook
        self.bucket_step = BucketStep(self, self.world_size, self.group, self.generator, self.message_mb)
        self.vote_requested = vote
        if vote == "auto":
            self.vote, self.bits = self._choose_vote(alpha, beta, gamma)
        self.vote_chosen = (self.vote, self.bits)
        self._set_method()
        self._param_names = guard.param_names(model, [p for _, p in self.param_entries])
        guard.check_same_params([p for _, p in self.param_entries], self.group, self.world_size,
                                names=self._param_names)
        self._broadcast_parameters()
        self.momentum_sync = momentum.MomentumSync(
            momentum_sync, every=sync_every, dtype=sync_dtype, model=model, optimizer=self
        )
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        if overlap:
            from .overlap import Overlap  # hooks every param; launches votes during backward

            Overlap(self)

    # ------------------------------------------------------------------ set-up
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]  # now filled with defaults
        try:
            _validate_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
            if hasattr(self, "device"):  # a group added after construction: the same one device
                for i, p in enumerate(g["params"]):
                    if p.device != self.device:
                        raise ValueError(f"parameter {i} of the new group is on {p.device}, this optimizer's "
                                         f"parameters on {self.device}: one optimizer communicates on one device")
        except (TypeError, ValueError) as exc:
            self.param_groups.pop()
            raise type(exc)(f"param group {len(self.param_groups)}: {exc}") from None

    def _set_method(self) -> None:
        """The vote method object of ``vote`` (None for ``'grad'``), for every path's step."""
        self.method = (None if self.vote == "grad" else
                       votes.make(self.vote, self.world_size, self.bits, self.quantizer, self.tie))
        self.bucket_step.method = self.method

    def _plan(self) -> None:
        """The bucket plan over the current param groups (``torch``'s ``load_state_dict``
        replaces the group dicts, so it is made again there): ``param_entries`` ((param group,
        parameter) in registration order) and ``buckets``, each with its backend (``fused=``)."""
        self.param_entries = [(g, p) for g in self.param_groups for p in g["params"]]
        self._planned: dict[tuple[int, ...], Bucket] = {}
        self.buckets = [self.plan_bucket(idx) for idx in self._make_buckets()]
        self.backends = [b.reason for b in self.buckets]
        """Per bucket, the backend chosen (``fused=``) and why: ``'fused: ...'`` or ``'torch: ...'``."""

    def plan_bucket(self, idx: list[int]) -> Bucket:
        """The :class:`~lioncub.bucket_step.Bucket` of parameters ``idx`` (indices into
        ``param_entries``; the DDP hook's buckets are DDP's), made once and kept."""
        key = tuple(idx)
        bucket = self._planned.get(key)
        if bucket is None:
            entries = [self.param_entries[i] for i in idx]
            bucket = self._planned[key] = Bucket(entries, list(idx), *choose_backend([p for _, p in entries],
                                                                                    self.fused))
        return bucket

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

    def _make_buckets(self) -> list[list[int]]:
        """Parameter indices per bucket, last-registered first (backward order)."""
        limit = max(1, int(self.bucket_mb * 2**20 / 4))
        buckets, current, size = [], [], 0
        params = self.param_entries
        for i in reversed(range(len(params))):
            n = params[i][1].numel()
            if current and size + n > limit:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += n
        if current:
            buckets.append(current)
        return buckets

    def _choose_vote(self, alpha, beta, gamma) -> tuple[str, Optional[int]]:
        """vote='auto': the cheapest valid vote over this optimizer's buckets; rank 0's
        pick is broadcast so every rank runs the same method even if inputs differ."""
        sizes = [b.numel for b in self.buckets]
        method, bits, self.auto_alpha_beta = auto.agree_on_vote(sizes, self.world_size, self.group, alpha, beta,
                                                                gamma=gamma, device=self.device)
        return method, bits

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Start every replica from rank 0's parameters (one broadcast per bucket)."""
        if self.world_size == 1:
            return
        for bucket in self.buckets:
            comm.broadcast_from_first(bucket.params, self.group)

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
        rank's scale alike (see :mod:`lioncub.amp`)."""
        with comm.step_context(self.steps):  # a failed collective names this step
            return self._step(closure, grad_scaler)

    _step_supports_amp_scaling = True
    """``GradScaler.step`` always calls :meth:`step` (on every rank) and hands it the scaler."""

    def _step(self, closure, grad_scaler=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
            rest = [p for msg, buf in early if buf is None for b in msg for p in buckets[b].params]
            finite = guard.all_finite(finite, guard.grads_finite(rest))  # messages beyond the ones ahead
        elif driver is not None:
            finite = driver.finite() if callable(getattr(driver, "finite", None)) else None
        check = None  # the replica check of the previous step's result, read with the agreement
        if self.check_every and self.steps and self.steps % self.check_every == 0 and self._checked != self.steps:
            check = guard.replicas_differ(params, self.group, self.world_size, step=self.steps, stats=stats)
            self._checked = self.steps
        active, bad_ranks, diverged = guard.agree(params, self.group, self.world_size, self.device, stats,
                                                  finite=finite, extra=None if check is None else check[0],
                                                  scaler_inf=scaler_inf)
        if diverged:
            guard.report_replicas(check[1], params, step=self.steps, names=self._param_names)
        amp.record_agreed(self, grad_scaler, bad_ranks)
        if bad_ranks:
            if driver is not None:
                driver.discard()
            if scaler_inf is None:
                guard.handle_nonfinite(self, params, bad_ranks)  # raises, or we skip this step
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
        self.momentum_sync.after_step(self, stats)
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
        <lioncub.bucket_step.BucketStep.messages>`)."""
        return self.bucket_step.messages(self.buckets)

    def message_elements(self) -> list[int]:
        """Per message (all parameters active), the element count whose single vote moves
        the same bytes: what :func:`lioncub.cost.predicted_bytes` takes."""
        method = self.method
        return [method.elements(sum(method.part_nbytes(self.buckets[b].numel) for b in msg))
                for msg in self.messages()]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["lioncub"] = {
            "steps": self.steps,
            "generator": self.generator.get_state(),
            "vote": self.vote,
            "vote_requested": self.vote_requested,
            "bits": self.bits,
            "quantizer": self.quantizer,
            "grad_dtype": self.grad_dtype,
            "world_size": self.world_size,
            "rank": self.rank,
            "skipped_steps": self.skipped_steps,
            "momentum_sync": self.momentum_sync.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        extra = state_dict.get("lioncub")
        if extra is None:
            raise ValueError("state_dict has no 'lioncub' entry: it was not saved by LionCub.state_dict()")
        if self.vote_requested == "auto" and extra.get("vote_requested") == "auto":
            self.vote, self.bits = extra["vote"], extra["bits"]  # resume with the run's pick
            self.vote_chosen = (self.vote, self.bits)
            self._set_method()
        for key in ("vote", "bits", "quantizer", "grad_dtype"):
            if extra[key] != getattr(self, key):
                raise ValueError(
                    f"checkpoint was saved with {key}={extra[key]!r} but this optimizer has "
                    f"{key}={getattr(self, key)!r}"
                )
        resume.check_loadable(self, state_dict)  # rank, world size, shapes, finite momenta
        # a copy: torch keeps same-dtype tensors by reference, which would share momenta
        base = copy.deepcopy({k: v for k, v in state_dict.items() if k != "lioncub"})
        super().load_state_dict(base)
        self._plan()  # torch made new param-group dicts
        self.steps = int(extra["steps"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        comm.restore_generator(self.generator, extra["generator"])
        self.momentum_sync.load_state_dict(extra.get("momentum_sync", {}))
