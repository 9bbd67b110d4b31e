"""Timed, byte-counted collectives and the per-step communication record.

Every collective a vote issues goes through one of the wrappers here, which
(1) runs the ``torch.distributed`` call, (2) adds its wall time to ``t_collective``
and (3) adds the bytes this rank sends and receives under the ring algorithm of
docs/design.md §3 to the :class:`CommStats`. The α-β model in :mod:`lioncub.engine.cost`
predicts the same numbers from ``(n, P, bits)`` alone; tests check they agree.

Per rank, for a payload of ``B`` bytes and ``P`` ranks:

=============  ===================  ===================
collective     bytes sent           bytes received
=============  ===================  ===================
all_reduce     2(P-1)/P · B         2(P-1)/P · B
all_gather     (P-1) · B            (P-1) · B           (B = one rank's part)
all_to_all     (P-1)/P · B          (P-1)/P · B         (B = the whole buffer)
=============  ===================  ===================

Devices: every tensor handed to a collective lives on the optimizer's *communication
device*, the parameters' device (:func:`comm_device`): NCCL refuses CPU tensors, and under
NCCL that device must be the current CUDA device (``torch.cuda.set_device(local_rank)``).
Barriers pass ``device_ids`` where NCCL needs them, and the object collectives here
(:func:`all_gather_object`, :func:`broadcast_object`, set-up only, never inside a step)
travel as JSON bytes on that device, so nothing received from a peer can run code.

Timings: NCCL calls return when the work is queued, not when it is done. A
:class:`CommStats` made with ``sync=device`` (a CUDA device; the optimizers do this when
``timing=True``) synchronises that device before every clock read (:func:`clock`), so its
times are wire and kernel times; without it, CUDA times are launch times and the
optimizers report them as 0 (bytes and counts are always exact). On CPU every call is
blocking and times are measured as they are.

Failures: when a peer dies or stalls, gloo raises once the process group's
timeout (``init_process_group(timeout=...)`` or ``new_group(timeout=...)``)
expires, or at once when the peer's socket closes. Every wrapper re-raises that
as :class:`CollectiveError` naming the collective, its payload and the optimizer
step (set by :func:`step_context`, or passed as ``step=``), so a job never hangs
forever and its log says where it stopped.
"""
from __future__ import annotations

import json
import time
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, fields
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .chunks import pack_slices, slices, unpack_slices

__all__ = ["CommStats", "CollectiveError", "ExternalGroup", "step_context", "all_reduce", "all_reduce_async", "Pending",
           "all_gather", "all_to_all",
           "all_gather_async", "all_to_all_async", "own_group",
           "broadcast", "broadcast_from_first", "barrier", "all_gather_object", "broadcast_object",
           "device_of", "comm_device", "make_generator", "restore_generator", "clock", "step_stats",
           "REDUCE_OPS"]


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
"""The reduce ops the library uses: both exist on NCCL for every dtype it sends."""


@dataclass
class CommStats:
    """What one optimizer step (or one vote) cost. Times in seconds, sizes in bytes.

    ``sync`` (not a field: not added, not reported): a CUDA device to synchronise before
    every clock read, so times are those of finished work (see :func:`clock`); ``None``
    reads the clock as it is (CPU: exact); ``False``: not timed, every time stays 0."""

    bytes_sent: float = 0.0
    bytes_recv: float = 0.0
    n_collectives: int = 0
    t_quantize_pack: float = 0.0
    t_collective: float = 0.0
    t_unpack_vote: float = 0.0
    t_apply: float = 0.0

    sync = None  # class default; an instance may set a torch.device

    def add(self, other: "CommStats") -> None:
        """Add ``other``'s counts, and its times unless this record is not timed (``sync is
        False``: a part's launch times must not leak into an untimed step's record)."""
        for f in fields(self):
            if self.sync is False and f.name.startswith("t_"):
                continue
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return asdict(self)


def step_stats(device: torch.device, timing: Optional[bool] = None) -> CommStats:
    """A step's record on ``device``: timed as ``timing`` says (None: on CPU only, where the
    calls block; True on CUDA synchronises before each clock read; False: times stay 0)."""
    stats = CommStats()
    timed = device.type == "cpu" if timing is None else timing
    if not timed:
        stats.sync = False
    elif device.type == "cuda":
        stats.sync = device
    return stats


def clock(stats: Optional[CommStats] = None) -> float:
    """``time.perf_counter()``, after synchronising ``stats.sync`` when it is set (a CUDA
    device: the optimizers set it only when timings are asked for, never by default)."""
    sync = getattr(stats, "sync", None)
    if sync is False:  # not timed (CUDA without timing=True): every time reads as 0
        return 0.0
    if sync is not None and sync.type == "cuda":
        torch.cuda.synchronize(sync)
    return time.perf_counter()


def _record(stats: CommStats | None, sent: float, t0: float) -> None:
    if stats is None:
        return
    stats.t_collective += clock(stats) - t0
    stats.bytes_sent += sent
    stats.bytes_recv += sent  # every ring collective here is symmetric
    stats.n_collectives += 1


# torch 2.13 renames all_gather_into_tensor to all_gather_single; accept both.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size(group) -> int:
    if isinstance(group, ExternalGroup):
        return group.size()
    return dist.get_world_size(group)


class ExternalGroup:
    """A group whose all-reduce is not ``torch.distributed``'s: the replica groups of a
    fault-tolerant job (:class:`lioncub.ft.ReplicaGroup`, over a torchft ``Manager``).

    Only :func:`all_reduce` and :func:`all_reduce_async` take one; the other collectives
    refuse it. A subclass defines :meth:`size` (the ranks that take part now) and
    :meth:`launch` (start the in-place all-reduce; return an object whose ``wait()``
    completes it)."""

    def size(self) -> int:
        raise NotImplementedError

    def launch(self, t: Tensor, op: str):
        raise NotImplementedError


def _plain(name: str, group) -> None:
    """Refuse an :class:`ExternalGroup` where only torch.distributed's groups will do."""
    if isinstance(group, ExternalGroup):
        raise ValueError(f"{name} needs a torch.distributed process group, got {type(group).__name__} "
                         "(it offers all_reduce only)")


def _launch(t: Tensor, op: str, group, async_op: bool):
    if isinstance(group, ExternalGroup):
        work = group.launch(t, op)
        return work if async_op else work.wait()
    return dist.all_reduce(t, op=REDUCE_OPS[op], group=group, async_op=async_op)


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


def _guarded(name: str, t: Tensor, step: Optional[int], call: Callable[[], object]) -> None:
    """Run ``call``; re-raise a backend failure as :class:`CollectiveError` with context.
    A tensor on a device the backend does not serve (a CPU tensor under NCCL) is a
    ``ValueError`` naming the device, not a dead peer."""
    t0 = time.perf_counter()
    try:
        call()
    except RuntimeError as exc:  # DistBackendError (a RuntimeError) on timeout / closed peer
        if _wrong_device(exc):
            raise ValueError(f"{name} got a tensor on {t.device} that the process group's backend does not "
                             f"serve ({exc}); every tensor a collective sees must be on the parameters' device"
                             ) from exc
        step = _STEP.get() if step is None else step
        where = f"at optimizer step {step}" if step is not None else "outside an optimizer step"
        nbytes = t.numel() * t.element_size()
        raise CollectiveError(
            f"{name} of {nbytes} bytes ({t.numel()} x {t.dtype}) {where} failed on rank "
            f"{dist.get_rank()} after {time.perf_counter() - t0:.1f} s: a peer died, stalled past the "
            f"process group's timeout, or the group is broken. Backend error: {exc}"
        ) from exc


def _wrong_device(exc: BaseException) -> bool:
    text = str(exc)
    return ("No backend type associated with device type" in text or "Tensors must be CUDA" in text
            or "must be on the same device" in text)


def all_reduce(t: Tensor, group=None, stats: CommStats | None = None, *, step: Optional[int] = None,
               op: str = "sum") -> Tensor:
    """In-place all-reduce of ``t`` (``op``: ``'sum'`` or ``'max'``)."""
    p = _size(group)
    t0 = clock(stats)
    _guarded("all_reduce", t, step, lambda: _launch(t, op, group, False))
    _record(stats, 2 * (p - 1) / p * t.numel() * t.element_size(), t0)
    return t


class Pending:
    """A collective in flight (:func:`all_reduce_async`, :func:`all_to_all_async`, :func:`all_gather_async`):
    :meth:`wait` completes it.

    Its bytes and count were recorded when it was launched; :meth:`wait` adds the time it
    blocks (the part of the collective that compute did not hide) to the ``stats`` it is
    given. A second :meth:`wait` returns at once."""

    def __init__(self, t: Tensor, work, step: Optional[int], name: str = "all_reduce", out: Optional[Tensor] = None):
        self.tensor, self._work, self._step, self._name = t, work, step, name
        self._out = t if out is None else out

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has completed it."""
        return self._work is None

    def ready(self) -> bool:
        """Whether :meth:`wait` would return at once (the backend's ``is_completed``: a query, no wait and no
        device synchronisation)."""
        return self._work is None or bool(self._work.is_completed())

    def wait(self, stats: CommStats | None = None) -> Tensor:
        """Block until the collective is complete; its result (the all-reduce's tensor, reduced in place; the
        all-to-all's or all-gather's output)."""
        if self._work is not None:
            t0 = clock(stats)
            _guarded(self._name, self.tensor, self._step, self._work.wait)
            self._work = None
            if stats is not None:
                stats.t_collective += clock(stats) - t0
        return self._out


def all_reduce_async(t: Tensor, group=None, stats: CommStats | None = None, *, step: Optional[int] = None,
                     op: str = "sum") -> Pending:
    """Launch the in-place all-reduce of ``t`` (``op``: ``'sum'`` or ``'max'``) and return at
    once: ``t`` must not be read or written until the returned :class:`Pending` is waited on.
    ``stats`` gets the bytes, the count and the launch time; a failure names the step it was
    launched in (``step``, else :func:`step_context`'s), whenever it surfaces."""
    p = _size(group)
    step = _STEP.get() if step is None else step
    t0 = clock(stats)
    works = []
    _guarded("all_reduce", t, step,
             lambda: works.append(_launch(t, op, group, True)))
    _record(stats, 2 * (p - 1) / p * t.numel() * t.element_size(), t0)
    return Pending(t, works[0], step)


def all_gather(t: Tensor, group=None, stats: CommStats | None = None, *, step: Optional[int] = None) -> Tensor:
    """Gather every rank's ``t`` (same shape) into a ``(P, *t.shape)`` tensor."""
    return all_gather_async(t, group, stats, step=step).wait(stats)


def all_gather_async(t: Tensor, group=None, stats: CommStats | None = None, *,
                     step: Optional[int] = None) -> Pending:
    """Launch :func:`all_gather` and return at once; ``wait()`` gives the ``(P, *t.shape)`` tensor. ``t`` must
    not be written until then."""
    _plain("all_gather", group)
    p = _size(group)
    step = _STEP.get() if step is None else step
    flat = t.contiguous().reshape(-1)
    out = torch.empty(p * t.numel(), dtype=t.dtype, device=t.device)
    t0 = clock(stats)
    works = []
    _guarded("all_gather", t, step, lambda: works.append(_all_gather_flat(out, flat, group=group, async_op=True)))
    _record(stats, (p - 1) * t.numel() * t.element_size(), t0)
    return Pending(flat, works[0], step, "all_gather", out.view((p,) + tuple(t.shape)))


def all_to_all(t: Tensor, group=None, stats: CommStats | None = None, *, step: Optional[int] = None) -> Tensor:
    """Split ``t`` (first dim divisible by P) into P parts; part j goes to rank j.

    Returns the received parts in rank order, same shape as ``t``.
    """
    return all_to_all_async(t, group, stats, step=step).wait(stats)


def all_to_all_async(t: Tensor, group=None, stats: CommStats | None = None, *,
                     step: Optional[int] = None) -> Pending:
    """Launch :func:`all_to_all` and return at once; ``wait()`` gives the received parts. ``t`` must not be
    written until then."""
    _plain("all_to_all", group)
    p = _size(group)
    step = _STEP.get() if step is None else step
    t = t.contiguous()
    out = torch.empty_like(t)
    t0 = clock(stats)
    works = []
    _guarded("all_to_all", t, step, lambda: works.append(dist.all_to_all_single(out, t, group=group, async_op=True)))
    _record(stats, (p - 1) / p * t.numel() * t.element_size(), t0)
    return Pending(t, works[0], step, "all_to_all", out)


def own_group(group, device: torch.device):
    """A process group of ``group``'s ranks (None: the world) for one user's collectives alone, so that what other
    code issues meanwhile on other groups never queues behind them. A set-up call, collective over ``group``:
    made by those ranks only, named after them (torch names such a group by its ranks, so two replica groups get
    two names; a group made on the world's counter would give both one name, and their collectives could meet).
    On CUDA its NCCL communicator is made here, by one barrier, not in the first collective. None when ``group``
    has one rank."""
    base = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(base)
    if len(ranks) == 1:
        return None
    local = len(ranks) < dist.get_world_size()
    made = dist.new_group(ranks, backend=dist.get_backend(base), use_local_synchronization=local)
    if device.type == "cuda":
        barrier(made, device)
    return made


def broadcast(t: Tensor, group=None, stats: CommStats | None = None, *, src: int = 0,
              step: Optional[int] = None) -> Tensor:
    """In place: every rank's ``t`` becomes that of ``group``'s rank ``src`` (a group rank)."""
    _plain("broadcast", group)
    p = _size(group)
    t0 = clock(stats)
    root = dist.get_global_rank(group, src) if group is not None else src
    _guarded("broadcast", t, step, lambda: dist.broadcast(t, src=root, group=group))
    _record(stats, (p - 1) / p * t.numel() * t.element_size(), t0)
    return t


BROADCAST_CHUNK = 1 << 22
"""Elements per set-up broadcast (:func:`broadcast_from_first`): 32 MiB of float64 at most, whatever the model."""


@torch.no_grad()
def broadcast_from_first(tensors: list[Tensor], group=None, chunk: int = BROADCAST_CHUNK) -> None:
    """In place: every rank's ``tensors`` become the group's first rank's, in float64 broadcasts (exact
    for every float dtype up to fp64, on the tensors' device) of at most ``chunk`` elements each: the
    transient is one chunk, not the model (a contiguous tensor larger than a chunk travels in slices).
    Collective."""
    for pieces in slices(tensors, chunk):
        flat = torch.empty(sum(b - a for _, a, b in pieces), dtype=torch.float64, device=pieces[0][0].device)
        broadcast(pack_slices(pieces, flat), group)
        unpack_slices(flat, pieces)


def _is_nccl(group) -> bool:
    """Whether ``group`` sends CUDA tensors through NCCL (``'nccl'`` or a ``'cuda:nccl'`` part)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return "nccl" in str(dist.get_backend(group)).lower()


def barrier(group=None, device: Optional[torch.device] = None) -> None:
    """A barrier over ``group``; under NCCL it names ``device`` (else NCCL guesses a GPU from
    the rank, which is wrong when a process does not own GPU ``rank``)."""
    if device is not None and torch.device(device).type == "cuda" and _is_nccl(group):
        index = torch.device(device).index
        dist.barrier(group=group, device_ids=[torch.cuda.current_device() if index is None else index])
    else:
        dist.barrier(group=group)


def _encode_object(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def all_gather_object(obj, group=None, device: Optional[torch.device] = None) -> list:
    """Every rank's ``obj`` (JSON-serialisable: lists, dicts, strings, numbers; tuples come
    back as lists), in rank order. Two gathers of bytes on ``device``; set-up only, never in
    a step. JSON, not pickle: bytes from a peer cannot run code here."""
    device = torch.device("cpu") if device is None else torch.device(device)
    raw = torch.tensor(list(_encode_object(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([raw.numel()], dtype=torch.int64).to(device)
    sizes = all_gather(size, group).reshape(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[:raw.numel()] = raw
    everyone = all_gather(padded, group).cpu()
    return [json.loads(bytes(everyone[r, :n].tolist()).decode()) for r, n in enumerate(sizes)]


def broadcast_object(obj, group=None, device: Optional[torch.device] = None, *, src: int = 0):
    """``group``'s rank ``src``'s ``obj`` (JSON-serialisable) on every rank; set-up only."""
    device = torch.device("cpu") if device is None else torch.device(device)
    mine = _encode_object(obj) if dist.get_rank(group) == src else b""
    size = torch.tensor([len(mine)], dtype=torch.int64).to(device)
    broadcast(size, group, src=src)
    n = int(size.item())
    buf = torch.zeros(n, dtype=torch.uint8, device=device)
    if mine:
        buf.copy_(torch.tensor(list(mine), dtype=torch.uint8))
    broadcast(buf, group, src=src)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def device_of(params, what: str = "parameter") -> torch.device:
    """The one device every tensor of ``params`` lives on (CPU for none). ``ValueError``
    naming the first tensor on another device: one optimizer communicates on one device."""
    first = None
    for i, p in enumerate(params):
        if first is None:
            first = (i, p.device)
        elif p.device != first[1]:
            raise ValueError(f"{what} {i} is on {p.device} but {what} {first[0]} is on {first[1]}; every "
                             f"{what} of one optimizer must be on one device (one optimizer per device)")
    return torch.device("cpu") if first is None else first[1]


def comm_device(params, group=None) -> torch.device:
    """The device the optimizer's collectives run on: the parameters' (:func:`device_of`).

    Under NCCL it must be a CUDA device and the current one, since NCCL's communicator
    and the object collectives follow ``torch.cuda.current_device()``; a ``ValueError``
    says what to do otherwise."""
    device = device_of(params)
    if _is_nccl(group):
        backend = str(dist.get_backend(group)).lower()
        if device.type != "cuda" and (backend == "nccl" or f"{device.type}:" not in backend):
            raise ValueError(f"the process group's backend is {backend!r} but the parameters are on {device}: "
                             "NCCL sends CUDA tensors only; move the model to cuda:LOCAL_RANK "
                             "(model.to(f'cuda:{local_rank}')) before building the optimizer")
        if device.type == "cuda":
            current = torch.cuda.current_device()
            if device.index is not None and device.index != current:
                raise ValueError(f"the parameters are on {device} but the current CUDA device is cuda:{current}; "
                                 "call torch.cuda.set_device(local_rank) before building the model and the "
                                 "optimizer (NCCL runs on the current device)")
    return device


_META_GENERATORS: "weakref.WeakSet[torch.Generator]" = weakref.WeakSet()


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (a CUDA generator for CUDA tensors, as
    ``torch.rand(..., device=cuda, generator=g)`` requires). ``meta`` tensors have no
    generators (no data to draw): a CPU generator stands in, which ``meta`` ops accept."""
    device = torch.device(device)
    if device.type == "meta":
        gen = torch.Generator().manual_seed(seed)
        _META_GENERATORS.add(gen)  # the device audit accepts these stand-ins, and only these
        return gen
    return torch.Generator(device=device).manual_seed(seed)


def restore_generator(gen: torch.Generator, state: Tensor) -> None:
    """``gen.set_state(state)`` from a saved state (a CPU byte tensor for every device's
    generator; one loaded onto another device is brought back). ``ValueError`` when the state
    is another kind of generator's (a CPU run's checkpoint resumed on CUDA, or back)."""
    state = state.detach().to("cpu", torch.uint8) if state.device.type != "meta" else state
    if gen.device.type == "meta" or state.device.type == "meta":
        return
    if state.numel() != gen.get_state().numel():
        raise ValueError(f"the saved generator state ({state.numel()} bytes) is not a {gen.device.type} generator's "
                         f"({gen.get_state().numel()} bytes): resume on the device type the run was saved on")
    gen.set_state(state)
