r"""Overlap the majority vote with backward (docs/design.md §9, §13).

Without overlap, :meth:`LionCub.step` computes every bucket's ``c``, votes and applies
after backward has finished: step time ≈ compute + comm. With overlap a bucket's vote
starts as soon as backward has produced its last gradient, so the votes of the late
layers travel while backward still computes the early ones: step time → max(compute,
comm) + the last bucket's vote.

Mechanism (one :class:`VoteDriver` per optimizer)::

    backward: grad of p accumulated ─► bucket b complete? ─► launch buckets in index order:
                 this rank's part of bucket b's message (BucketStep.encode_bucket, as
                 LionCub.step writes it), then the vote method's exchange (the collectives):
                 CUDA (and every device but the CPU): both in the hook, on the hook's
                   thread; the exchange under the driver's side stream, which first waits
                   on an event recorded on the hook's stream after the encode. NCCL only
                   enqueues: the hook returns at once, nothing waits for the device.
                 CPU: the exchange on one background FIFO thread (gloo blocks the caller
                   until a collective is done; torch ops and gloo release the GIL).
    step():   launch buckets not launched yet (params without a gradient vote as zeros)
              wait for every exchange (CPU: the thread's futures; CUDA: step's current stream
              waits on each vote's done-event, no host wait) ─► agree on active params /
              non-finite (as without overlap; :meth:`VoteDriver.finite` is this rank's finite
              flag from the encodes) ─► per bucket BucketStep.apply_bucket: θ ← θ(1-ηλ) - η·u,
              m ← β2·m + (1-β2)·g (the same encode and apply as without overlap)

Order: every rank launches buckets in the same order, bucket index order (like DDP: a bucket
that completes early waits for its predecessors), so the collectives line up by construction.
On CUDA they are enqueued by the one thread that runs the backward hooks, at points of its
program fixed by the bucket index, so their order relative to every other collective of the
job (DDP's, on other process groups) is the same on every rank too: no second host thread
issues NCCL calls. On the CPU the one FIFO thread is the only user of the votes' own process
group (see below), in submission order = index order.

No host sync in a hook: a hook only counts gradients, encodes (the fused encodes return their
finite flag as a Python bool or a 0-dim bool tensor on the device: kept, never read here) and
enqueues. On the CPU a quantizer reads its scale as a float (free there), so a quantized encode
(``quantizer`` other than None or ``'sign'``) does not run in the hook but on the vote thread
before the exchange (or, without the thread, at ``step()``, still in index order); on other
devices the scale stays a device tensor and the encode runs in the hook like any other.
A gradient changed after backward (after its bucket launched) is not seen by the vote.

:class:`Overlap` is the driver for ``LionCub(..., overlap=True)``: it hooks every
parameter with ``Tensor.register_post_accumulate_grad_hook`` and uses LionCub's own
buckets (``bucket_mb``). A bucket counts as complete when every parameter that had a
gradient in the previous step has one again (all parameters in the first step), so an
unused layer does not hold back the launches; a parameter that gets a gradient after
its bucket was launched raises ``RuntimeError``. :mod:`lioncub.ddp.hook` is the driver for DDP's buckets.
Bit-for-bit the same parameters as without overlap whenever every parameter has a
gradient on some rank and the vote is per element (all binary-sign votes); quantized
``pbit`` normalises per bucket, and a parameter with no gradient anywhere still takes
part in its bucket's scale (its update is still skipped).

The votes have their own process group (``dist.new_group`` over the optimizer's ranks, made
when the driver is created: a set-up call, by the group's ranks, named after them; on CUDA its NCCL
communicator is also created then, by one barrier, so no hook waits for it), so collectives
the main thread issues meanwhile on other groups — a logged loss — never share a queue with
the votes.

Gradient accumulation: run every micro-batch but the last under ``opt.no_sync()``;
only the last backward launches votes. A gradient accumulated after its bucket was
launched raises ``RuntimeError`` (the vote would miss it).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Union

import torch
from torch import Tensor

from .. import comm
from . import guard, shards
from ..comm import CommStats

__all__ = ["VoteDriver", "Overlap"]

THREADED_DEVICES = ("cpu",)
"""Device types whose exchanges run on the vote thread (gloo blocks the calling thread for
the whole collective). Every other device type (CUDA; ``meta`` under the device audit)
issues them from the hook itself, where NCCL only enqueues them."""

HOST_FREE_QUANTIZERS = (None, "sign")
"""Quantizers whose encode needs no number on the host (the others read their scale back:
``quantize.scale_norm``), so it may run inside a backward hook."""

Flag = Union[bool, Tensor, None]
"""A finite flag: a Python bool, a 0-dim bool tensor on the device (not read back), or None
(not checked by the encode)."""


class _VoteThread:
    """One daemon thread running submitted jobs strictly in FIFO order."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lioncub-vote", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # surfaced by step() through the future
                fut.set_exception(exc)

    def submit(self, fn: Callable) -> Future:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)


class _Vote:
    """One launched bucket: parameter indices, its own stats (no ``sync``: nothing in a hook
    synchronises), and once known its voted bytes and this rank's finite flag.

    ``future``: CPU, the vote thread's job, resolving to ``(voted, finite)``; ``done``: CUDA,
    the event after the vote's last kernel; ``waited``: the stream already made to wait on it."""

    __slots__ = ("idx", "stats", "future", "voted", "finite", "done", "waited")

    def __init__(self, idx: list[int], device: torch.device):
        # timed where the calls block (CPU); off the CPU never: a vote runs during backward, where a clock read
        # would need a sync (none is allowed there) and without one reads launch times, which must not be added
        # into a step timed with timing=True (docs/gpu.md)
        self.idx, self.stats = list(idx), comm.step_stats(device, None if device.type == "cpu" else False)
        self.future: Optional[Future] = None
        self.voted: Optional[Tensor] = None
        self.finite: Flag = None
        self.done = None
        self.waited = None


class VoteDriver:
    """Launches bucket votes asynchronously and applies them in ``LionCub.step``.

    Subclasses decide *when* a bucket (a list of parameter indices into
    ``opt.param_entries``) is launched, in the same order on every rank; this class does the
    launch, the wait and the apply, through the optimizer's public plan (``plan_bucket``) and
    ``bucket_step``. ``LionCub.step`` calls :meth:`finish_votes`, then (for the agreement)
    :meth:`finite`, then :meth:`apply` or :meth:`discard`.
    """

    def __init__(self, opt):
        if not callable(getattr(opt, "attach_driver", None)):
            raise TypeError(f"optimizer must be a lioncub.LionCub, got {type(opt).__name__}")
        if opt.vote == "grad":
            raise ValueError("vote='grad' has nothing to overlap here; use DDP's own allreduce for the baseline")
        opt.attach_driver(self)  # refuses an optimizer already driven
        self.opt = opt
        self.n_params = len(opt.param_entries)
        self._index = {id(p): i for i, (_, p) in enumerate(opt.param_entries)}
        self.device = comm.device_of([p for _, p in opt.param_entries])
        self._cuda = self.device.type == "cuda"  # every torch.cuda call below is behind this
        # the votes' own process group (two replica groups, as under HSDP, get two: comm.own_group)
        self.group = comm.own_group(opt.group, self.device) if opt.world_size > 1 else None
        self._thread = _VoteThread() if self.device.type in THREADED_DEVICES else None
        self._side = None  # CUDA: the stream the exchanges run on (made on first use)
        self._applied = None  # CUDA: event after the last step's apply (or discard)
        self._pending: list[_Vote] = []
        self._deferred: list[list[int]] = []  # launches asked for in a hook, run by step()
        self._stepping = False
        self.accumulating = False

    # ---------------------------------------------------------------- launching
    def _host_encode(self) -> bool:
        """Whether this step's encode reads a number back to the host (not in a hook)."""
        # off the CPU a quantizer keeps its scale on the device (lioncub.quantize): no host read
        return (self.opt.world_size > 1 and self.opt.device.type == "cpu"
                and getattr(self.opt.method, "quantizer", None) not in HOST_FREE_QUANTIZERS)

    def launch(self, idx: list[int]) -> None:
        """Launch the vote of params ``idx`` (called in launch order, the same on every rank).
        World size 1: c's sign, no message. Where the encode needs the host and there is no
        vote thread, the launch waits for step() (:meth:`finish_votes`), in the same order."""
        if not self._stepping and self._thread is None and self._host_encode():
            self._deferred.append(list(idx))
            return
        self._start(idx)

    def _start(self, idx: list[int]) -> None:
        opt, run = self.opt, self.opt.bucket_step
        bucket = opt.plan_bucket(idx)
        vote = _Vote(idx, self.device)
        step, k = opt.steps, len(self._pending)  # one buffer per in-flight vote
        self._pending.append(vote)
        caller = torch.cuda.current_stream(self.device) if self._cuda else None  # the hook's stream
        if caller is not None and self._applied is not None:
            caller.wait_event(self._applied)  # the last apply (maybe another stream) read m, g, buffers
        if opt.world_size == 1:
            with torch.no_grad():
                vote.voted = run.bucket_c(bucket, vote.stats, key=("launch", k)).sign_()
            vote.done = self._record(caller)
            return
        method = opt.method
        m = method.part_nbytes(bucket.numel)
        buf = run.buffer(("launch", k), method.message_nbytes(m), torch.uint8, bucket.device)
        buf[m:].zero_()

        def encode() -> Flag:
            with torch.no_grad():
                return run.encode_bucket(bucket, buf[:m], step, vote.stats)

        def exchange() -> Tensor:
            with comm.step_context(step), torch.no_grad():
                return method.exchange(buf, m, step, self.group, vote.stats)

        if self._thread is not None:  # CPU: the collectives (and a host-reading encode) on the thread
            if self._host_encode():
                def job():
                    finite = encode()
                    return exchange(), finite
            else:
                finite = encode()  # here: the thread's next job may reuse no scratch of ours

                def job():
                    return exchange(), finite
            vote.future = self._thread.submit(job)
            return
        vote.finite = encode()  # on the hook's stream, where the gradients were made
        if caller is None:  # no streams (meta under the device audit)
            vote.voted = exchange()
            return
        side = self._side_stream()
        side.wait_event(self._record(caller))  # the collective reads the message after the encode
        buf.record_stream(side)  # made on the caller's stream, used on ours
        with torch.cuda.stream(side):
            vote.voted = exchange()
            vote.done = self._record(side)

    def _side_stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    @staticmethod
    def _record(stream):
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def launch_rest(self) -> None:
        """Launch what backward did not (called by step(), before waiting)."""

    def reset(self) -> None:
        """Per-step bookkeeping back to 'nothing launched'."""

    # ---------------------------------------------------------------- LionCub.step
    def _settle(self, vote: _Vote, raise_errors: bool = True) -> None:
        """The vote's bytes ready for the caller: CPU, its thread job done (its error raised
        here, on the main thread); CUDA, the caller's current stream waits on its done-event
        (no host wait) and its tensors are marked as used there (caching allocator)."""
        if vote.future is not None:
            if not raise_errors and vote.future.exception() is not None:
                return
            vote.voted, vote.finite = vote.future.result()
            vote.future = None
        if vote.done is not None:
            current = torch.cuda.current_stream(self.device)
            if vote.waited != current:
                current.wait_event(vote.done)
                for t in (vote.voted, vote.finite):
                    if isinstance(t, Tensor) and t.is_cuda:
                        t.record_stream(current)
                vote.waited = current

    def finish_votes(self, stats: CommStats) -> None:
        """Launch the launches backward left (deferred ones first, then the rest, in order),
        and make every vote's result ready for the caller (:meth:`_settle`)."""
        self._stepping = True
        try:
            deferred, self._deferred = self._deferred, []
            for idx in deferred:
                self._start(idx)
            self.launch_rest()
        finally:
            self._stepping = False
        for vote in self._pending:
            self._settle(vote)
            stats.add(vote.stats)

    def finite(self) -> Flag:
        """This rank's answer to "are all gradients finite?" from this step's encodes, without
        a host sync: the AND of every launched bucket's flag — a bool, a 0-dim bool tensor on
        the device, or None when some gradients were not checked (an encode on the torch ops,
        world size 1, a parameter in no launched bucket): the caller checks them itself. Call
        after :meth:`finish_votes`."""
        if not self._pending or self._deferred or sum(len(v.idx) for v in self._pending) < self.n_params:
            return None
        for vote in self._pending:
            self._settle(vote)
        return guard.all_finite(*(v.finite for v in self._pending))

    def apply(self, active: list[bool], stats: CommStats) -> None:
        opt, run = self.opt, self.opt.bucket_step
        for vote in self._pending:  # all first: a vote thread's encode may still use the scratch
            self._settle(vote)  # CUDA: the current stream waits on the exchange before reading it
        for vote in self._pending:
            idx, voted = vote.idx, vote.voted
            bucket = opt.plan_bucket(idx)
            keep = [k for k, i in enumerate(idx) if active[i]]  # no gradient on any rank: skipped
            if opt.world_size > 1:
                run.apply_bucket(bucket, voted, 0, stats, keep)
            elif keep:
                pieces = voted.split(bucket.sizes)
                run.apply_u(bucket.only(keep), torch.cat([pieces[k] for k in keep]), stats)
        self._finish()

    def discard(self) -> None:
        """Drop this step's votes (the step is skipped); waits for them first."""
        for vote in self._pending:
            self._settle(vote, raise_errors=False)
        self._deferred = []
        self._finish()

    def _finish(self) -> None:
        if self._cuda and self._pending:  # the next launches wait for what this stream did
            self._applied = self._record(torch.cuda.current_stream(self.device))
        self._pending = []
        self.reset()

    # ---------------------------------------------------------------- user API
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without launching votes."""
        prev, self.accumulating = self.accumulating, True
        try:
            yield
        finally:
            self.accumulating = prev

    def remove_hooks(self) -> None:
        """Detach from the optimizer; its step() votes after backward again."""
        if self._pending or self._deferred:
            self.discard()
        self.opt.detach_driver(self)
        if self._thread is not None:
            self._thread.close()


class Overlap(VoteDriver):
    """``LionCub(..., overlap=True)``: votes LionCub's buckets from post-accumulate-grad hooks."""

    def __init__(self, opt):
        super().__init__(opt)
        self.buckets = [b.index for b in opt.buckets]
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        sharding = opt.sharding  # FSDP2: its sharded parameters' hooks run once their gradient is reduce-scattered
        hooked = [p for _, p in opt.param_entries] if sharding is None else [
            sharding.param_of(p) for _, p in opt.param_entries]
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i, sharding))
                         for i, p in enumerate(hooked)]
        self.reset()

    def _make_hook(self, i: int, sharding=None):
        local = self.opt.param_entries[i][1]

        def hook(p: torch.Tensor) -> None:
            if self.accumulating:
                return
            if sharding is not None:  # the local shard holds its gradient for the encode
                local.grad = shards.local_of(p.grad)
            if self._seen[i]:
                raise RuntimeError(
                    f"parameter {i} received a second gradient after its bucket's vote was launched; "
                    "run all micro-batches but the last under `with opt.no_sync():`")
            self._seen[i] = True
            b = self._bucket_of[i]
            if b < self._next:  # launched without this gradient (none came last step): raised by every rank in
                self.late = self.late or (  # step(), once all agree (a raise here would be this rank's alone)
                    f"overlap: parameter {i} got a gradient after its bucket's vote was launched: it had none "
                    "in the previous step, so backward did not wait for it; with overlap=True every "
                    "rank's set of parameters that receive gradients must not grow between steps")
                return
            if self._expect[i]:
                self._missing[b] -= 1
                if self._missing[b] == 0:
                    self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self.launch(self.buckets[self._next])
            self._next += 1

    def launch_rest(self) -> None:
        while self._next < len(self.buckets):  # index order on every rank
            self.launch(self.buckets[self._next])
            self._next += 1

    def reset(self) -> None:
        # A bucket is complete when every param that had a gradient last step has one
        # again (all params at first): an unused layer does not hold back the launches.
        # Only *when* a bucket launches depends on this; what it votes and the order of
        # the launches are the same on every rank.
        self.late = None  # what a hook saw arrive too late this step (raised in step() on every rank)
        seen = getattr(self, "_seen", None)
        self._expect = list(seen) if seen is not None and any(seen) else [True] * self.n_params
        self._seen = [False] * self.n_params
        self._missing = [sum(self._expect[i] for i in b) for b in self.buckets]
        self._next = 0

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        super().remove_hooks()
