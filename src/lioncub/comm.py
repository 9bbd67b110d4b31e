"""Timed, byte-counted collectives and the per-step communication record.

Every collective a vote issues goes through one of the wrappers here, which
(1) runs the ``torch.distributed`` call, (2) adds its wall time to ``t_collective``
and (3) adds the bytes this rank sends and receives under the ring algorithm of
docs/design.md §3 to the :class:`CommStats`. The α-β model in :mod:`lioncub.cost`
predicts the same numbers from ``(n, P, bits)`` alone; tests check they agree.

Per rank, for a payload of ``B`` bytes and ``P`` ranks:

=============  ===================  ===================
collective     bytes sent           bytes received
=============  ===================  ===================
all_reduce     2(P-1)/P · B         2(P-1)/P · B
all_gather     (P-1) · B            (P-1) · B           (B = one rank's part)
all_to_all     (P-1)/P · B          (P-1)/P · B         (B = the whole buffer)
=============  ===================  ===================

Failures: when a peer dies or stalls, gloo raises once the process group's
timeout (``init_process_group(timeout=...)`` or ``new_group(timeout=...)``)
expires, or at once when the peer's socket closes. Every wrapper re-raises that
as :class:`CollectiveError` naming the collective, its payload and the optimizer
step (set by :func:`step_context`, or passed as ``step=``), so a job never hangs
forever and its log says where it stopped.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, fields
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CommStats", "CollectiveError", "step_context", "all_reduce", "all_gather", "all_to_all",
           "broadcast_from_first"]


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


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, stalled past the group's timeout, or the
    group is broken. The message names the collective, its payload and the step."""


_STEP: ContextVar[Optional[int]] = ContextVar("lioncub_step", default=None)


@contextmanager
def step_context(step: int) -> Iterator[None]:
    """Label every collective issued inside the block with optimizer step ``step``."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def _guarded(name: str, t: Tensor, step: Optional[int], call: Callable[[], None]) -> None:
    """Run ``call``; re-raise a backend failure as :class:`CollectiveError` with context."""
    t0 = time.perf_counter()
    try:
        call()
    except RuntimeError as exc:  # DistBackendError (a RuntimeError) on timeout / closed peer
        step = _STEP.get() if step is None else step
        where = f"at optimizer step {step}" if step is not None else "outside an optimizer step"
        nbytes = t.numel() * t.element_size()
        raise CollectiveError(
            f"{name} of {nbytes} bytes ({t.numel()} x {t.dtype}) {where} failed on rank "
            f"{dist.get_rank()} after {time.perf_counter() - t0:.1f} s: a peer died, stalled past the "
            f"process group's timeout, or the group is broken. Backend error: {exc}"
        ) from exc


def all_reduce(t: Tensor, group=None, stats: CommStats | None = None, *, step: Optional[int] = None) -> Tensor:
    """In-place SUM all-reduce of ``t``."""
    p = _size(group)
    t0 = time.perf_counter()
    _guarded("all_reduce", t, step, lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group))
    _record(stats, 2 * (p - 1) / p * t.numel() * t.element_size(), t0)
    return t


def all_gather(t: Tensor, group=None, stats: CommStats | None = None, *, step: Optional[int] = None) -> Tensor:
    """Gather every rank's ``t`` (same shape) into a ``(P, *t.shape)`` tensor."""
    p = _size(group)
    out = torch.empty(p * t.numel(), dtype=t.dtype, device=t.device)
    t0 = time.perf_counter()
    _guarded("all_gather", t, step, lambda: _all_gather_flat(out, t.contiguous().reshape(-1), group=group))
    _record(stats, (p - 1) * t.numel() * t.element_size(), t0)
    return out.view((p,) + tuple(t.shape))


def all_to_all(t: Tensor, group=None, stats: CommStats | None = None, *, step: Optional[int] = None) -> Tensor:
    """Split ``t`` (first dim divisible by P) into P parts; part j goes to rank j.

    Returns the received parts in rank order, same shape as ``t``.
    """
    p = _size(group)
    out = torch.empty_like(t)
    t0 = time.perf_counter()
    _guarded("all_to_all", t, step, lambda: dist.all_to_all_single(out, t.contiguous(), group=group))
    _record(stats, (p - 1) / p * t.numel() * t.element_size(), t0)
    return out


@torch.no_grad()
def broadcast_from_first(tensors: list[Tensor], group=None) -> None:
    """In place: every rank's ``tensors`` become the group's first rank's (one float64 broadcast,
    exact for every float dtype up to fp64). Collective."""
    if not tensors:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    dist.broadcast(flat, src=src, group=group)
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(piece.view_as(t))
