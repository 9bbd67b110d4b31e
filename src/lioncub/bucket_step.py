"""How one :class:`~lioncub.LionCub` step votes and applies its buckets (the per-bucket
machinery, kept apart from the optimizer's set-up, checks and state).

* voted methods: :meth:`BucketStep._step_messages` groups the buckets into messages of at
  most ``message_mb`` on the wire; per bucket :meth:`~BucketStep._encode_part` writes this
  rank's part (the fused loop of :mod:`lioncub.fused`, or ``c`` + :class:`~lioncub.vote.VoteCodec`),
  one exchange per message, then :meth:`~BucketStep._decode_apply` updates ``p`` and ``m``.
  When fused loops read every part's gradients (fp32 on CPU; no quantizer or a rounding
  one, ``l1``/``l0``/``lp``), LionCub encodes the first ``encode_ahead``
  messages (each in its own kept buffer) before it agrees on has-grad / finite, and only
  then exchanges: the loop checks the gradients it reads, saving a separate read. Further
  messages (big models) are checked by :func:`lioncub.guard.grads_finite` and encoded
  just before their exchange, into one shared buffer, so the kept bytes stay bounded;
* ``vote='grad'``: :meth:`~BucketStep._step_grad`, the gradient all-reduce baseline;
* :meth:`~BucketStep._bucket_c`, :meth:`~BucketStep._apply_bucket`: the torch path's ``c`` and
  update (one worker; buckets off the fused path); :meth:`~BucketStep._vote_flat`, a bucket's
  vote by :func:`~lioncub.vote.majority_vote`, which the step no longer calls: only
  ``bench/overlap.py`` times it.

The step's three functions — :meth:`~BucketStep._encode_part`, :meth:`VoteCodec.exchange
<lioncub.vote.VoteCodec.exchange>` and :meth:`~BucketStep._decode_apply` — are also what
:mod:`lioncub.overlap` and :mod:`lioncub.ddp_hook` call, so all three paths give the same bits.

The mixin uses the optimizer's ``_params``, ``_grads``, ``_init_state``, ``_by_group`` and
its attributes (``vote``, ``bits``, ``quantizer``, ``world_size``, ``group``, ``steps``, ...).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import Tensor

from . import comm, fused
from .comm import CommStats
from .lion import apply_update_, interpolate, lion
from .quantize import ROUNDED
from .vote import VoteCodec, majority_vote

__all__ = ["BucketStep", "GRAD_DTYPES"]

GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class BucketStep:
    """Mixin of :class:`~lioncub.LionCub`: one step's buckets, voted (or all-reduced) and applied."""

    encode_ahead = 4
    """Messages encoded before the has-grad / finite agreement (at most this many times
    ``message_mb`` of kept buffers; 1-bit votes of a 800M-parameter model are 4 messages)."""

    def _buffer(self, key, n: int, dtype: torch.dtype, device) -> Tensor:
        """A flat tensor of ``n`` elements under ``key``, kept between steps.

        Buckets are tens of MB: a fresh allocation per step costs page faults that took
        longer than the arithmetic on CPU. Kept: one fp32 bucket (``c``, or ``u`` off the
        fused path), one int8 bucket (``u`` on it), and the message bytes (per launched
        bucket with overlap / the DDP hook, where several are in flight at once)."""
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = self._scratch[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]

    def _step_bucket(self, entries: list[tuple[dict, Tensor]], stats: CommStats) -> None:
        params = [p for _, p in entries]
        self._step_grad(params, self._grads(params), [self._init_state(p) for p in params],
                        self._by_group(entries), stats)

    def _codec(self) -> VoteCodec:
        return VoteCodec(self.vote, self.world_size, self.bits, self.quantizer, self.tie)

    def messages(self, parts: Optional[list[list[int]]] = None) -> list[list[int]]:
        """How the buckets travel without overlap: consecutive buckets (indices into
        ``_buckets``, or into ``parts`` when given: lists of parameter indices) grouped
        into messages of at most ``message_mb`` MiB on the wire, at least one bucket each."""
        params = self._params()
        sizes = [sum(params[i][1].numel() for i in idx) for idx in (self._buckets if parts is None else parts)]
        codec, cap = self._codec(), self.message_mb * 2**20
        out: list[list[int]] = []
        total = 0
        for b, n in enumerate(sizes):
            nb = codec.part_nbytes(n)
            if out and total + nb <= cap:
                out[-1].append(b)
                total += nb
            else:
                out.append([b])
                total = nb
        return out

    def message_elements(self) -> list[int]:
        """Per message (all parameters active), the element count whose single vote moves
        the same bytes: what :func:`lioncub.cost.predicted_bytes` takes."""
        params, codec = self._params(), self._codec()
        nbytes = [sum(codec.part_nbytes(sum(params[i][1].numel() for i in self._buckets[b])) for b in msg)
                  for msg in self.messages()]
        return [codec.elements(m) for m in nbytes]

    def _step_messages(self, parts: list[list[tuple[dict, Tensor]]], stats: CommStats) -> None:
        """Vote and apply every part (bucket), several buckets per exchange."""
        if self.world_size == 1:  # no one to vote with: this is Lion
            for part in parts:
                self._apply_bucket(part, self._bucket_c(part, stats, key="c").sign_(), stats)
            return
        self._exchange_messages(parts, self._encode_messages(parts, stats, ahead=0)[0], stats)

    def _encodes_fused(self, parts: list[list[tuple[dict, Tensor]]]) -> bool:
        """Every part's gradients read by a fused loop (which also checks them), and no
        random draws in the encode (a part may be encoded twice: see LionCub.step)."""
        return (self.world_size > 1 and (self.quantizer is None or self.quantizer in ROUNDED)
                and all(self._fusable(part) for part in parts))

    def _encode_messages(self, parts: list[list[tuple[dict, Tensor]]], stats: CommStats, ahead: int
                         ) -> tuple[list[tuple[list[int], Optional[Tensor]]], Optional[bool]]:
        """This rank's bytes of the first ``ahead`` messages, each in its own kept buffer:
        ``[(bucket indices into parts, buffer or None: not encoded yet)]`` for every message,
        and whether the gradients read were finite (None if one part went the torch path)."""
        codec = self._codec()
        params = self._params()
        index = {id(p): i for i, (_, p) in enumerate(params)}
        encoded, finite = [], True
        for k, msg in enumerate(self.messages([[index[id(p)] for _, p in part] for part in parts])):
            if k >= ahead:
                encoded.append((msg, None))
                continue
            buf, ok = self._encode_message(parts, msg, codec, ("msg", k), stats)
            finite = None if ok is None or finite is None else finite and ok
            encoded.append((msg, buf))
        return encoded, finite

    def _encode_message(self, parts, msg: list[int], codec: VoteCodec, key,
                        stats: CommStats) -> tuple[Tensor, Optional[bool]]:
        """Message ``msg`` (bucket indices into ``parts``) into the kept buffer ``key``."""
        nbs = [codec.part_nbytes(sum(p.numel() for _, p in parts[b])) for b in msg]
        m = sum(nbs)
        buf = self._buffer(key, codec.message_nbytes(m), torch.uint8, parts[msg[0]][0][1].device)
        buf[m:].zero_()
        offset, finite = 0, True
        for b, nb in zip(msg, nbs):
            ok = self._encode_part(parts[b], codec, buf[offset:offset + nb], self.steps, stats)
            finite = None if ok is None or finite is None else finite and ok
            offset += nb
        return buf, finite

    def _exchange_messages(self, parts, encoded: list[tuple[list[int], Optional[Tensor]]],
                           stats: CommStats) -> None:
        """One exchange per message (encoded now when it was not ahead), then each of its
        parts decoded and applied."""
        codec = self._codec()
        for msg, buf in encoded:
            if buf is None:
                buf = self._encode_message(parts, msg, codec, "msg", stats)[0]
            sizes = [sum(p.numel() for _, p in parts[b]) for b in msg]
            voted = codec.exchange(buf, sum(codec.part_nbytes(n) for n in sizes), self.steps, self.group, stats)
            offset = 0
            for b, n in zip(msg, sizes):
                self._decode_apply(parts[b], codec, voted, offset, n, stats)
                offset += codec.part_nbytes(n)

    def _fusable(self, entries) -> bool:
        """All fp32, contiguous, on CPU: the fused loops of :mod:`lioncub.fused` apply."""
        params = [p for _, p in entries]
        return fused.usable(params, [self._init_state(p) for p in params],
                            [p.grad for p in params if p.grad is not None])

    def _encode_part(self, entries, codec: VoteCodec, dst: Tensor, step: int, stats: CommStats,
                     key="c") -> Optional[bool]:
        """This rank's part of a message for ``entries`` (one bucket) into ``dst``. Returns
        whether the bucket's gradients are all finite when a fused loop read them (it reads
        them anyway), None when the torch ops did."""
        if codec.quantizer is None and self._fusable(entries):  # c never stored: one pass
            t0 = time.perf_counter()
            params = [p for _, p in entries]
            finite = fused.encode([self._init_state(p) for p in params], self._grads(params),
                         [g["betas"][0] for g, _ in entries], [g["maximize"] for g, _ in entries], dst,
                         bits=codec.bits, step=codec.parity(step), signs=codec.method == "sign_allreduce")
            stats.t_quantize_pack += time.perf_counter() - t0
            return finite
        c, finite = self._c_checked(entries, stats, key, "t_quantize_pack")  # quantizers: c first
        t0 = time.perf_counter()
        fast_q = finite is not None and codec.quantizer in ROUNDED  # fp32 c: the codec's fused lanes
        work = self._buffer("abs", c.numel(), torch.float32, c.device) if fast_q else None
        codec.encode(c, dst, step, self.generator, work=work)
        stats.t_quantize_pack += time.perf_counter() - t0
        return finite

    @staticmethod
    def _hyper(entries) -> dict:
        """Per-parameter update hyper-parameters for :func:`lioncub.fused.apply`."""
        return dict(lr=[g["lr"] for g, _ in entries], beta2=[g["betas"][1] for g, _ in entries],
                    weight_decay=[g["weight_decay"] for g, _ in entries], maximize=[g["maximize"] for g, _ in entries])

    def _decode_apply(self, entries, codec: VoteCodec, voted, offset: int, n: int, stats: CommStats,
                      keep: Optional[list[int]] = None) -> None:
        """u of the part at ``offset`` (``n`` elements) applied to ``entries``, or to
        ``entries[k] for k in keep`` only (params without a gradient on any rank)."""
        device = entries[0][1].device
        fast = self._fusable(entries)
        whole = keep is None or len(keep) == len(entries)
        if fast and whole and codec.method in ("onebit", "gather", "pbit"):  # u straight from the vote
            t0 = time.perf_counter()
            nb = codec.part_nbytes(n)
            params = [p for _, p in entries]
            state = (params, [self._init_state(p) for p in params], self._grads(params))
            if codec.method == "pbit":
                fused.apply_lanes(*state, voted[offset:offset + nb], codec.bits, *codec.thresholds(),
                                  **self._hyper(entries))
            else:
                pos, neg = (voted, None) if codec.method == "onebit" else voted
                fused.apply_bits(*state, pos[offset:offset + nb], None if neg is None else neg[offset:offset + nb],
                                 **self._hyper(entries))
            stats.t_apply += time.perf_counter() - t0
            return
        t0 = time.perf_counter()
        u = codec.decode(voted, offset, n, self._buffer("u8", n, torch.int8, device) if fast
                         else self._buffer("c", n, torch.float32, device))
        stats.t_unpack_vote += time.perf_counter() - t0
        if keep is not None and len(keep) < len(entries):
            pieces = u.split([p.numel() for _, p in entries])
            entries = [entries[k] for k in keep]
            u = torch.cat([pieces[k] for k in keep]) if keep else u[:0]
        if not entries:
            return
        if fast:
            t0 = time.perf_counter()
            params = [p for _, p in entries]
            fused.apply(params, [self._init_state(p) for p in params], self._grads(params), u,
                        **self._hyper(entries))
            stats.t_apply += time.perf_counter() - t0
        else:
            self._apply_bucket(entries, u, stats)

    # The torch path's c and update of a bucket (also the one-worker step).
    def _bucket_c(self, entries: list[tuple[dict, Tensor]], stats: CommStats, key) -> Tensor:
        """Flat fp32 ``c = β1·m + (1-β1)·g`` of a bucket's params (missing grads as zeros),
        written into the scratch buffer ``key`` (valid until that key is used again)."""
        return self._c_checked(entries, stats, key, "t_apply")[0]

    def _c_checked(self, entries, stats: CommStats, key, account: str) -> tuple[Tensor, Optional[bool]]:
        """:meth:`_bucket_c`, and whether the gradients read are all finite (None when the
        torch ops computed ``c``); the time goes to ``stats.<account>``."""
        params = [p for _, p in entries]
        grads = self._grads(params)
        exp_avgs = [self._init_state(p) for p in params]
        t0 = time.perf_counter()
        sizes = [p.numel() for p in params]
        flat = self._buffer(key, sum(sizes), torch.float32, params[0].device if params else None)
        finite = None
        if params and self._fusable(entries):  # one pass, the same values
            finite = fused.interpolate(exp_avgs, grads, [g["betas"][0] for g, _ in entries],
                                       [g["maximize"] for g, _ in entries], flat)
        else:
            views = flat.split(sizes)
            for g, ks in self._by_group(entries):
                interpolate([exp_avgs[k] for k in ks], [grads[k] for k in ks], g["betas"][0],
                            maximize=g["maximize"], out=[views[k] for k in ks])
        setattr(stats, account, getattr(stats, account) + time.perf_counter() - t0)
        return flat, finite

    def _vote_flat(self, flat: Tensor, step: int, stats: CommStats, group=None) -> Tensor:
        """u = sign(Σ_i q(c_i)) for one bucket, written over ``flat`` (collective; sign(c)
        alone on one rank), by :func:`~lioncub.vote.majority_vote` with this optimizer's
        vote and tie rule. Not on the step's path (see the module docstring): it is the
        vote alone that ``bench/overlap.py`` times. ``group``: the same ranks on another
        process group."""
        if self.world_size == 1:  # no one to vote with: this is Lion
            return flat.sign_()
        return majority_vote(flat, method=self.vote, bits=self.bits, quantizer=self.quantizer, step=step,
                             tie=self.tie, group=self.group if group is None else group, stats=stats,
                             generator=self.generator, out=flat)

    def _apply_bucket(self, entries: list[tuple[dict, Tensor]], u: Tensor, stats: CommStats) -> None:
        """θ ← θ(1-ηλ) - η·u and m ← β2·m + (1-β2)·g for a bucket, from its flat vote ``u``."""
        params = [p for _, p in entries]
        grads = self._grads(params)
        exp_avgs = [self._init_state(p) for p in params]
        t0 = time.perf_counter()
        us = [piece.view_as(p).to(p.dtype) for piece, p in zip(u.split([p.numel() for p in params]), params)]
        for g, ks in self._by_group(entries):
            apply_update_([params[k] for k in ks], [us[k] for k in ks], [exp_avgs[k] for k in ks],
                          [grads[k] for k in ks], lr=g["lr"], beta2=g["betas"][1],
                          weight_decay=g["weight_decay"], maximize=g["maximize"], foreach=True)
        stats.t_apply += time.perf_counter() - t0

    def _step_grad(self, params, grads, exp_avgs, runs, stats: CommStats) -> None:
        """Baseline: average gradients in ``grad_dtype`` with one all-reduce, then plain Lion."""
        if self.world_size > 1:
            t0 = time.perf_counter()
            sizes = [g.numel() for g in grads]
            flat = self._buffer("grad", sum(sizes), GRAD_DTYPES[self.grad_dtype], grads[0].device)
            for piece, g in zip(flat.split(sizes), grads):
                piece.view(g.shape).copy_(g)  # one pass, casting to the wire dtype
            stats.t_quantize_pack += time.perf_counter() - t0
            comm.all_reduce(flat, self.group, stats)
            t0 = time.perf_counter()
            flat.div_(self.world_size)
            grads = [piece.view_as(p).to(p.dtype) for piece, p in zip(flat.split([p.numel() for p in params]), params)]
            stats.t_unpack_vote += time.perf_counter() - t0
        t0 = time.perf_counter()
        if fused.usable(params, exp_avgs, grads):  # the same Lion, two fused passes (as the votes get)
            hp = [None] * len(params)
            for g, ks in runs:
                for k in ks:
                    hp[k] = g
            u = self._buffer("u8", sum(p.numel() for p in params), torch.int8, params[0].device)
            fused.encode(exp_avgs, grads, [g["betas"][0] for g in hp], [g["maximize"] for g in hp],
                         u.view(torch.uint8), bits=8, step=0, signs=True)  # u = sign(c)
            fused.apply(params, exp_avgs, grads, u, lr=[g["lr"] for g in hp], beta2=[g["betas"][1] for g in hp],
                        weight_decay=[g["weight_decay"] for g in hp], maximize=[g["maximize"] for g in hp])
        else:
            for g, ks in runs:
                lion([params[k] for k in ks], [grads[k] for k in ks], [exp_avgs[k] for k in ks],
                     lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1],
                     weight_decay=g["weight_decay"], maximize=g["maximize"], foreach=True)
        stats.t_apply += time.perf_counter() - t0
