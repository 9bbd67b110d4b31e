"""Streaming rounds (``delay=1``) of :class:`~lioncub.optim.localcub.LocalCub`, as a mixin.

The end of a streaming round k is the one round end every round runs (:func:`lioncub.optim.round_end.end_round`),
with Δ measured since o_i and its exchanges here (:meth:`StreamingRounds._stream_chunks`): per chunk of the model,
wait for round k−1's agreement and take its outer step on θ_s, rebase this worker onto it (θ_i ← θ_s − Δ_i^k,
o_i ← θ_i), and launch round k's agreement asynchronously (:mod:`.rounds`, :mod:`lioncub.votes.rounds`), left in
flight for a round. With ``fragments=F`` the same steps happen to one fragment of the model every H/F steps, each in
flight for H/F steps, spread over the inner steps (:meth:`StreamingRounds._fragment_round`, ``_send_late``,
``_receive_pending``). The rule and why it is this one: docs/local_steps.md. The mixin uses what LocalCub defines:
``params``, ``state`` (``start`` = θ_s, ``origin`` = o_i), ``world_size``, ``stream_group``, ``fragments``,
``rounds``, ``_pending`` (the chunks' agreements in flight) and ``_pending_fragment``, and the round's steps of
:class:`~lioncub.optim.rounds.Rounds`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional

from .. import comm
from ..chunks import Piece
from ..comm import CommStats
from ..engine import guard
from ..validate import check_int
from ..votes import STREAMING_VOTES
from ..votes.rounds import Agreement
from .round_end import applied
from .rounds import _slot

__all__ = ["StreamingRounds", "check_fragments"]


def check_fragments(fragments, delay: int, auto: bool, H: int) -> int:
    """``fragments``, refused where it cannot stagger: without ``delay=1``, with ``local_steps='auto'`` (``auto``),
    or when it does not divide ``H``."""
    fragments = check_int("fragments", fragments, 1, None, what="parts of the model streamed in turn")
    if fragments == 1:
        return 1
    if not delay:
        raise ValueError(f"fragments={fragments} staggers streaming rounds: it needs delay=1")
    if auto:
        raise ValueError(f"fragments={fragments} needs a fixed local_steps (a round's fragments end every H/F "
                         "steps), got local_steps='auto'")
    if H % fragments:
        raise ValueError(f"fragments must divide local_steps={H} (a fragment's round ends every H/F steps), "
                         f"got {fragments}")
    return fragments


class LateFragment(NamedTuple):
    """A fragment's round between its end and its exchange's launch (:meth:`StreamingRounds._send_late`): ``verdict``
    (its finite check and head in flight), the fragment, each tensor's mean |v| and each chunk's v where the end kept
    it (``eager``; or a fragment of one chunk, whose v its measure made); empty: :meth:`_send_late` makes v."""

    verdict: guard.Agreeing
    fragment: int
    scales: Optional[Tensor]
    kept: list[Tensor]


class StreamingRounds:
    """The ``delay=1`` half of LocalCub's round: a streaming round's exchanges (:meth:`_stream_chunks`), the fragments'
    round ends, :meth:`flush`, :meth:`agreed` and their helpers."""

    def _open_streaming(self, fragments: int, vote: str, quantizer, eager) -> None:
        """Set-up: the fragments (:func:`check_fragments`), ``eager`` and the refusals of what cannot stream; the
        process group the agreements run on (:func:`lioncub.comm.own_group`; with ``delay=1``); nothing in flight."""
        self.fragments = check_fragments(fragments, self.delay, self.steps_pick is not None, self.H)
        self.eager = eager  # (checked by Streaming and optim.localcub.round_settings: a bool, streamed, on a mean)
        if self.delay and not self.exchange.streams:
            raise ValueError(f"delay=1 keeps the round's exchange in flight: vote must be 'grad', one of "
                             f"{STREAMING_VOTES}, or 'onebit' with aggregate='mean', got vote={vote!r}")
        if self.fragments > 1 and not self.exchange.per_tensor:
            raise ValueError(f"fragments={self.fragments} needs an aggregation that decides each tensor alone: "
                             f"vote={vote!r} with quantizer={quantizer!r} scales the whole model at once")
        if self.fragments > 1:
            self._plan()  # refuses more fragments than the parameters can be cut into
        self.stream_group = comm.own_group(self.group, self.device) if self.delay and self.world_size > 1 else None
        self._pending: Optional[list[Agreement]] = None  # the agreements in flight (one per chunk)
        self._pending_fragment = 0  # the fragment they are of (0 with one fragment)
        self._agreeing: Optional[LateFragment] = None  # a fragment's finite check and head in flight (:meth:`_send_late`)
        self._unreported: Optional[CommStats] = None  # what a checkpoint sent, added to the next step's record

    def _round_ends(self) -> None:
        """After an inner step: a later stage of an exchange in flight launched once its first is done; the end of
        a fragment's round (every H/F steps) or of a round (every H)."""
        ending = self._fragment_ending()
        if self._agreeing is not None and ending is None and self._agreeing.verdict.ready():
            with comm.step_context(self.rounds):  # at the first step its verdict is in (at the latest, the next end)
                self._send_late(self.last_step_stats)
        if self._pending is not None and ending is None and not self.synced:
            self._advance()  # (at an end the round takes the exchange itself, its bytes in the round's record)
        if ending is not None:
            with comm.step_context(self.rounds):  # a failed collective names this round
                self._fragment_round(ending)
            self.last_step_stats = self.last_round_stats
        elif self.synced:
            with comm.step_context(self.rounds):
                self._round()

    def _stream_chunks(self, plan: list[list[Piece]], seen, verdict: guard.Verdict, head: list[float],
                       stats: CommStats) -> list:
        """A streaming round's exchanges (:func:`~lioncub.optim.round_end.end_round`, once the round is agreed on),
        a chunk at a time: the last round's agreement of the chunk applied to θ_s, the rebase and this round's
        agreement of the chunk launched (:meth:`_chunk_stream`); then the last round counted. The agreements launched,
        one per chunk (None each when the round is not finite everywhere)."""
        pending, self._pending, launched = self._pending, None, []
        for agreement in pending or []:  # every last stage in flight before a new exchange: one order on every rank
            agreement.launch(stats)
        for c, pieces in enumerate(plan):
            previous = None if pending is None else pending[c]
            if pending is not None:
                pending[c] = None  # (its d is freed with this chunk)
            launched.append(self._chunk_stream(pieces, seen, verdict, head, previous, stats, c))
        if pending is not None:
            applied(self)
        return launched

    def _chunk_stream(self, pieces: list[Piece], seen, verdict: guard.Verdict, head: list[float], previous,
                      stats: CommStats, index: int):
        """One chunk of a streaming round's end: ``previous`` (the last round's agreement of this chunk, or
        None) applied to θ_s, the rebase, and this round's agreement of the chunk launched and returned (None
        when the round is not finite everywhere)."""
        delta, v = seen.kept or self._pseudo_gradient("origin", pieces)
        if previous is not None:
            starts = self._outer_step(previous.result(stats), pieces, replicas=False)
        if verdict.bad_ranks:
            return None
        if self.eager:  # (before the send, which may overwrite v: Δ itself without error feedback)
            self._stand_in(delta, pieces)
        elif previous is not None:
            self._rebase(delta, pieces, starts)
        else:  # nothing in flight (the first round, after a skip or a flush): θ_i stays
            for pc in pieces:
                self._store(pc, "origin", _slot(self.params[pc.index], pc))
        return self._send(v, pieces, head, seen.scales, stats, index)

    # ------------------------------------------------------------------ fragments
    def _fragment_ending(self):
        """The fragment whose round ends at this inner step (``fragments > 1``: every H/F steps), or None."""
        if self.fragments == 1:
            return None
        every = self.H // self.fragments
        return self.local_step // every - 1 if self.local_step % every == 0 else None

    def _fragment_round(self, j: int) -> None:
        """The end of fragment ``j``'s round: the fragment in flight received (:meth:`_receive_pending`), then fragment
        ``j``'s Δ_i = θ_s − θ_i over H steps measured, o_i ← θ_i there (where its progress in flight begins), and its
        finite check and head launched; its exchange is launched at the first later step whose inner step finds that
        all-reduce complete (:meth:`_send_late`), at the latest at the next fragment's end, so that no rank waits for
        the others here, nor after, unless it is H/F steps ahead. With H/F = 1 the next step is the next fragment's
        end: all at once here."""
        stats = comm.step_stats(self.device)
        plan, spans = self._plan(), self._fragment_spans()
        if self._agreeing is not None:  # the last fragment's verdict not yet in: read it, launch its exchange
            self._send_late(stats)
        self._receive_pending(stats)
        lo, hi = spans[j]
        seen = self._measure("start", plan[lo:hi])
        agreeing = self._agree(self.exchange.head(seen.scales), self._marked(seen.finite), stats, self._round_group())
        self._bad_round = False
        kept = []
        for pieces in plan[lo:hi]:
            if self.eager:  # (its v kept for the send: θ_i no longer tells Δ_i)
                delta, v = seen.kept or self._pseudo_gradient("start", pieces)
                self._stand_in(delta, pieces)  # (before the send, which may overwrite v: Δ itself without feedback)
                kept.append(v)
                delta = v = None
            else:
                for pc in pieces:
                    self._store(pc, "origin", _slot(self.params[pc.index], pc))
        if not self.eager and seen.kept is not None:  # a fragment of one chunk: its v as measured, not made again
            kept.append(seen.kept[1])  # (θ_s, o_i and e_i of the fragment do not change until its send)
        self._agreeing = LateFragment(agreeing, j, seen.scales, kept)
        self.last_round_stats = stats
        if self.H // self.fragments == 1:
            self._send_late(stats)

    def _send_late(self, stats: CommStats) -> None:
        """A step after fragment ``j``'s end: its verdict read (complete, or the next fragment's end is due) and, when
        every rank's Δ is finite, its exchange launched, each chunk's v = θ_s − o_i + e_i (o_i: θ_i at the
        fragment's end; or the v its end kept: :class:`LateFragment`); the bytes counted in ``stats`` (this step's). What is sent
        does not depend on the step: fragment j's θ_s, o_i and e_i change only at its own end and receive."""
        late, self._agreeing = self._agreeing, None
        verdict = late.verdict.read(stats)
        if verdict.bad_ranks:
            self._nonfinite(verdict.bad_ranks)
            return
        plan, (lo, hi) = self._plan(), self._fragment_spans()[late.fragment]
        launched = []
        for n, index in enumerate(range(lo, hi)):
            pieces = plan[index]
            v = late.kept[n] if late.kept else self._pseudo_gradient("start", pieces, until="origin")[1]
            launched.append(self._send(v, pieces, verdict.extra, late.scales, stats, index))
            v = None
        self._pending, self._pending_fragment = launched, late.fragment
        self.last_round_stats = stats

    def _receive_pending(self, stats: CommStats) -> None:
        """Fragments: wait for the fragment in flight and, over its elements, take the outer step on θ_s and carry
        this worker's progress since the launch onto it (θ_i ← θ_s + θ_i − o_i); a round is complete when the
        last fragment's is."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        plan, (lo, hi) = self._plan(), self._fragment_spans()[self._pending_fragment]
        for index, agreement in zip(range(lo, hi), pending):
            pieces = plan[index]
            progress = [_slot(self.params[pc.index], pc).float() - self._held(pc, "origin").float() for pc in pieces]
            starts = self._outer_step(agreement.result(stats), pieces, replicas=False)
            for pc, start, moved in zip(pieces, starts, progress):
                _slot(self.params[pc.index], pc).copy_(start.float() + moved)
        if self._pending_fragment == self.fragments - 1:
            applied(self)

    def _advance(self) -> None:
        """Between inner steps: launch the next stage of each exchange in flight whose first is complete, in the
        chunks' order (every rank issues a group's collectives in one order: a chunk waits for the one before)."""
        for agreement in self._pending:
            if not agreement.advance(self.last_step_stats):
                return

    def _stand_in(self, delta: Tensor, pieces: list[Piece]) -> None:
        """``eager``: θ_i ← the outer rule's step from θ_s by this worker's own Δ_i (``delta``, over ``pieces``),
        standing in for the agreed d while that is in flight (θ_s and the rule's state unchanged); o_i ← θ_i."""
        groups = self._groups_of_params()
        for pc, piece in zip(pieces, delta.split([pc.size for pc in pieces])):
            mine = _slot(self.params[pc.index], pc)
            mine.copy_(self._moved_start(pc, piece, False, groups[pc.index], preview=True))
            self._store(pc, "origin", mine)

    def _rebase(self, delta: Tensor, pieces: list[Piece], starts: list[Tensor]) -> None:
        """θ_i ← θ_s − Δ_i (``delta``: this worker's progress since o_i over ``pieces``, negated; ``starts``: θ_s of
        each piece, as :meth:`_outer_step` returned it); o_i ← θ_i."""
        for pc, start, piece in zip(pieces, starts, delta.split([pc.size for pc in pieces])):
            mine = _slot(self.params[pc.index], pc)
            mine.copy_(start.float() - piece.view(mine.shape))
            self._store(pc, "origin", mine)

    @contextmanager
    def agreed(self) -> Iterator[None]:
        """Inside the block every parameter holds θ_s, the start the ranks agreed on (the same
        model on every rank: with ``delay=1`` a replica otherwise holds θ_s plus its own round in
        flight); each rank's own values come back after it. For evaluation; no collective."""
        own = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.local_state[p]["start"], non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, mine in zip(self.params, own):
                    p.copy_(mine)

    @torch.no_grad()
    def flush(self) -> None:
        """``delay=1``: wait for the round in flight and apply its outer step now, carrying each
        worker's progress since onto it (called at a round's end: every replica then holds θ_s,
        as with ``delay=0``). With fragments, the fragment in flight (every replica then holds θ_s plus its
        progress in the other fragments since their launches; :meth:`agreed` gives θ_s). Every rank calls it at
        the same step; nothing to do otherwise."""
        stats = comm.step_stats(self.device)
        if self._agreeing is not None:
            self._send_late(stats)
        if self._pending is None:
            return
        if self.fragments > 1:  # the fragment in flight; the others keep each worker's progress since their launch
            self._receive_pending(stats)
            self.last_round_stats = stats
            return
        pending, self._pending = self._pending, None
        for c, pieces in enumerate(self._plan()):
            agreement, pending[c] = pending[c], None  # (its d is freed with this chunk)
            delta = torch.cat([self._held(pc, "origin").float().reshape(-1)
                               - _slot(self.params[pc.index], pc).float().reshape(-1) for pc in pieces])
            self._rebase(delta, pieces, self._outer_step(agreement.result(stats), pieces, replicas=False))
            agreement = delta = None
        applied(self)
        self.last_round_stats = stats
