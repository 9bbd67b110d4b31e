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

Example (every rank, inside an initialised process group)::

    opt = LocalCub(model.parameters(), lr=1e-4, local_steps=10, vote="onebit",
                   outer="nesterov", outer_lr=3.0)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        opt.step()              # communicates only when a round ends
        opt.zero_grad()
        if opt.synced:          # every replica now holds the same parameters
            evaluate(model)
"""
from __future__ import annotations

import copy
from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import amp, comm, guard, kernels, votes
from .auto import agree_on_vote, vote_costs
from .comm import CommStats
from .lion import Lion, _validate_hyperparameters
from .quantize import QUANTIZERS, quantize
from .vote import VOTE_METHODS, majority_vote, reference_vote

__all__ = ["LocalCub", "INNER_OPTIMIZERS", "OUTER_RULES", "LOCAL_VOTES", "AGGREGATES"]

INNER_OPTIMIZERS = ("lion", "adamw")
OUTER_RULES = ("sgd", "nesterov", "lion")
LOCAL_VOTES = ("grad",) + VOTE_METHODS
NONFINITE = ("raise", "skip_round")
AGGREGATES = ("vote", "mean")
MEAN_CLIP = 4  # aggregate='mean': lanes cover ±4 mean magnitudes of a tensor (fewer with fewer levels)


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


def _make_inner(inner, groups: list[dict], betas) -> torch.optim.Optimizer:
    """The inner optimizer over our param groups; weight decay is the outer step's job."""
    groups = [dict(g, weight_decay=0.0) for g in groups]
    if inner == "lion":
        return Lion(groups, betas=betas)
    if inner == "adamw":
        return torch.optim.AdamW(groups, betas=betas)
    if callable(inner):
        opt = inner(groups)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"inner must return a torch.optim.Optimizer, got {type(opt).__name__}")
        return opt
    raise ValueError(f"inner must be one of {INNER_OPTIMIZERS} or a callable(param_groups) -> Optimizer, "
                     f"got {inner!r}")


def sent_value(v: Tensor, sizes: list[int], *, vote: str, world: int, bits, quantizer) -> Tensor:
    """C(v): this rank's contribution to the vote in the units of ``v`` (flat, fp32).

    Binary votes send sign(v); its magnitude is taken as ``mean|v|`` of each tensor
    (``sizes``: the tensors' element counts, in order). ``pbit`` with a quantizer sends
    q(v) with the scale of the whole flat ``v``, as :func:`~lioncub.majority_vote` does.
    """
    levels = votes.make(vote, world, bits, quantizer).levels
    if levels is not None:  # a quantizer's values
        q = quantize(v, quantizer, levels=levels)
        return q.values.to(v.dtype) * q.scale
    out = torch.sign(v)
    for o, x in zip(out.split(sizes), v.split(sizes)):
        o.mul_(x.abs().mean())
    return out


class LocalCub(torch.optim.Optimizer):
    """Lion Cub with local steps: ``local_steps`` inner steps per agreed outer step.

    Args:
        params: parameters or param-group dicts (``lr``, ``betas``, ``weight_decay``).
        lr, betas: the inner optimizer's; ``lr`` also sizes the outer step (η above).
        weight_decay: λ, decoupled, applied to θ_s at each outer step as ``α·η·λ``
            (the inner optimizer runs without weight decay).
        local_steps: H >= 1, inner steps per round.
        inner: ``'lion'`` (default), ``'adamw'``, or ``callable(param_groups) -> Optimizer``.
        vote: ``'grad'`` (fp32 all-reduce of Δ, no compression), or a vote method of
            :func:`lioncub.majority_vote`: ``'sign_allreduce'``, ``'gather'``, ``'onebit'``,
            ``'pbit'``; or ``'auto'``: the cheapest binary-sign vote of the whole model by the
            α-β model (:mod:`lioncub.auto`; one vote per round, so ``round_costs`` holds each
            candidate's seconds per round and per step, ``per_step_s`` = round / H).
        alpha, beta, gamma: ``vote='auto'`` only, as in :class:`~lioncub.LionCub`.
        bits, quantizer: ``pbit`` only, as in :class:`~lioncub.LionCub`.
        outer: ``'sgd'``, ``'nesterov'`` or ``'lion'`` (see the module docstring).
        outer_lr: α > 0 (dimensionless).
        outer_momentum: μ in [0, 1) of ``'nesterov'``.
        outer_betas: (β1, β2) of ``'lion'``.
        error_feedback: keep each worker's residual e_i (not with ``vote='grad'``, which
            is lossless, nor with the stochastic ``'linf'`` quantizer).
        aggregate: ``'vote'`` (d = η·u, the majority vote) or ``'mean'`` (``pbit`` with
            ``quantizer='l1'`` only): every rank quantizes v_i with one shared L1 scale, the
            lanes' SUM all-reduce returns Σ_i q_i exactly, and d is their dequantized mean
            (a 2-8-bit DiLoCo pseudo-gradient; ``outer_lr`` then scales Δ as DiLoCo's does).
        tie: where zeros and tied votes go on the 1-bit paths, as in :class:`~lioncub.LionCub`
            (``'alternate'``: the round's parity; ``'plus'``, ``'minus'``).
        seed: seeds the stochastic quantizer's (``linf``) generator (``seed + rank``, on the
            parameters' device, saved in ``state_dict``).
        process_group: the data-parallel group (default: the world).
        nonfinite: ``'raise'`` or ``'skip_round'`` (every rank drops the round's local
            progress) when any rank met a NaN/Inf gradient during the round (that inner
            step is not taken) or its Δ holds one; agreed by all ranks at the round's end.
        check_every: every k rounds verify that replicas are identical (0 = never).
        model: the module, to name parameters in errors.

    Attributes: ``synced`` (the last ``step()`` ended a round: replicas are identical),
    ``rounds`` (outer steps taken), ``local_step`` (inner steps into the current round),
    ``last_round_stats`` (:class:`~lioncub.CommStats` of the last outer step),
    ``last_step_stats`` (the last ``step()``'s: the round's when it ended one, else empty).

    Memory per parameter: θ_s, plus e_i with error feedback, plus the outer momentum
    for ``'nesterov'``/``'lion'``, plus the inner optimizer's state.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        local_steps: int = 10,
        inner: Union[str, Callable] = "lion",
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
        model: Optional[torch.nn.Module] = None,
        alpha: Optional[float] = None,
        beta: Optional[float] = None,
        gamma: Optional[dict] = None,
    ):
        _validate_hyperparameters(lr, betas, weight_decay)
        self.H = _check_int("local_steps", local_steps, 1)
        if vote not in LOCAL_VOTES + ("auto",):
            raise ValueError(f"vote must be one of {LOCAL_VOTES + ('auto',)} with local steps, got {vote!r}")
        votes.check_lane_options(vote, bits, quantizer)
        votes.check_tie(tie, vote, quantizer)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if quantizer is not None and quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be None or one of {QUANTIZERS}, got {quantizer!r}")
        if outer not in OUTER_RULES:
            raise ValueError(f"outer must be one of {OUTER_RULES}, got {outer!r}")
        self.outer_lr = _check_positive("outer_lr", outer_lr)
        if not (isinstance(outer_momentum, (int, float)) and 0 <= outer_momentum < 1):
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        _validate_hyperparameters(1.0, outer_betas, 0.0)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {error_feedback!r}")
        if error_feedback and vote == "grad":
            raise ValueError("error_feedback needs a compressed vote: vote='grad' sends Δ exactly")
        if error_feedback and quantizer == "linf":
            raise ValueError("error_feedback cannot replay the stochastic quantizer 'linf'; "
                             "use quantizer='l1', 'l0', 'lp', 'log' or 'sign'")
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
        if aggregate == "mean" and (vote != "pbit" or quantizer != "l1"):
            raise ValueError("aggregate='mean' sums L1-quantized lanes: it needs vote='pbit' and quantizer='l1', "
                             f"got vote={vote!r}, quantizer={quantizer!r}")
        if vote != "auto" and (alpha is not None or beta is not None or gamma is not None):
            raise ValueError(f"alpha, beta and gamma apply to vote='auto' only, got vote={vote!r}")
        if (alpha is None) != (beta is None):
            raise ValueError("give both alpha and beta (skips the probe), or neither (calibrate)")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        self.check_every = _check_int("check_every", check_every, 0)
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        elif process_group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialised")
        else:
            self.rank, self.world_size = 0, 1
        if vote in votes.METHODS:
            votes.make(vote, self.world_size, bits, quantizer)  # refuses what cannot be exact for P ranks
        self.vote, self.bits, self.quantizer, self.outer = vote, bits, quantizer, outer
        self.outer_momentum, self.outer_betas = float(outer_momentum), tuple(outer_betas)
        self.error_feedback, self.group, self.nonfinite = error_feedback, process_group, nonfinite
        self.aggregate = aggregate
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.inner = _make_inner(inner, self.param_groups, tuple(betas))
        self._restore_weight_decay()
        self.param_groups = self.inner.param_groups  # one set of groups: schedulers drive both loops
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.device = comm.comm_device(self.params, self.group)  # every collective's tensors live here
        # a stochastic quantizer's (linf) draws: this rank's own generator, on the device, saved
        self.tie, self.seed = tie, seed
        self.generator = comm.make_generator(self.device, seed + self.rank)
        self._names = guard.param_names(model, self.params)
        guard.check_same_params(self.params, self.group, self.world_size, names=self._names)
        if self.world_size > 1:  # every replica starts from rank 0's parameters
            comm.broadcast_from_first(self.params, self.group)
        self.vote_requested = vote
        if vote == "auto":  # one vote per round of H steps: the per-step price is the round's / H
            n = sum(p.numel() for p in self.params)
            self.vote, self.bits, ab = agree_on_vote([n], self.world_size, self.group, alpha, beta, gamma=gamma,
                                                     device=self.device)
            self.auto_alpha_beta = ab
            costs = vote_costs([n], self.world_size, *ab, gamma=gamma)
            self.round_costs = {k: dict(v, per_step_s=v["total_s"] / self.H) for k, v in costs.items()}
        self.vote_chosen = (self.vote, self.bits)
        for p in self.params:
            self._outer_state(p)
        self.rounds, self.local_step, self.synced = 0, 0, False
        self.skipped_rounds, self._bad_round = 0, False
        self.last_round_stats = self.last_step_stats = CommStats()

    # ------------------------------------------------------------------ set-up
    def _restore_weight_decay(self) -> None:
        """The inner groups got weight_decay=0; keep λ in a key of our own for the outer step."""
        for mine, theirs in zip(self.param_groups, self.inner.param_groups):
            theirs["outer_weight_decay"] = mine["weight_decay"]

    def _outer_state(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["start"] = p.detach().clone()
            if self.error_feedback:
                state["residual"] = torch.zeros_like(p, dtype=torch.float32)
            if self.outer != "sgd":
                state["outer_m"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    # ------------------------------------------------------------------ step
    _step_supports_amp_scaling = True
    """``GradScaler.step`` always calls :meth:`step` on every rank (see :mod:`lioncub.amp`)."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One inner step; when it completes a round of ``local_steps``, the outer step.

        ``grad_scaler`` (passed by ``GradScaler.step``): the gradients are unscaled here; an
        overflow on this rank skips this rank's inner step only (inner steps are local, so
        the ranks' loss scales need not agree, and agreeing would cost a collective per
        step); the round's collectives run on every rank regardless."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        present = [p for p in self.params if p.grad is not None]
        scaler_inf = amp.unscale(self, grad_scaler, self.params)
        # one host read per inner step on a GPU: a NaN must not reach the inner optimizer's state
        # (the round's end then decides on every rank at once). Read as "how bad": 0 is ordinary.
        if scaler_inf is not None:  # the scaler checked every gradient: an overflow (Inf or NaN)
            if not bool(scaler_inf.sum() > 0):  # skips this rank's inner step; update() backs off its scale
                self.inner.step()
        else:
            finite = guard.grads_finite(present)
            bad = (not finite) if isinstance(finite, bool) else bool(torch.logical_not(finite))
            if bad:
                self._bad_round = True
            else:
                self.inner.step()
        self.local_step += 1
        self.synced = self.local_step == self.H
        self.last_step_stats = comm.step_stats(self.device)
        if self.synced:
            self._round()
            self.local_step = 0
            self.last_step_stats = self.last_round_stats
        return loss

    def _round(self) -> None:
        stats = comm.step_stats(self.device)
        sizes = [p.numel() for p in self.params]
        states = [self.state[p] for p in self.params]
        delta = torch.cat([(s["start"].float() - p.float()).reshape(-1) for s, p in zip(states, self.params)])
        v = delta
        if self.error_feedback:
            v = delta + torch.cat([s["residual"].reshape(-1) for s in states])
        # one tiny all-reduce: how many ranks hold a non-finite value, and (aggregate='mean') Σ_i mean|v_i|
        # of every tensor
        head = torch.zeros(1 + (len(sizes) if self.aggregate == "mean" else 0), dtype=torch.float64,
                           device=v.device)  # NCCL takes device tensors only
        head[0:1].copy_(torch.logical_not(torch.isfinite(delta).all()).reshape(1))  # on the device
        if self._bad_round:
            head[0] = 1.0
        if self.aggregate == "mean":
            head[1:] = torch.stack([piece.abs().mean() for piece in v.split(sizes)]).double()
        self._bad_round = False
        if self.world_size > 1:
            comm.all_reduce(head, self.group, stats)
        host = head.tolist()  # the round's one host read
        if host[0] > 0:
            self.last_round_stats = stats
            self._nonfinite(int(host[0]))
            return
        if self.aggregate == "mean":
            d, sent = self._lane_mean(v, sizes, [x / self.world_size for x in host[1:]], stats)
            d = d.split(sizes)
            signed = False
        elif self.vote == "grad":
            if self.world_size > 1:
                comm.all_reduce(v, self.group, stats)
                v /= self.world_size
            d = v.split(sizes)
            signed = False
        else:
            u = self._vote(v, stats)
            if self.error_feedback:
                sent = sent_value(v, sizes, vote=self.vote, world=self.world_size, bits=self.bits,
                                  quantizer=self.quantizer)
            d = u.split(sizes)
            signed = True
        if self.error_feedback:  # e_i ← v_i − C(v_i)
            for s, r, c in zip(states, v.split(sizes), sent.split(sizes)):
                torch.sub(r, c, out=s["residual"].view(-1))
        self._outer_step(d, signed)
        self.rounds += 1
        self.last_round_stats = stats
        if self.check_every and self.rounds % self.check_every == 0:
            guard.check_replicas(self.params, self.group, self.world_size, step=self.rounds, names=self._names)

    def _lane_mean(self, v: Tensor, sizes: list[int], norms: list[float], stats: CommStats) -> tuple[Tensor, Tensor]:
        """The mean of the workers' quantized v through summed lanes (aggregate='mean').

        Per tensor t, one scale shared by the ranks: M_t, the ranks' mean of mean|v_i| over t,
        and the step ``unit_t = min(s, CLIP)·M_t / s``: s levels cover ±min(s, CLIP)·M_t (with
        one level, a ternary q at ±M_t; with more, clipping only beyond CLIP = 4 mean
        magnitudes). q_i = clamp(round(v_i/unit_t), −s, s) travels as q_i + s in w-bit lanes;
        the SUM all-reduce adds lanes without carries, so Σ_i q_i comes back exact.
        Returns (unit·Σ_i q_i / P, unit·q_i): the mean and this rank's C(v), flat.
        """
        lanes = votes.make(self.vote, self.world_size, self.bits, self.quantizer)  # pbit with a quantizer
        w, levels = lanes.bits, lanes.levels
        P, n = self.world_size, v.numel()
        units = (torch.tensor(norms, dtype=torch.float64) * (min(levels, MEAN_CLIP) / levels)).tolist()  # host
        q = torch.empty_like(v)
        for qt, vt, unit in zip(q.split(sizes), v.split(sizes), units):
            if unit > 0:
                torch.round(vt * (1.0 / unit), out=qt).clamp_(-levels, levels)
            else:
                qt.zero_()
        if P > 1:
            msg = kernels.pack_bytes((q + levels).to(torch.uint8), n, w)
            comm.all_reduce(msg, self.group, stats)
            total = kernels.unpack_bytes(msg, n, w).to(torch.float32) - float(P * levels)  # Σ_i q_i, exact
        else:
            total = q.clone()
        for tt, qt, unit in zip(total.split(sizes), q.split(sizes), units):
            tt.mul_(unit / P)
            qt.mul_(unit)
        return total, q

    def _vote(self, v: Tensor, stats: CommStats) -> Tensor:
        kw = dict(method=self.vote, bits=self.bits, quantizer=self.quantizer, step=self.rounds, tie=self.tie)
        if self.world_size == 1:  # no process group needed: the one rank's vote is its reference
            return reference_vote([v], generators=[self.generator], **kw)
        return majority_vote(v, group=self.group, stats=stats, generator=self.generator, **kw)

    def _outer_step(self, d: list[Tensor], signed: bool) -> None:
        """θ_s ← outer(θ_s, d), then every replica ← θ_s. ``signed``: d holds u (d = η·u)."""
        i = 0
        for group in self.param_groups:
            lr, wd, alpha = group["lr"], group["outer_weight_decay"], self.outer_lr
            for p in group["params"]:
                s, di = self.state[p], d[i].view_as(p)
                i += 1
                start = s["start"]
                if wd != 0:
                    start.mul_(1.0 - alpha * lr * wd)
                if self.outer == "sgd":
                    if signed:
                        start.add_(di, alpha=-alpha * lr)  # with α = 1: exactly LionCub's p.add_(u, alpha=-lr)
                    else:
                        start.add_(di, alpha=-alpha)
                    p.copy_(start)
                    continue
                di = di * lr if signed else di
                m = s["outer_m"]
                if self.outer == "nesterov":
                    mu = self.outer_momentum
                    m.mul_(mu).add_(di)
                    start.add_(di.add(m, alpha=mu), alpha=-alpha)
                else:  # lion
                    b1, b2 = self.outer_betas
                    c = m.mul(b1).add_(di, alpha=1 - b1)
                    start.add_(c.sign_(), alpha=-alpha * lr)
                    m.mul_(b2).add_(di, alpha=1 - b2)
                p.copy_(start)

    def _nonfinite(self, bad_ranks: int) -> None:
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradients or parameters in round {self.rounds} on {bad_ranks} rank(s); "
                "pass nonfinite='skip_round' to drop such rounds")
        for p in self.params:  # every rank drops the round's local progress
            p.copy_(self.state[p]["start"])
        self.skipped_rounds += 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["local"] = {
            "inner": self.inner.state_dict(), "rounds": self.rounds, "local_step": self.local_step,
            "vote_requested": self.vote_requested, "skipped_rounds": self.skipped_rounds, "bad_round": self._bad_round, "world_size": self.world_size, "rank": self.rank,
            "config": self._config(), "generator": self.generator.get_state(),
            # inside a round every rank's parameters are its own (a model checkpoint holds one rank's)
            "params": [p.detach().clone() for p in self.params] if self.local_step else None,
        }
        return sd

    def _config(self) -> dict:
        return dict(local_steps=self.H, vote=self.vote, bits=self.bits, quantizer=self.quantizer, tie=self.tie,
                    outer=self.outer, error_feedback=self.error_feedback, aggregate=self.aggregate)

    def load_state_dict(self, state_dict: dict) -> None:
        extra = state_dict.get("local")
        if extra is None:
            raise ValueError("state_dict has no 'local' entry: it was not saved by LocalCub.state_dict()")
        if self.vote_requested == "auto" and extra.get("vote_requested") == "auto":
            self.vote, self.bits = extra["config"]["vote"], extra["config"]["bits"]  # resume with the run's pick
            self.vote_chosen = (self.vote, self.bits)
        for key, value in extra["config"].items():
            if self._config()[key] != value:
                raise ValueError(f"checkpoint was saved with {key}={value!r} but this optimizer has "
                                 f"{key}={self._config()[key]!r}")
        if extra["world_size"] != self.world_size:
            raise ValueError(f"checkpoint was saved by {extra['world_size']} workers, this run has "
                             f"{self.world_size}: local residuals and inner state are per worker")
        base = copy.deepcopy({k: v for k, v in state_dict.items() if k != "local"})
        super().load_state_dict(base)
        self.inner.load_state_dict(copy.deepcopy(extra["inner"]))
        self.param_groups = self.inner.param_groups
        self.rounds, self.local_step = int(extra["rounds"]), int(extra["local_step"])
        self.skipped_rounds, self._bad_round = int(extra["skipped_rounds"]), bool(extra["bad_round"])
        if extra.get("generator") is not None:  # (checkpoints before the generator: global RNG)
            comm.restore_generator(self.generator, extra["generator"])
        if extra.get("params") is not None:
            with torch.no_grad():
                for p, saved in zip(self.params, extra["params"]):
                    p.copy_(saved)
