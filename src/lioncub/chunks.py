"""How a loop over many tensors stays within a chunk of memory: the tensors cut into chunks of whole tensors
and slices.

One planner, :func:`plan_chunks`, serves every such loop: LocalCub's rounds (slices cut on the blocks of a
tensor's scale), Lion's multi-tensor step, NodeCub's in-node mean and share, the set-up broadcast
(:func:`slices`) and the messages and momentum all-reduces that group whole tensors (:func:`runs`).
:func:`chunk_cap` sizes a chunk from the model's size.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from torch import Tensor

__all__ = ["Piece", "plan_chunks", "plan_fragments", "runs", "chunk_cap", "slices", "pack_slices", "unpack_slices"]


class Piece(NamedTuple):
    """Elements ``lo:hi`` of the flattened tensor ``index`` (its position in a list), one part of a chunk."""

    index: int
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


def plan_chunks(sizes: Iterable[int], chunk: float, *, align: int = 1, uncut=frozenset()) -> list[list[Piece]]:
    """Tensors of ``sizes``, in order, as chunks of at most ``chunk`` elements: whole tensors grouped together,
    and a tensor above ``chunk`` in slices of its own, cut on multiples of ``align`` (each slice at least
    ``align``) unless it is ``uncut`` (a set of indices, or True for every one: it is then a chunk alone).
    One empty chunk for no tensors."""
    cut = max(align, int(chunk) // align * align)
    chunks: list[list[Piece]] = []
    run: list[Piece] = []
    filled = 0
    for i, n in enumerate(sizes):
        if run and (n > chunk or filled + n > chunk):
            chunks.append(run)
            run, filled = [], 0
        if n > chunk:
            whole = uncut is True or i in uncut
            chunks += [[Piece(i, lo, n if whole else min(lo + cut, n))] for lo in ([0] if whole else range(0, n, cut))]
        else:
            run.append(Piece(i, 0, n))
            filled += n
    return chunks + [run] if run or not chunks else chunks


def plan_fragments(sizes: Iterable[int], parts: int, chunk: float, *, align: int = 1,
                   uncut=frozenset()) -> list[list[list[Piece]]]:
    """Tensors of ``sizes``, in order, as ``parts`` fragments of about equal size, each cut into chunks of at most
    ``chunk`` elements as :func:`plan_chunks` cuts a model. A fragment is a run of whole tensors and slices: it
    ends at a tensor's end or, inside a tensor that is not ``uncut``, at a multiple of ``align``; of these places,
    fragment k ends at the one nearest ``k·total/parts``. ``parts=1`` is :func:`plan_chunks` exactly.
    ValueError when the tensors cannot be cut into ``parts`` non-empty fragments."""
    sizes = list(sizes)
    total = sum(sizes)
    ends, starts, at = [], [], 0  # the places a fragment may end, in elements from the first tensor's start
    for i, n in enumerate(sizes):
        starts.append(at)
        if not (uncut is True or i in uncut):
            ends += [at + lo for lo in range(align, n, align)]
        at += n
        ends.append(at)
    cuts = []
    for k in range(1, parts):
        later = [e for e in ends if e > (cuts[-1] if cuts else 0) and e < total]
        if len(later) < parts - k:
            most = len(cuts) + len(later) + 1
            raise ValueError(f"fragments must be at most the places these parameters can be cut into ({most} "
                             f"fragments: whole tensors, or slices of {align} elements), got {parts}")
        cuts.append(min(later[:len(later) - (parts - k - 1)], key=lambda e: (abs(e - k * total / parts), e)))
    out, bounds = [], [0] + cuts + [total]
    for lo, hi in zip(bounds, bounds[1:]):
        pieces = [Piece(i, max(lo - s, 0), min(hi - s, n)) for i, (s, n) in enumerate(zip(starts, sizes))
                  if ((s < hi and s + n > lo) if n else (lo <= s < hi or s == hi == total))]
        chunks = plan_chunks([pc.size for pc in pieces], chunk, align=align,
                             uncut=True if uncut is True else frozenset(j for j, pc in enumerate(pieces)
                                                                        if pc.index in uncut))
        out.append([[Piece(pieces[c.index].index, pieces[c.index].lo + c.lo, pieces[c.index].lo + c.hi) for c in run]
                    for run in chunks])
    return out


def runs(sizes: Iterable[int], cap: float) -> list[list[int]]:
    """Indices of ``sizes`` in order, grouped into runs whose sizes add up to at most ``cap`` (at least one
    index each: a size above ``cap`` is a run of its own): :func:`plan_chunks` with no tensor cut. How buckets
    travel in messages."""
    return [[pc.index for pc in pieces] for pieces in plan_chunks(sizes, cap, uncut=True) if pieces]


def chunk_cap(total: int, cap: int, share: int = 16, floor: int = 1 << 20) -> int:
    """Elements a chunked loop over ``total`` elements holds at once: at most ``cap``, and at most a
    ``share``-th of the whole (so its transient stays a small part of the model's bytes, a small model's
    too), but not below ``floor`` elements (a few more collectives, never thousands of tiny ones)."""
    return min(cap, max(floor, total // share))


def slices(tensors: list[Tensor], chunk: int) -> list[list[tuple[Tensor, int, int]]]:
    """``tensors`` as flat slices ``(t, a, b)`` (``t.view(-1)[a:b]``) by :func:`plan_chunks` (a non-contiguous
    tensor, rare, is never cut); chunks of no elements left out. How a collective of many tensors is bounded
    by a chunk (:func:`pack_slices`, :func:`unpack_slices`)."""
    uncut = frozenset(i for i, t in enumerate(tensors) if not t.is_contiguous())
    return [[(tensors[pc.index], pc.lo, pc.hi) for pc in pieces]
            for pieces in plan_chunks([t.numel() for t in tensors], chunk, uncut=uncut) if sum(pc.size for pc in pieces)]


def pack_slices(pieces: list[tuple[Tensor, int, int]], flat: Tensor) -> Tensor:
    """The slices' values, in order, into the front of ``flat`` (cast to its dtype); returns ``flat``."""
    offset = 0
    for t, a, b in pieces:
        flat[offset:offset + b - a].copy_(t.detach().reshape(-1)[a:b])
        offset += b - a
    return flat


def unpack_slices(flat: Tensor, pieces: list[tuple[Tensor, int, int]]) -> None:
    """:func:`pack_slices` backwards: the front of ``flat`` written into the slices (cast to their dtype)."""
    offset = 0
    for t, a, b in pieces:
        src = flat[offset:offset + b - a]
        if t.is_contiguous():
            t.view(-1)[a:b].copy_(src)
        else:
            t.copy_(src.view_as(t))
        offset += b - a
