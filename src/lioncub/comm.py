"""Timed, byte-counted collectives and the per-step communication record.

Every collective a vote issues goes through one of the wrappers here, which
(1) runs the ``torch.distributed`` call, (2) adds its wall time to ``t_collective``
and (3) adds the bytes this rank sends and receives under the ring algorithm of
DESIGN.md §3 to the :class:`CommStats`. The α-β model in :mod:`lioncub.cost`
predicts the same numbers from ``(n, P, bits)`` alone; tests check they agree.

Per rank, for a payload of ``B`` bytes and ``P`` ranks:

=============  ===================  ===================
collective     bytes sent           bytes received
=============  ===================  ===================
all_reduce     2(P-1)/P · B         2(P-1)/P · B
all_gather     (P-1) · B            (P-1) · B           (B = one rank's part)
all_to_all     (P-1)/P · B          (P-1)/P · B         (B = the whole buffer)
=============  ===================  ===================
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CommStats", "all_reduce", "all_gather", "all_to_all"]


@dataclass
class CommStats:
    """What one optimizer step (or one vote) cost. Times in seconds, sizes in bytes."""

    bytes_sent: float = 0.0
    bytes_recv: float = 0.0
    n_collectives: int = 0
    t_quantize_pack: float = 0.0
    t_collective: float = 0.0
    t_unpack_vote: float = 0.0
    t_apply: float = 0.0

    def add(self, other: "CommStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return asdict(self)


def _record(stats: CommStats | None, sent: float, t0: float) -> None:
    if stats is None:
        return
    stats.t_collective += time.perf_counter() - t0
    stats.bytes_sent += sent
    stats.bytes_recv += sent  # every ring collective here is symmetric
    stats.n_collectives += 1


# torch 2.13 renames all_gather_into_tensor to all_gather_single; accept both.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size(group) -> int:
    return dist.get_world_size(group)


def all_reduce(t: Tensor, group=None, stats: CommStats | None = None) -> Tensor:
    """In-place SUM all-reduce of ``t``."""
    p = _size(group)
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    _record(stats, 2 * (p - 1) / p * t.numel() * t.element_size(), t0)
    return t


def all_gather(t: Tensor, group=None, stats: CommStats | None = None) -> Tensor:
    """Gather every rank's ``t`` (same shape) into a ``(P, *t.shape)`` tensor."""
    p = _size(group)
    out = torch.empty(p * t.numel(), dtype=t.dtype, device=t.device)
    t0 = time.perf_counter()
    _all_gather_flat(out, t.contiguous().reshape(-1), group=group)
    _record(stats, (p - 1) * t.numel() * t.element_size(), t0)
    return out.view((p,) + tuple(t.shape))


def all_to_all(t: Tensor, group=None, stats: CommStats | None = None) -> Tensor:
    """Split ``t`` (first dim divisible by P) into P parts; part j goes to rank j.

    Returns the received parts in rank order, same shape as ``t``.
    """
    p = _size(group)
    out = torch.empty_like(t)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, t.contiguous(), group=group)
    _record(stats, (p - 1) / p * t.numel() * t.element_size(), t0)
    return out
