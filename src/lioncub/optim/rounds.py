"""The steps of a LocalCub round's end, as a mixin: this worker's pseudo-gradient and what the round agrees on
(:meth:`Rounds._measure`), the round's one finite agreement (:meth:`Rounds._agree`:
:func:`~lioncub.engine.guard.agree_async`), a chunk's exchange (:meth:`Rounds._launch`: its aggregation,
:mod:`lioncub.votes.rounds`), the residuals, the outer step and a non-finite round's drop, a chunk of the model at a
time. One sequence runs them for the blocking rounds, the streaming rounds (:mod:`.streaming`) and torchft's
(:class:`~lioncub.ft.FTLocalCub`, which overrides only the two hooks :meth:`Rounds._round_group` and
:meth:`Rounds._quorum`): :func:`lioncub.optim.round_end.end_round`; a fragment's round runs them spread over the
inner steps. Uses what LocalCub defines: ``params``, ``state`` (``start`` = θ_s, ``origin`` = o_i, ``residual`` =
e_i), ``outer_state``, ``exchange``, ``rule``, ``error_feedback``, ``delay``, ``world_size``, ``group``,
``stream_group``, ``generator``, ``rounds``, ``nonfinite``.

How a round stays within a chunk of memory: :meth:`Rounds._plan` cuts the model into chunks
(:func:`lioncub.chunks.plan_chunks`: whole tensors together, a larger tensor in slices cut on the blocks of
:data:`SCALE_BLOCK`) of at most :attr:`Rounds.round_chunk` elements and a 16th of the model. The first pass
reads every chunk's Δ once for what the round must agree on before any message is made (the finite check,
and each tensor's mean |v|: :func:`abs_means`); the second pass makes each chunk's Δ again, exchanges it,
keeps its residual and takes its outer step. Nothing of the size of the model is allocated.

Where the outer state lives (``outer_state``): a round reads it through :meth:`Rounds._held` and writes it
through :meth:`Rounds._keep` (a held piece changed in place) or :meth:`Rounds._store` (a new value), a piece of a
chunk at a time. On the device a held piece is the state's own slot; on the host (``'host'``) it is a device copy,
and the writes copy back, all non_blocking on the current stream, which orders them against the round's arithmetic
(no side stream: a chunk needs its state before its arithmetic starts, and the next round reads what this one
wrote). So the device holds a chunk's copy at a time, and nothing waits for the host until the host itself reads or
writes the state (:meth:`Rounds._settle`: a checkpoint, a heal)."""
from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..chunks import Piece, chunk_cap, plan_fragments
from ..comm import CommStats
from ..engine import guard
from ..votes.rounds import Agreement
from .round_end import Quorum, RoundGroup, end_round

__all__ = ["Rounds", "block_sums", "abs_means", "SCALE_BLOCK", "OUTER_STATES"]

from ..options import OUTER_STATES  # (Options.outer_state's choices: where θ_s, o_i, e_i, the outer rule's state and
# the owner residuals live)

SCALE_BLOCK = 1 << 20
"""Elements per block of a tensor's mean |v| (:func:`abs_means`); a tensor is sliced on these blocks."""


def block_sums(x: Tensor) -> Tensor:
    """Σ|x| of each :data:`SCALE_BLOCK` of the flat ``x``, in float64, each as its block's float32 mean times
    its length (exact: a float32 times a count below 2^29 fits float64's mantissa)."""
    if x.numel() == 0:
        return x.new_zeros(0, dtype=torch.float64)
    return torch.stack([b.abs().mean().double() * b.numel() for b in x.split(SCALE_BLOCK)])


def abs_means(blocks: list[list[Tensor]], sizes: list[int], device) -> Tensor:
    """Each tensor's mean |v| (float64) from its pieces' :func:`block_sums` in order: the block sums added,
    over the tensor's size. A tensor of one block gets ``v.abs().mean()`` exactly; one of several gets the
    same value whether its blocks came whole or in slices. An empty tensor's is 0, and so is one with no pieces
    (a tensor outside the fragment measured: its size there is 0)."""
    sums = torch.zeros(len(sizes), dtype=torch.float64, device=device)
    present = [i for i, parts in enumerate(blocks) if parts]  # (a fragment's tensors: the others stay 0)
    if present:  # (one block: its value, exactly)
        sums[present] = torch.stack([(blocks[i][0] if len(blocks[i]) == 1 else torch.cat(blocks[i])).sum()
                                     for i in present])
    return sums / torch.tensor([max(n, 1) for n in sizes], dtype=torch.float64, device=device)


def _shard_slot(sharding, k: int, n: int, verdict: guard.Verdict) -> guard.Verdict:
    """``verdict`` with this rank's shard's ``n`` head sums (after ``k`` slots) out of the world's, spread by shard."""
    return verdict._replace(extra=verdict.extra[:k] + sharding.slot(verdict.extra[k:], n))


def _slot(t: Tensor, piece: Piece) -> Tensor:
    """The elements of ``piece`` in ``t``, writable: a flat view, or ``t`` itself when it is not contiguous
    (such a tensor is never cut: :meth:`Rounds._plan`)."""
    return t.view(-1)[piece.lo:piece.hi] if t.is_contiguous() else t


class Measured(NamedTuple):
    """What a round's first pass found: ``finite`` (this rank's Δ, a device bool or True), ``scales`` (each
    tensor's mean |v|, or None when the aggregation needs none) and ``kept`` ((Δ, v) of a round of one chunk,
    which the second pass then need not make again)."""

    finite: object
    scales: Optional[Tensor]
    kept: Optional[tuple[Tensor, Tensor]]


class Rounds:
    """The steps of a round's end that every kind of round shares (:func:`~lioncub.optim.round_end.end_round` runs
    them), and its two hooks: :meth:`_round_group` and :meth:`_quorum`."""

    round_chunk = 1 << 22
    """Elements of pseudo-gradient a round holds at once, at most (and at most a 16th of the model, but not
    below 2^20: :func:`lioncub.chunks.chunk_cap`): Δ, v, the message and d of one chunk (about 13 bytes an
    element), not of the model. Each chunk is one more exchange; the round still agrees once."""

    _weight = None
    """``Options(pace='timed')``: this rank's weight c_i = P·s_i/Σs in the round ending (:mod:`lioncub.optim.pace`),
    by which :meth:`_pseudo_gradient` scales the Δ it sends; None: unscaled."""

    def _round(self) -> None:
        """The end of a round, blocking or streaming: :func:`~lioncub.optim.round_end.end_round`."""
        end_round(self)

    def _round_group(self) -> RoundGroup:
        """Where this optimizer's round ends run: the finite agreement over ``agree_group``, the exchanges over its
        ranks (streaming: on their own group, :func:`lioncub.comm.own_group`) with its ``exchange``."""
        group = self.stream_group if self.stream_group is not None else self.group
        return RoundGroup(self.agree_group, self.agree_size, group, self.exchange)

    def _quorum(self, contributing: bool) -> Quorum:
        """Who takes part in a round's end and when it stands: every rank, at once (:class:`Quorum`)."""
        return Quorum(self, contributing)

    def _plan(self) -> list[list[Piece]]:
        """The round's chunks for this optimizer's parameters: :func:`lioncub.chunks.plan_chunks`, slices cut on
        :data:`SCALE_BLOCK` (so that a tensor's mean |v| is the same sliced or whole) and a non-contiguous
        tensor never cut; one chunk of every tensor when the aggregation does not decide each tensor alone
        (:attr:`~lioncub.votes.rounds.RoundAggregation.per_tensor`). With ``fragments > 1`` the chunks of each
        fragment in turn (:func:`lioncub.chunks.plan_fragments`; :meth:`_fragment_spans`)."""
        key = (self.round_chunk, SCALE_BLOCK, self.exchange.per_tensor, self.fragments)
        if getattr(self, "_round_plan", (None,))[0] != key:
            sizes = [p.numel() for p in self.params]
            if not self.exchange.per_tensor:
                fragments = [[[Piece(i, 0, n) for i, n in enumerate(sizes)]]]
            else:
                uncut = frozenset(i for i, p in enumerate(self.params) if not p.is_contiguous())
                fragments = plan_fragments(sizes, self.fragments, chunk_cap(sum(sizes), self.round_chunk),
                                           align=SCALE_BLOCK, uncut=uncut)
            spans, at = [], 0
            for chunks in fragments:
                spans.append((at, at + len(chunks)))
                at += len(chunks)
            self._round_plan = (key, [chunk for chunks in fragments for chunk in chunks], spans)
        return self._round_plan[1]

    def _fragment_spans(self) -> list[tuple[int, int]]:
        """Each fragment's chunks in :meth:`_plan`, as ``(first, end)`` indices (one fragment: every chunk)."""
        self._plan()
        return self._round_plan[2]

    def _measure(self, began: str, plan: list[list[Piece]], aggregation=None) -> Measured:
        """The first pass over the chunks: whether this rank's Δ since ``state[p][began]`` is finite, and each
        tensor's mean |v| when the aggregation uses it."""
        aggregation = self.exchange if aggregation is None else aggregation
        scaled = aggregation.needs_scales(self.error_feedback)
        finite, blocks, kept = True, [[] for _ in self.params], None
        for pieces in plan:
            delta, v = self._pseudo_gradient(began, pieces)
            finite = guard.all_finite(finite, torch.isfinite(delta).all())
            if scaled:
                for piece, x in zip(pieces, v.split([pc.size for pc in pieces])):
                    blocks[piece.index].append(block_sums(x))
            kept = (delta, v) if len(plan) == 1 else None
            delta = v = x = None  # (freed, views too, before the next chunk's are made)
        sizes = [0] * len(self.params)  # each tensor's elements in ``plan`` (all of it, but in a fragment)
        for pieces in plan:
            for pc in pieces:
                sizes[pc.index] += pc.size
        return Measured(finite, abs_means(blocks, sizes, self.device) if scaled else None, kept)

    def _nothing_to_send(self, aggregation) -> Measured:
        """What a rank with no Δ this round measures (torchft's joining or healed replica): finite, zero scales."""
        scaled = aggregation.needs_scales(self.error_feedback)
        return Measured(True, torch.zeros(len(self.params), dtype=torch.float64, device=self.device) if scaled
                        else None, None)

    def _agree(self, head: Optional[Tensor], finite, stats: CommStats, group: RoundGroup,
               slots: Sequence[float] = ()) -> guard.Agreeing:
        """The round's one small all-reduce over ``group``'s agreement group, launched: how many ranks hold a
        non-finite value (``finite``: this rank's verdict) and the sums of ``slots`` (the quorum's) then of ``head``
        (the aggregation's per-tensor sums: the lane mean's shared scale). Its
        :meth:`~lioncub.engine.guard.Agreeing.read` waits for it and gives the verdict (the ranks meet there)."""
        extra, finish = head, None
        if self.sharding is not None and head is not None:  # the world agrees; a shard's replicas sum
            extra, finish = self.sharding.spread(head), partial(_shard_slot, self.sharding, len(slots), head.numel())
        if slots:
            ahead = torch.tensor(slots, dtype=torch.float64, device=self.device)
            extra = ahead if extra is None else torch.cat([ahead, extra])
        return guard.agree_async([], group.agree_group, group.agree_size, self.device, stats, finite=finite,
                                 extra=extra, finish=finish)

    def _marked(self, finite):
        """This rank's verdict for the round: ``finite`` (its Δ), and no inner step marked non-finite (``_bad_round``:
        False, True, or a device flag the inner steps set without a host read)."""
        if isinstance(self._bad_round, Tensor):
            return guard.all_finite(finite, torch.logical_not(self._bad_round))
        return False if self._bad_round else finite

    def _pseudo_gradient(self, began: str, pieces: list[Piece], until: Optional[str] = None) -> tuple[Tensor, Tensor]:
        """(Δ_i, v_i = Δ_i + e_i) flat fp32 over ``pieces``: this worker's progress since ``state[p][began]``
        (to ``state[p][until]`` when given, else to the parameter), written piece by piece into the two buffers
        (Δ's values those of ``start.float() - p.float()``). A timed round's weight c (:attr:`_weight`) scales what is
        sent: v_i = c·Δ_i + e_i."""
        total, weight = sum(pc.size for pc in pieces), self._weight
        delta = torch.empty(total, dtype=torch.float32, device=self.device)
        v = torch.empty_like(delta) if self.error_feedback or weight is not None else delta
        offset = 0
        for pc in pieces:
            out = delta[offset:offset + pc.size]
            now = _slot(self.params[pc.index], pc) if until is None else self._held(pc, until)
            out.copy_(self._held(pc, began).reshape(-1)).sub_(now.reshape(-1))
            if self.error_feedback:  # (alpha 1: e + Δ, bit for bit the unweighted sum)
                torch.add(self._held(pc, "residual").reshape(-1), out, alpha=1.0 if weight is None else weight,
                          out=v[offset:offset + pc.size])
            elif weight is not None:
                torch.mul(out, weight, out=v[offset:offset + pc.size])
            offset += pc.size
        return delta, v

    # ------------------------------------------------------------------ where the outer state lives
    def _placed(self) -> dict:
        """Where the outer state is made, as a tensor factory's keywords: the parameters' device, or with
        ``outer_state='host'`` the host, pinned when the parameters are on CUDA (a copy to or from pageable memory
        waits for it; and pinning needs CUDA)."""
        if self.outer_state == "host":
            return dict(device="cpu", pin_memory=self.device.type == "cuda")
        return dict(device=self.device)

    def _held(self, pc: Piece, key: str) -> Tensor:
        """``state[key]`` over ``pc`` where the round computes: the state's own slot, or with the state on the host a
        device copy of it (non_blocking: ordered before the ops that read it on the current stream). A copy that
        the round changes in place goes back through :meth:`_keep`."""
        slot = _slot(self.local_state[self.params[pc.index]][key], pc)
        return slot.to(self.device, non_blocking=True, copy=True) if self.outer_state == "host" else slot

    def _keep(self, pc: Piece, key: str, held: Tensor) -> None:
        """:meth:`_held`'s ``held``, changed in place, kept: stored when it is a copy (on the device it is the slot)."""
        if self.outer_state == "host":
            self._store(pc, key, held)

    def _store(self, pc: Piece, key: str, value: Tensor) -> None:
        """``state[key]`` over ``pc`` ← ``value`` (on the device); into host state a non_blocking copy, which nothing
        waits for (:meth:`_settle`)."""
        slot = _slot(self.local_state[self.params[pc.index]][key], pc)
        slot.copy_(value.view(slot.shape), non_blocking=True)

    def _settle(self) -> None:
        """Before the host reads or writes the outer state itself (a checkpoint, a heal): wait for the copies
        to and from it in flight. Nothing to wait for on the CPU, nor with the state on the device."""
        if self.outer_state == "host" and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _launch(self, v: Tensor, pieces: list[Piece], head: list[float], scales: Optional[Tensor], count: int,
                stats: CommStats, index: int, group: RoundGroup, abstain: bool = False) -> tuple[Agreement, Optional[Tensor]]:
        """Start chunk ``index``'s agreement of ``v`` over ``pieces`` on ``group`` (its aggregation,
        :mod:`lioncub.votes.rounds`, with the chunk's owner state: :meth:`_owner_state`): the agreement, and this
        rank's new residual v − C(v) (in ``v``'s buffer; None without error feedback, or when ``abstain``: a rank with
        nothing to send, not among the ``count``). ``head``: the agreed per-tensor sums, ``scales``: this rank's
        per-tensor mean |v| (each indexed by parameter; empty / None when the aggregation has none)."""
        idx = [pc.index for pc in pieces]
        agreement, sent = group.aggregation.launch(
            v, [pc.size for pc in pieces], head=[head[i] for i in idx] if len(head) else [],
            scales=None if scales is None else scales[idx], count=count, step=self.rounds, generator=self.generator,
            group=group.group, stats=stats, feedback=self.error_feedback, owner=self._owner_state(index, v.numel()),
            abstain=abstain)
        return agreement, v.sub_(sent) if sent is not None and self.error_feedback and not abstain else None

    def _send(self, v: Tensor, pieces: list[Piece], head: list[float], scales: Optional[Tensor], stats: CommStats,
              index: int) -> Agreement:
        """Chunk ``index``'s exchange over every rank of :meth:`_round_group` (:meth:`_launch`) started, and this
        rank's residual of it kept; its agreement."""
        agreement, residual = self._launch(v, pieces, head, scales, self.world_size, stats, index, self._round_group())
        if residual is not None:
            self._write_residuals(residual, pieces)
        return agreement

    def _owner_state(self, index: int, n: int) -> Optional[Tensor]:
        """This rank's state for chunk ``index`` (``n`` elements) that the aggregation keeps from round to round
        (:meth:`~lioncub.votes.rounds.RoundAggregation.owner_elements`: the scatter mean's owner residual), made
        as zeros on first use; None when it keeps none."""
        size = self.exchange.owner_elements(n)
        if not size:
            return None
        kept = self.owner_residuals.get(index)
        if kept is None or kept.numel() != size:  # (the aggregation reads and writes it where it lives)
            kept = self.owner_residuals[index] = torch.zeros(size, dtype=torch.float32, **self._placed())
        return kept

    def _write_residuals(self, e: Tensor, pieces: list[Piece]) -> None:
        """The residuals of ``pieces`` ← ``e`` (flat, in their order)."""
        for pc, value in zip(pieces, e.split([pc.size for pc in pieces])):
            self._store(pc, "residual", value)

    def _outer_step(self, result: tuple[Tensor, bool], pieces: list[Piece], replicas: bool = True) -> list[Tensor]:
        """θ_s ← decayed θ_s, then the outer rule by d (``result``: (d over ``pieces``, whether d holds u)),
        over ``pieces``; every replica ← θ_s (``replicas``). Returns the new θ_s of each piece, on the device."""
        d, signed = result
        groups = self._groups_of_params()
        starts = []
        for pc, dp in zip(pieces, d.split([pc.size for pc in pieces])):
            starts.append(self._moved_start(pc, dp, signed, groups[pc.index]))
            if replicas:
                _slot(self.params[pc.index], pc).copy_(starts[-1])
        return starts

    def _groups_of_params(self) -> list[dict]:
        """Each parameter's group, in ``self.params``' order (what a piece's ``index`` points into)."""
        return [g for g in self.param_groups for _ in g["params"]]

    def _moved_start(self, pc: Piece, dp: Tensor, signed: bool, group: dict, preview: bool = False) -> Tensor:
        """θ_s over ``pc`` moved by the decoupled decay and the outer rule by ``dp`` (and stored, the rule's state
        too), returned on the device; with ``preview``, a copy moved instead (θ_s and the rule's state stay as they
        were: a streaming round's stand-in)."""
        start, state = self._held(pc, "start"), {k: self._held(pc, k) for k in self.rule.state_keys}
        if preview:
            start, state = start.clone(), {k: v.clone() for k, v in state.items()}
        lr, wd = group["lr"], group["outer_weight_decay"]
        if wd != 0:
            start.mul_(1.0 - self.rule.lr * lr * wd)
        self.rule.step(start, dp.view(start.shape), state, lr=lr, signed=signed)
        if not preview:
            self._keep(pc, "start", start)
            for key, value in state.items():
                self._keep(pc, key, value)
        return start

    def _nonfinite(self, bad_ranks: int) -> None:
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradients or parameters in round {self.rounds} on {bad_ranks} rank(s); "
                "pass nonfinite='skip' to drop such rounds")
        for p in self.params:  # every rank drops the round's local progress
            p.copy_(self.local_state[p]["start"], non_blocking=True)
            if self.delay:
                self.local_state[p]["origin"].copy_(p, non_blocking=True)
        self.skipped_rounds += 1
