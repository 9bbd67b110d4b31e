r"""Overlap the majority vote with backward (docs/design.md §9).

Without overlap, :meth:`LionCub.step` computes every bucket's ``c``, votes and applies
after backward has finished: step time ≈ compute + comm. With overlap a bucket's vote
starts as soon as backward has produced its last gradient, so the votes of the late
layers travel while backward still computes the early ones: step time → max(compute,
comm) + the last bucket's vote.

Mechanism (one :class:`VoteDriver` per optimizer)::

    backward: grad of p accumulated ─► bucket b complete? ─► launch buckets in index order:
                 this rank's part of bucket b's message (BucketStep.encode_bucket, as
                 LionCub.step writes it; caller thread)
                 submit the vote method's exchange (the collectives) to one background
                 thread (FIFO; torch ops and gloo release the GIL)
    step():   launch buckets not launched yet (params without a gradient vote as zeros)
              wait for every exchange ─► agree on active params / non-finite (as without
              overlap) ─► per bucket BucketStep.apply_bucket: θ ← θ(1-ηλ) - η·u,
              m ← β2·m + (1-β2)·g (the same encode and apply as without overlap)

Every rank launches buckets in the same order (bucket index order, like DDP: a bucket
that completes early waits for its predecessors), so the collectives line up. All
votes of a step run on the one FIFO thread, on the driver's own process group.

:class:`Overlap` is the driver for ``LionCub(..., overlap=True)``: it hooks every
parameter with ``Tensor.register_post_accumulate_grad_hook`` and uses LionCub's own
buckets (``bucket_mb``). A bucket counts as complete when every parameter that had a
gradient in the previous step has one again (all parameters in the first step), so an
unused layer does not hold back the launches; a parameter that gets a gradient after
its bucket was launched raises ``RuntimeError``. :mod:`lioncub.ddp_hook` is the driver for DDP's buckets.
Bit-for-bit the same parameters as without overlap whenever every parameter has a
gradient on some rank and the vote is per element (all binary-sign votes); quantized
``pbit`` normalises per bucket, and a parameter with no gradient anywhere still takes
part in its bucket's scale (its update is still skipped).

The vote thread has its own process group (``dist.new_group`` over the optimizer's
ranks, made when the driver is created: a collective call), so collectives the main
thread issues meanwhile — DDP's unused-parameter all-reduce, a logged loss — cannot
interleave with the votes and disagree on their order across ranks.

Gradient accumulation: run every micro-batch but the last under ``opt.no_sync()``;
only the last backward launches votes. A gradient accumulated after its bucket was
launched raises ``RuntimeError`` (the vote would miss it).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from . import comm
from .comm import CommStats

__all__ = ["VoteDriver", "Overlap"]


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


class VoteDriver:
    """Launches bucket votes asynchronously and applies them in ``LionCub.step``.

    Subclasses decide *when* a bucket (a list of parameter indices into
    ``opt.param_entries``) is launched; this class does the launch, the wait and the apply,
    through the optimizer's public plan (``plan_bucket``) and ``bucket_step``.
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
        self.group = None  # the votes' own process group: no race with main-thread collectives
        if opt.world_size > 1:
            base = opt.group if opt.group is not None else dist.group.WORLD
            self.group = dist.new_group(dist.get_process_group_ranks(base), backend=dist.get_backend(base))
        self._thread = _VoteThread()
        self._pending: list[tuple[list[int], Future, CommStats]] = []
        self.accumulating = False

    # ---------------------------------------------------------------- launching
    def launch(self, idx: list[int]) -> None:
        """Encode params ``idx`` now (this rank's part: one message per bucket) and queue
        the exchange. World size 1: c's sign, no message."""
        opt, run = self.opt, self.opt.bucket_step
        bucket = opt.plan_bucket(idx)
        stats = CommStats()
        step, k = opt.steps, len(self._pending)  # one buffer per in-flight vote
        if opt.world_size == 1:
            with torch.no_grad():
                flat = run.bucket_c(bucket, stats, key=("launch", k)).sign_()
            self._pending.append((idx, self._thread.submit(lambda: flat), stats))
            return
        method = opt.method
        m = method.part_nbytes(bucket.numel)
        buf = run.buffer(("launch", k), method.message_nbytes(m), torch.uint8, bucket.device)
        buf[m:].zero_()
        with torch.no_grad():
            run.encode_bucket(bucket, buf[:m], step, stats)  # done here: "c" is free again

        def vote():
            with comm.step_context(step), torch.no_grad():
                return method.exchange(buf, m, step, self.group, stats)

        self._pending.append((idx, self._thread.submit(vote), stats))

    def launch_rest(self) -> None:
        """Launch what backward did not (called by step(), before waiting)."""

    def reset(self) -> None:
        """Per-step bookkeeping back to 'nothing launched'."""

    # ---------------------------------------------------------------- LionCub.step
    def finish_votes(self, stats: CommStats) -> None:
        self.launch_rest()
        for _, fut, st in self._pending:
            fut.result()  # re-raises a failed vote here, on the main thread
            stats.add(st)

    def apply(self, active: list[bool], stats: CommStats) -> None:
        opt, run = self.opt, self.opt.bucket_step
        for idx, fut, _ in self._pending:
            voted = fut.result()
            bucket = opt.plan_bucket(idx)
            keep = [k for k, i in enumerate(idx) if active[i]]  # no gradient on any rank: skipped
            if opt.world_size > 1:
                run.apply_bucket(bucket, voted, 0, stats, keep)
            elif keep:
                pieces = voted.split(bucket.sizes)
                run.apply_u(bucket.only(keep), torch.cat([pieces[k] for k in keep]), stats)
        self._pending = []
        self.reset()

    def discard(self) -> None:
        """Drop this step's votes (the step is skipped); waits for them first."""
        for _, fut, _ in self._pending:
            fut.exception()
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
        if self._pending:
            self.discard()
        self.opt.detach_driver(self)
        self._thread.close()


class Overlap(VoteDriver):
    """``LionCub(..., overlap=True)``: votes LionCub's buckets from post-accumulate-grad hooks."""

    def __init__(self, opt):
        super().__init__(opt)
        self.buckets = [b.index for b in opt.buckets]
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                         for i, (_, p) in enumerate(opt.param_entries)]
        self.reset()

    def _make_hook(self, i: int):
        def hook(_p: torch.Tensor) -> None:
            if self.accumulating:
                return
            if self._seen[i]:
                raise RuntimeError(
                    f"parameter {i} received a second gradient after its bucket's vote was launched; "
                    "run all micro-batches but the last under `with opt.no_sync():`")
            self._seen[i] = True
            b = self._bucket_of[i]
            if b < self._next:  # launched without this gradient (none came last step)
                raise RuntimeError(
                    f"parameter {i} got a gradient after its bucket's vote was launched: it had none "
                    "in the previous step, so backward did not wait for it; with overlap=True every "
                    "rank's set of parameters that receive gradients must not grow between steps")
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
