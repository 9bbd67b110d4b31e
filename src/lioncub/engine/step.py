"""The plain step of :class:`~lioncub.LionCub`: a bucket plan and the two functions every
path calls, encode a bucket and apply a bucket (docs/design.md §9).

* :class:`Bucket` — a precomputed bucket: its (param group, parameter) entries, their
  indices into the optimizer's parameters, sizes, and the backend chosen once at
  construction (``fused``: the loops of :mod:`lioncub.fused`; else the torch ops) with the
  reason. Nothing in the per-step code decides the backend again.
* :class:`BucketStep` — the per-bucket machinery: :meth:`~BucketStep.encode_bucket` (this
  rank's part of a message: one fused pass from ``m`` and ``g``, or ``c`` then the vote
  method's ``encode``), :meth:`~BucketStep.apply_bucket` (the voted bytes → θ and m), and
  around them the message grouping of the normal step (:meth:`~BucketStep.messages`,
  :meth:`~BucketStep.encode_messages`, :meth:`~BucketStep.exchange_messages`), the one-worker
  step and the ``vote='grad'`` baseline.

:mod:`lioncub.engine.overlap` and :mod:`lioncub.ddp.hook` call the same ``encode_bucket``, the vote
method's ``exchange`` and ``apply_bucket``, so all three paths give the same bits.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import chunks, comm, fused
from . import guard
from .mean_step import mean_message
from ..comm import CommStats
from ..lion import apply_update_, interpolate, lion
from ..votes import VoteMethod

__all__ = ["Bucket", "BucketPlan", "Bucketed", "BucketStep", "OwnerState", "GRAD_DTYPES", "step_grad"]

GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Bucket:
    """Parameters voted (or applied) together, with the backend chosen for them.

    ``entries``: (param group, parameter) pairs; ``index``: their positions in the
    optimizer's parameter list; ``fused``: whether the fused loops run; ``reason``: why.
    """

    def __init__(self, entries: list[tuple[dict, Tensor]], index: list[int], fused: bool, reason: str):
        self.entries, self.index, self.fused, self.reason = entries, index, fused, reason
        self.params = [p for _, p in entries]
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self.runs = _runs(entries)
        self.device = self.params[0].device if self.params else None

    def only(self, keep: list[int]) -> "Bucket":
        """The bucket of ``entries[k] for k in keep`` (same backend)."""
        return Bucket([self.entries[k] for k in keep], [self.index[k] for k in keep], self.fused, self.reason)

    def beta1(self) -> list[float]:
        return [g["betas"][0] for g, _ in self.entries]

    def maximize(self) -> list[bool]:
        return [g["maximize"] for g, _ in self.entries]

    def hyper(self) -> dict:
        """Per-parameter update hyper-parameters for :mod:`lioncub.fused`'s apply loops
        (read at every step: a scheduler may change ``lr``)."""
        return dict(lr=[g["lr"] for g, _ in self.entries], beta2=[g["betas"][1] for g, _ in self.entries],
                    weight_decay=[g["weight_decay"] for g, _ in self.entries], maximize=self.maximize())


def _runs(entries) -> list[tuple[dict, list[int]]]:
    """Split a bucket's (group, param) entries into runs that share a param group."""
    runs: list[tuple[dict, list[int]]] = []
    for k, (g, _) in enumerate(entries):
        if runs and runs[-1][0] is g:
            runs[-1][1].append(k)
        else:
            runs.append((g, [k]))
    return runs


def choose_backend(params: list[Tensor], want: Optional[bool]) -> tuple[bool, str]:
    """The backend for ``params`` under ``fused=want`` (None: fused when usable), and why.
    ``want=True`` where the fused loops cannot run raises ``ValueError``."""
    if want is False:
        return False, "torch: fused=False"
    why_not = fused.unusable_reason(params)
    if why_not is None:
        return True, f"fused: {fused.backend_of(params)}"
    if want:
        raise ValueError(f"fused=True but the fused loops cannot run: {why_not}; pass fused=None or False")
    return False, f"torch: {why_not}"


class BucketPlan:
    """Which parameters travel together, and with which backend (made once, kept).

    ``param_entries``: (param group, parameter) in registration order; ``buckets``: of at
    most ``bucket_mb`` MiB of fp32 elements, last-registered first (the order backward
    produces gradients, as in DDP), each with its backend (``fused=``) chosen here;
    ``backends``: each bucket's choice and why. :meth:`bucket` serves other groupings of the
    same parameters (the DDP hook's buckets are DDP's), also made once. Frozen parameters
    (``requires_grad=False``) are not in the plan: a LoRA fine-tune sends nothing for its frozen base
    (:attr:`frozen`; :meth:`check_frozen`). ``local``: what the step works
    on for each parameter (FSDP2's DTensors: their local shards, :mod:`lioncub.engine.shards`). The plan knows no
    optimizer: torch's ``load_state_dict`` replaces the group dicts, so the optimizer makes a
    new plan there."""

    def __init__(self, param_groups: list[dict], bucket_mb: float, fused: Optional[bool],
                 local: Optional[Callable[[Tensor], Tensor]] = None):
        self.fused, self.bucket_mb = fused, bucket_mb
        self.param_entries = [(g, p if local is None else local(p)) for g in param_groups for p in g["params"]
                              if p.requires_grad]
        self.frozen = [p for g in param_groups for p in g["params"] if not p.requires_grad]
        """The parameters left out (``requires_grad=False`` when the plan was made): never encoded, sent or
        updated, as torch's optimizers never update a parameter without a gradient."""
        self._made: dict[tuple[int, ...], Bucket] = {}
        self.buckets = [self.bucket(idx) for idx in self._split()]
        self.backends = [b.reason for b in self.buckets]
        """Per bucket, the backend chosen (``fused=``) and why: ``'fused: ...'`` or ``'torch: ...'``."""

    def check_frozen(self) -> None:
        """A one-line ``ValueError`` when a parameter frozen at construction now has a gradient (it was
        unfrozen): it is not in the plan, so it would silently not train. No device work: attributes only."""
        for p in self.frozen:
            if p.requires_grad and p.grad is not None:
                raise ValueError(f"params: a parameter of shape {tuple(p.shape)} had requires_grad=False when the "
                                 "optimizer was built and now has a gradient; build the optimizer after unfreezing "
                                 "(its parameters with requires_grad=False are left out of every step)")

    def bucket(self, idx: list[int]) -> Bucket:
        """The :class:`Bucket` of parameters ``idx`` (indices into ``param_entries``)."""
        key = tuple(idx)
        made = self._made.get(key)
        if made is None:
            entries = [self.param_entries[i] for i in idx]
            made = self._made[key] = Bucket(entries, list(idx), *choose_backend([p for _, p in entries], self.fused))
        return made

    def _split(self) -> list[list[int]]:
        """Parameter indices per bucket, last-registered first (backward order)."""
        limit = max(1, int(self.bucket_mb * 2**20 / 4))
        buckets, current, size = [], [], 0
        for i in reversed(range(len(self.param_entries))):
            n = self.param_entries[i][1].numel()
            if current and size + n > limit:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += n
        if current:
            buckets.append(current)
        return buckets


class Bucketed:
    """What an optimizer with a :class:`BucketPlan` (``plan``) and a :class:`BucketStep`
    (``bucket_step``) says about how its parameters travel (LionCub's; a mixin)."""

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


class OwnerState:
    """What this rank keeps as a chunk owner between steps, per message layout (its buckets' parameter
    indices, a tuple of tuples): the fp32 server residual of its chunk (``error_feedback='server'`` /
    ``'both'``, the 1-bit mean) or, with ``tie='hold'``, the chunk's last voted bits. A layout seen
    again (a step where some parameter had no gradient anywhere travels in other messages) finds its own."""

    def __init__(self):
        self.by_layout: dict[tuple, Tensor] = {}

    def get(self, method: VoteMethod, buckets: list[Bucket], msg: list[int], m: int, device) -> Tensor:
        """The state of message ``msg`` (indices into ``buckets``, ``m`` bytes): fp32 zeros the first
        time the layout travels, or (``tie='hold'``) packed bits all +1."""
        key = tuple(tuple(buckets[b].index) for b in msg)
        r = self.by_layout.get(key)
        if r is None:
            n = method.owner_elements(m)
            r = self.by_layout[key] = (torch.zeros(n, dtype=torch.float32, device=device)
                                       if method.owner_state == "residual"  # tie='hold': all +1 at first
                                       else torch.full((n // 8,), 0xFF, dtype=torch.uint8, device=device))
        return r

    def items(self):
        return self.by_layout.items()

    def saved(self) -> list:
        """As saved: ``[[layout as lists, state], ...]`` (the tensors themselves)."""
        return [[[list(idx) for idx in key], r] for key, r in self.by_layout.items()]

    def load(self, saved: list, held: bool, device) -> None:
        """:meth:`saved`'s list back, copied onto ``device`` (``held``: ``tie='hold'``'s packed bits)."""
        dtype = torch.uint8 if held else torch.float32
        self.by_layout = {tuple(tuple(idx) for idx in key): r.to(device, dtype, copy=True) for key, r in saved}


class BucketStep:
    """Encode, exchange and apply buckets: the momenta live in ``state`` (the optimizer's
    ``state``; torch's ``load_state_dict`` makes a new one, which the optimizer hands over).

    ``method``: the vote method (:mod:`lioncub.votes`; None for ``vote='grad'``), set by the
    optimizer and replaced when ``vote='auto'`` resumes another pick."""

    def __init__(self, state: dict, world_size: int, group, generator: torch.Generator, message_mb: float):
        self.state, self.world_size, self.group, self.generator = state, world_size, group, generator
        self.message_mb = message_mb
        self.method: Optional[VoteMethod] = None
        self._scratch: dict = {}
        self.owners = OwnerState()
        """What this rank keeps as a chunk owner between steps (:class:`OwnerState`)."""

    # ------------------------------------------------------------------ tensors
    def buffer(self, key, n: int, dtype: torch.dtype, device) -> Tensor:
        """A flat tensor of ``n`` elements under ``key``, kept between steps (a fresh bucket per step
        cost page faults that took longer than the arithmetic on CPU): one fp32 bucket (``c``, or ``u``
        off the fused path), one int8 (``u`` on it), the message bytes (per launched bucket with overlap)."""
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = self._scratch[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]

    def clear_buffers(self) -> None:
        self._scratch.clear()

    def momenta(self, bucket: Bucket) -> list[Tensor]:
        """The momentum ``m`` of each parameter (zeros the first time: the optimizer state;
        made contiguous for the fused loops if a loaded checkpoint's was not)."""
        out = []
        for p in bucket.params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif bucket.fused and not state["exp_avg"].is_contiguous():
                state["exp_avg"] = state["exp_avg"].contiguous()
            out.append(state["exp_avg"])
        return out

    def residuals(self, bucket: Bucket) -> list[Tensor]:
        """Each parameter's error-feedback residual ``e`` (``state['ef_residual']``, in the
        parameter's dtype as the momentum is; zeros the first time: :mod:`lioncub.votes.feedback`)."""
        out = []
        for p in bucket.params:
            state = self.state[p]
            if "ef_residual" not in state:
                state["ef_residual"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out.append(state["ef_residual"])
        return out

    @staticmethod
    def grads(bucket: Bucket) -> list[Tensor]:
        """Each parameter's gradient (zeros where it has none; contiguous for the fused loops)."""
        grads = []
        for i, p in zip(bucket.index, bucket.params):
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
            elif g.is_sparse:
                raise TypeError(f"parameter {i} has a sparse gradient; LionCub supports dense gradients only")
            elif bucket.fused and not g.is_contiguous():
                g = g.contiguous()
            grads.append(g)
        return grads

    # ------------------------------------------------------------------ the two functions
    def encode_bucket(self, bucket: Bucket, dst: Tensor, step: int, stats: CommStats,
                      key="c") -> Optional[bool]:
        """This rank's part of a message for ``bucket`` into ``dst``. Returns whether the
        bucket's gradients are all finite when a fused loop read them (it reads them anyway),
        None when the torch ops did."""
        method = self.method
        if bucket.fused and method.one_pass:  # c never stored: one pass
            t0 = comm.clock(stats)
            finite = method.encode_fused(self.momenta(bucket), self.grads(bucket), bucket.beta1(),
                                         bucket.maximize(), dst, step)
            stats.t_quantize_pack += comm.clock(stats) - t0
            return finite
        c, finite = self._c_checked(bucket, stats, key, "t_quantize_pack")  # quantizers: c first
        t0 = comm.clock(stats)
        work = self.buffer("abs", c.numel(), torch.float32, c.device) if bucket.fused else None
        method.encode(c, dst, step, self.generator, work=work, use_fused=bucket.fused, sizes=bucket.sizes,
                      residuals=self.residuals(bucket) if method.feedback else None)
        stats.t_quantize_pack += comm.clock(stats) - t0
        return finite

    def apply_bucket(self, bucket: Bucket, voted: Tensor, offset: int, stats: CommStats,
                     keep: Optional[list[int]] = None) -> None:
        """u of the bucket's part at byte ``offset`` of the voted bytes applied to its
        parameters, or to ``entries[k] for k in keep`` only (no gradient on any rank)."""
        method, n = self.method, bucket.numel
        whole = keep is None or len(keep) == len(bucket.entries)
        if bucket.fused and whole:
            t0 = comm.clock(stats)
            part = voted[..., offset:offset + method.part_nbytes(n)]
            if method.apply_fused(bucket.params, self.momenta(bucket), self.grads(bucket), part, bucket.hyper()):
                stats.t_apply += comm.clock(stats) - t0  # u straight from the voted bytes
                return
        t0 = comm.clock(stats)
        u = method.decode(voted, offset, n, self.buffer("u8", n, torch.int8, bucket.device) if bucket.fused
                          else self.buffer("c", n, torch.float32, bucket.device))
        stats.t_unpack_vote += comm.clock(stats) - t0
        if not whole:
            pieces = u.split(bucket.sizes)
            bucket = bucket.only(keep)
            u = torch.cat([pieces[k] for k in keep]) if keep else u[:0]
        if not bucket.entries:
            return
        if bucket.fused:
            t0 = comm.clock(stats)
            fused.apply(bucket.params, self.momenta(bucket), self.grads(bucket), u, **bucket.hyper())
            stats.t_apply += comm.clock(stats) - t0
        else:
            self.apply_u(bucket, u, stats)

    # ------------------------------------------------------------------ the normal step
    def messages(self, buckets: list[Bucket]) -> list[list[int]]:
        """How the buckets travel without overlap: consecutive buckets (indices into
        ``buckets``) grouped into messages of at most ``message_mb`` MiB on the wire, at
        least one bucket each."""
        return chunks.runs([self.method.part_nbytes(b.numel) for b in buckets], self.message_mb * 2**20)

    def encodes_ahead(self, buckets: list[Bucket]) -> bool:
        """Every bucket's gradients read by a fused loop (which also checks them), and no
        random draws in the encode (a bucket may be encoded twice: see LionCub.step)."""
        return self.world_size > 1 and self.method.repeatable and all(b.fused for b in buckets)

    def step_messages(self, buckets: list[Bucket], stats: CommStats, step: int) -> None:
        """Vote and apply every bucket, several buckets per exchange."""
        if self.world_size == 1:  # no one to vote with: this is Lion
            for bucket in buckets:
                self.apply_u(bucket, self.bucket_c(bucket, stats, key="c").sign_(), stats)
            return
        if self.method.shared_momentum:  # a compressed mean, then Lion on it: its own message step
            for msg in self.messages(buckets):
                mean_message(self, [buckets[b] for b in msg], msg, buckets, stats, step)
            return
        self.exchange_messages(buckets, self.encode_messages(buckets, stats, step, ahead=0)[0], stats, step)

    def step_active(self, buckets: list[Bucket], active: list[bool], early, stats: CommStats, step: int,
                    grad_dtype: str) -> None:
        """The plain step after the agreement: the messages encoded ahead exchanged when every parameter
        has a gradient somewhere, else the buckets of the active ones encoded again (or ``vote='grad'``)."""
        if early is not None and all(active):
            return self.exchange_messages(buckets, early, stats, step)
        parts = [b if all(active[i] for i in b.index) else b.only([k for k, i in enumerate(b.index) if active[i]])
                 for b in buckets]
        parts = [b for b in parts if b.entries]
        if self.method is None:
            for bucket in parts:
                step_grad(self, bucket, grad_dtype, stats)
        else:
            self.step_messages(parts, stats, step)

    def encode_messages(self, buckets: list[Bucket], stats: CommStats, step: int, ahead: int
                        ) -> tuple[list[tuple[list[int], Optional[Tensor]]], Optional[bool]]:
        """This rank's bytes of the first ``ahead`` messages, each in its own kept buffer:
        ``[(bucket indices into buckets, buffer or None: not encoded yet)]`` for every message,
        and whether the gradients read were finite (None if one bucket went the torch path)."""
        encoded, finite = [], True
        for k, msg in enumerate(self.messages(buckets)):
            if k >= ahead:
                encoded.append((msg, None))
                continue
            buf, ok = self._encode_message(buckets, msg, ("msg", k), stats, step)
            finite = guard.all_finite(finite, ok)
            encoded.append((msg, buf))
        return encoded, finite

    def _encode_message(self, buckets: list[Bucket], msg: list[int], key, stats: CommStats,
                        step: int) -> tuple[Tensor, Optional[bool]]:
        """Message ``msg`` (indices into ``buckets``) into the kept buffer ``key``."""
        nbs = [self.method.part_nbytes(buckets[b].numel) for b in msg]
        m = sum(nbs)
        buf = self.buffer(key, self.method.message_nbytes(m), torch.uint8, buckets[msg[0]].device)
        buf[m:].zero_()
        offset, finite = 0, True
        for b, nb in zip(msg, nbs):
            ok = self.encode_bucket(buckets[b], buf[offset:offset + nb], step, stats)
            finite = guard.all_finite(finite, ok)
            offset += nb
        return buf, finite

    def exchange_messages(self, buckets: list[Bucket], encoded: list[tuple[list[int], Optional[Tensor]]],
                          stats: CommStats, step: int) -> None:
        """One exchange per message (encoded now when it was not ahead), then each of its
        buckets applied."""
        method = self.method
        for msg, buf in encoded:
            if buf is None:
                buf = self._encode_message(buckets, msg, "msg", stats, step)[0]
            m = sum(method.part_nbytes(buckets[b].numel) for b in msg)
            server = (dict(residual=self.owners.get(method, buckets, msg, m, buf.device)) if method.owner_state
                      else {})
            voted = method.exchange(buf, m, step, self.group, stats, **server)
            offset = 0
            for b in msg:
                self.apply_bucket(buckets[b], voted, offset, stats)
                offset += method.part_nbytes(buckets[b].numel)

    # ------------------------------------------------------------------ torch ops, one worker
    def bucket_c(self, bucket: Bucket, stats: CommStats, key) -> Tensor:
        """Flat fp32 ``c = β1·m + (1-β1)·g`` of a bucket's params (missing grads as zeros),
        written into the scratch buffer ``key`` (valid until that key is used again)."""
        return self._c_checked(bucket, stats, key, "t_apply")[0]

    def _c_checked(self, bucket: Bucket, stats: CommStats, key, account: str) -> tuple[Tensor, Optional[bool]]:
        """:meth:`bucket_c`, and whether the gradients read are all finite (None when the
        torch ops computed ``c``); the time goes to ``stats.<account>``."""
        grads, exp_avgs = self.grads(bucket), self.momenta(bucket)
        t0 = comm.clock(stats)
        flat = self.buffer(key, bucket.numel, torch.float32, bucket.device)
        finite = None
        if bucket.fused:  # one pass, the same values
            finite = fused.interpolate(exp_avgs, grads, bucket.beta1(), bucket.maximize(), flat)
        else:
            views = flat.split(bucket.sizes)
            for g, ks in bucket.runs:
                interpolate([exp_avgs[k] for k in ks], [grads[k] for k in ks], g["betas"][0],
                            maximize=g["maximize"], out=[views[k] for k in ks])
        setattr(stats, account, getattr(stats, account) + comm.clock(stats) - t0)
        return flat, finite

    def apply_u(self, bucket: Bucket, u: Tensor, stats: CommStats) -> None:
        """θ ← θ(1-ηλ) - η·u and m ← β2·m + (1-β2)·g for a bucket, from its flat vote ``u``
        (torch ops)."""
        params, grads, exp_avgs = bucket.params, self.grads(bucket), self.momenta(bucket)
        t0 = comm.clock(stats)
        us = [piece.view_as(p).to(p.dtype) for piece, p in zip(u.split(bucket.sizes), params)]
        for g, ks in bucket.runs:
            apply_update_([params[k] for k in ks], [us[k] for k in ks], [exp_avgs[k] for k in ks],
                          [grads[k] for k in ks], lr=g["lr"], beta2=g["betas"][1],
                          weight_decay=g["weight_decay"], maximize=g["maximize"], foreach=True)
        stats.t_apply += comm.clock(stats) - t0


def step_grad(run: BucketStep, bucket: Bucket, grad_dtype: str, stats: CommStats) -> None:
    """Baseline: average gradients in ``grad_dtype`` with one all-reduce, then plain Lion."""
    params, grads, exp_avgs = bucket.params, run.grads(bucket), run.momenta(bucket)
    if run.world_size > 1:
        t0 = comm.clock(stats)
        flat = run.buffer("grad", bucket.numel, GRAD_DTYPES[grad_dtype], bucket.device)
        for piece, g in zip(flat.split(bucket.sizes), grads):
            piece.view(g.shape).copy_(g)  # one pass, casting to the wire dtype
        stats.t_quantize_pack += comm.clock(stats) - t0
        comm.all_reduce(flat, run.group, stats)
        t0 = comm.clock(stats)
        flat.div_(run.world_size)
        grads = [piece.view_as(p).to(p.dtype) for piece, p in zip(flat.split(bucket.sizes), params)]
        stats.t_unpack_vote += comm.clock(stats) - t0
    t0 = comm.clock(stats)
    if bucket.fused:  # the same Lion, two fused passes (as the votes get)
        u = run.buffer("u8", bucket.numel, torch.int8, bucket.device)
        fused.encode(exp_avgs, grads, bucket.beta1(), bucket.maximize(), u.view(torch.uint8), bits=8, step=0,
                     signs=True)  # u = sign(c)
        fused.apply(params, exp_avgs, grads, u, **bucket.hyper())
    else:
        for g, ks in bucket.runs:
            lion([params[k] for k in ks], [grads[k] for k in ks], [exp_avgs[k] for k in ks],
                 lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1],
                 weight_decay=g["weight_decay"], maximize=g["maximize"], foreach=True)
    stats.t_apply += comm.clock(stats) - t0
