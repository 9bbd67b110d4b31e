r"""The two-phase compressed mean's exchange, written once: both the every-step 1-bit mean
(:class:`~lioncub.votes.mean.OneBitMean`) and a round's scatter mean (:class:`~lioncub.votes.rounds.ScatterMean`)
run :class:`TwoPhase`, each with its own :class:`Codec` (how a slice is coded and averaged).

A message of ``P·E`` elements (the tensors ``(start, numel)`` in message elements, the padding in no tensor)
is cut into ``P`` spans of ``E`` elements; rank ``j`` owns span ``j``. Every rank has coded its message
in ``b`` bits an element (``C = E·b/8`` bytes a span) with, optionally, one fp32 scale per tensor::

      phase 1, all_to_all: row j of every rank (span j's codes, then its T scales if any) → rank j
    x = owner_sum(the P rows) + r           on span j's owner, the codec's mean of its span; r its residual
    β_t = scales(x)                         one per tensor with a piece in the span (0 for the others)
    w = levels(x, β)                        the owner's levels, and their codes
    r ← x − β_t·h·w                         (h: the codec's shared magnitudes, 1 without)
      phase 2, all_gather: every owner's codes of w, then its T scales β
    d = β_t·h·w                             decoded the same on every rank (:meth:`TwoPhase.decode`)

Adding a two-phase code is writing a :class:`Codec` (its owner sum, its scale rule, its levels and their codes):
the collectives, the spans, the packing of codes and scales into one message, the owner's residual and the
decode are this module's. The exchange's stages are an :class:`Agreement`: launched asynchronously (a round may
keep them in flight), or waited at once (:meth:`Agreement.result`: the every-step mean).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .. import comm
from ..comm import CommStats

__all__ = ["Agreement", "Codec", "TwoPhase", "pieces"]


class Agreement:
    """A round's agreement: its collective in flight (or none: one rank, an empty vote, an exchange
    already complete) and ``read``, which turns the collective's result into the round's ``d``, or into the
    next stage of an exchange of several collectives: another :class:`Agreement`, its collective launched
    (the two-phase mean's all-gather after its all-to-all). :meth:`result` waits for every stage (once) and
    returns ``(d, signed)``; after it only ``d`` is kept. :meth:`advance` takes the stages whose collectives
    are already complete, without waiting; :meth:`launch` takes them, waiting, until the last is in flight (``last``:
    whether this stage is the exchange's last)."""

    def __init__(self, pending: Optional[comm.Pending], read: Callable[[Optional[Tensor]], object], signed: bool,
                 last: bool = True):
        self.pending, self.read, self.signed, self.d, self.last = pending, read, signed, None, last

    @classmethod
    def finished(cls, d: Tensor, signed: bool) -> "Agreement":
        """An agreement whose ``d`` is already known (one rank, or restored from a checkpoint)."""
        done = cls(None, None, signed)
        done.d = d
        return done

    def _take(self, stats: Optional[CommStats]) -> None:
        """The next stage: wait for the collective in flight and read it. A read that returns a callable hands it
        ``stats`` to launch the next stage: its bytes count in the step that launches it."""
        out = self.read(None if self.pending is None else self.pending.wait(stats))
        if callable(out):
            out = out(stats)
        if isinstance(out, Agreement):  # the next stage, its collective launched
            self.pending, self.read, self.last = out.pending, out.read, out.last
        else:
            self.d, self.pending, self.read = out, None, None

    def advance(self, stats: Optional[CommStats] = None) -> bool:
        """Take every stage whose collective is complete (:meth:`comm.Pending.ready`: no wait); whether ``d``
        is known. Called between a streaming round's steps (``stats``: that step's), so that a later stage's
        collective is launched while compute goes on."""
        while self.d is None and (self.pending is None or self.pending.ready()):
            self._take(stats)
        return self.d is not None

    def launch(self, stats: Optional[CommStats] = None) -> None:
        """Take every stage before the last, waiting: the last one's collective is then in flight on every rank,
        whatever :meth:`advance` took on each (the collectives a caller issues next come after it everywhere)."""
        while self.d is None and not self.last:
            self._take(stats)

    def result(self, stats: Optional[CommStats] = None) -> tuple[Tensor, bool]:
        while self.d is None:
            self._take(stats)
        return self.d, self.signed


def pieces(tensors: list[tuple[int, int]], span: int) -> list[tuple[int, int, int, int]]:
    """Each tensor's elements cut at the span boundaries: ``(tensor, owner, lo, hi)`` for the
    message elements ``[lo, hi)`` of tensor ``tensor`` (``tensors[k] = (start, numel)`` in message
    elements) that lie in owner ``owner``'s span (elements ``[owner·span, (owner+1)·span)``)."""
    out = []
    for t, (start, n) in enumerate(tensors):
        lo, end = start, start + n
        while lo < end:
            j = lo // span
            hi = min(end, (j + 1) * span)
            out.append((t, j, lo, hi))
            lo = hi
    return out


class Codec:
    """How the slices of one two-phase exchange are coded and averaged (module docstring); a subclass per
    code. ``bits``: the code width; ``shape``: the flat magnitudes ``h`` every rank shares over the message's
    elements, or None (1). ``mine``: the owner's pieces ``(tensor, lo, hi)`` relative to its span."""

    bits: int = 1
    shape: Optional[Tensor] = None

    def owner_sum(self, codes: Tensor, scales: Optional[Tensor], mine: list, h: Optional[Tensor]) -> Tensor:
        """The owner's mean of its span (fp32, ``E`` elements, 0 in the padding) from the ``(P, C)`` codes
        the ranks sent it and their ``(P, T)`` scales (None when they sent none); ``h``: the span's shape."""
        raise NotImplementedError

    def scales(self, x: Tensor, mine: list, count: int, h: Optional[Tensor]) -> Tensor:
        """The owner's fp32 scale of each of ``count`` tensors for its values ``x`` (0 for a tensor without a
        piece in the span)."""
        raise NotImplementedError

    def levels(self, x: Tensor, scales: Tensor, mine: list) -> tuple[Tensor, Tensor]:
        """The owner's levels ``w`` of ``x`` (fp32; read on its pieces only) and their ``C`` bytes of codes."""
        raise NotImplementedError

    def unpack(self, packed: Tensor, n: int, out: Tensor) -> Tensor:
        """The first ``n`` levels of ``packed`` codes as fp32 into ``out``."""
        raise NotImplementedError


class TwoPhase:
    """The exchange of one message (module docstring): ``codec`` over ``world`` spans of ``span`` elements
    holding ``tensors`` (``(start, numel)`` in message elements)."""

    def __init__(self, codec: Codec, world: int, span: int, tensors: list[tuple[int, int]]):
        self.codec, self.world, self.span, self.tensors = codec, world, span, tensors
        self.nbytes = span * codec.bits // 8  # C: the bytes of one span's codes

    def launch(self, codes: Tensor, scales: Optional[Tensor], residual: Tensor, me: int, group, stats: CommStats,
               read: Callable[[Tensor], object], *, alone: bool = False,
               timed: Optional[CommStats] = None) -> Agreement:
        """Launch phase 1 of this rank's ``codes`` (``P·C`` bytes) and, when not None, its fp32 ``scales`` (one
        per tensor, sent with every span); the owner's stage (``residual``: its fp32 residual of span ``me``,
        updated, on the device or the host) launches phase 2, whose ``(P, C + 4T)`` bytes ``read`` turns into
        the agreement's result. ``alone``: one rank without a process group, no collective. ``timed``: the
        stats whose times the packing and the owner's stage count in (None: not timed)."""
        P, C, E = self.world, self.nbytes, self.span
        t0 = comm.clock(timed)
        if scales is None:
            send = codes[:P * C]
        else:
            T = scales.numel()
            send = torch.empty((P, C + 4 * T), dtype=torch.uint8, device=codes.device)
            send[:, :C].copy_(codes[:P * C].view(P, C))
            send[:, C:].copy_(scales.contiguous().view(torch.uint8).expand(P, 4 * T))
            send = send.view(-1)
        if timed is not None:
            timed.t_quantize_pack += comm.clock(timed) - t0
        mine = [(t, lo - me * E, hi - me * E) for t, j, lo, hi in pieces(self.tensors, E) if j == me]

        def owner(got: Tensor):
            reply = self._owner(got.view(P, -1), scales is not None, residual, mine, me, timed)
            if alone:
                return Agreement(None, lambda _: read(reply.view(1, -1)), False)
            return lambda now: Agreement(comm.all_gather_async(reply, group, now), read, False)

        if alone:
            return Agreement(None, lambda _: owner(send), False, last=False)
        return Agreement(comm.all_to_all_async(send, group, stats), owner, False, last=False)

    def _owner(self, got: Tensor, scaled: bool, residual: Tensor, mine: list, me: int,
               timed: Optional[CommStats]) -> Tensor:
        """Span ``me``'s owner: the codec's mean of the ``(P, C [+ 4T])`` rows it got, plus its residual; its own
        scales and levels; the residual of what they leave; the reply (codes, then T fp32 scales)."""
        codec, C, E, T = self.codec, self.nbytes, self.span, len(self.tensors)
        t0 = comm.clock(timed)
        h = None if codec.shape is None else codec.shape[me * E:(me + 1) * E]
        theirs = _floats(got[:, C:]) if scaled else None  # (P, T)
        x = codec.owner_sum(got[:, :C], theirs, mine, h)
        x.add_(residual.to(x.device, non_blocking=True))  # (LocalCub may keep it on the host)
        betas = codec.scales(x, mine, T, h)
        w, packed = codec.levels(x, betas, mine)
        sent = torch.zeros(E, dtype=torch.float32, device=x.device)  # β·h·w; padding 0
        for t, lo, hi in mine:
            wt = w[lo:hi] if h is None else w[lo:hi].mul(h[lo:hi])
            torch.mul(wt, betas[t], out=sent[lo:hi])
        residual.copy_(x.sub_(sent), non_blocking=True)  # r ← x − β·h·w (0 beyond the message's end)
        reply = torch.empty(C + 4 * T, dtype=torch.uint8, device=x.device)
        reply[:C].copy_(packed)
        reply[C:].copy_(betas.view(torch.uint8))
        if timed is not None:
            timed.t_unpack_vote += comm.clock(timed) - t0
        return reply

    def split(self, gathered: Tensor) -> tuple[Tensor, Tensor]:
        """The gathered ``(P, C + 4T)`` bytes as the owners' codes, one flat message, and their ``(P, T)`` scales."""
        C = self.nbytes
        return gathered[:, :C].reshape(-1), _floats(gathered[:, C:])

    def decode(self, got: tuple[Tensor, Tensor], base: int, n: int, out: Tensor) -> Tensor:
        """``β·h·w`` of the message elements ``[base, base + n)`` (whole tensors, ``base`` on a byte of codes) into
        the flat fp32 ``out``, from :meth:`split`'s ``got``: the same on every rank."""
        codes, betas = got
        bits = self.codec.bits
        self.codec.unpack(codes[base * bits // 8:-(-(base + n) * bits // 8)], n, out)
        if self.codec.shape is not None:
            out.mul_(self.codec.shape[base:base + n])
        for t, j, lo, hi in pieces(self.tensors, self.span):
            if base <= lo and hi <= base + n:
                out[lo - base:hi - base].mul_(betas[j, t])
        return out


def _floats(rows: Tensor) -> Tensor:
    """``(P, 4T)`` bytes (a slice of rows of a message) as a fresh ``(P, T)`` fp32 tensor."""
    return torch.empty(rows.shape, dtype=torch.uint8, device=rows.device).copy_(rows).view(torch.float32)
