r"""Lion Cub under ``torch.nn.parallel.DistributedDataParallel``: a communication hook.

DDP all-reduces fp32 gradients bucket by bucket during backward. With
:func:`register` DDP sends Lion Cub's vote instead, in DDP's own buckets and at
DDP's own moments (each bucket as soon as its gradients are ready, buckets in
index order on every rank)::

    hook(bucket):  encode this rank's part from c = β1·m_i + (1-β1)·g_i (local g_i),
                   as LionCub.step does     (the :class:`~lioncub.engine.overlap.VoteDriver` launch)
                   issue its exchange (no fp32 allreduce): CUDA, enqueued from the hook
                   on the driver's side stream; CPU, on the driver's FIFO thread
                   return the bucket unchanged    → p.grad stays the LOCAL gradient
    opt.step():    wait for the votes; θ ← θ(1-ηλ) - η·u;  m_i ← β2·m_i + (1-β2)·g_i

DDP writes the hook's returned tensor into ``p.grad``; returning the local gradient
keeps what the local momentum needs there, and the agreed ``u`` waits in the
driver until ``step()``. So the training loop does not change, DDP's ``no_sync()``
gradient accumulation works as usual (DDP calls no hook inside it), and for
every binary-sign vote the parameters are bit-identical to LionCub without DDP
(quantized ``pbit`` normalises per bucket, and DDP's buckets differ from LionCub's).

Order and streams (docs/design.md §13): DDP calls the hook from its reducer during backward,
bucket by bucket in DDP's bucket index order (the same on every rank: DDP broadcasts its
bucket assignment), and the hook launches each vote at once, so the votes' collectives follow
DDP's bucket order. On CUDA they are enqueued by the thread DDP calls the hook on, the thread
that also enqueues DDP's own backward collectives (the unused-parameter map, after the last
bucket), so the order of both process groups' NCCL calls is the same on every rank. The hook
never waits for the device: the encode runs on the hook's current stream (the gradients'), the
exchange on a side stream that waits on an event recorded after it, the returned future is
device-aware (``Future(devices=[...])``: DDP's wait makes its stream wait, no host wait), and
the finite flag of the encode is kept for ``step()``, not read. A quantizer's scale stays on the
device off the CPU, so quantized encodes run in the hook too; on the CPU (where the scale is
read as a float) they run on the vote thread. A ``GradScaler`` is refused under the hook: the
votes would be encoded from the scaled gradients (use bf16 autocast).

Gradient clipping between backward and ``step()`` (HF Trainer's ``max_grad_norm``)
would reach the momentum but not the vote, which ran during backward: turn it off
(:func:`attach_to_trainer` refuses it). Lion's update is a sign and needs no clipping.

Example (``torchrun --nproc-per-node 4 train.py``)::

    model = DDP(Net())
    opt = lioncub.LionCub(model.parameters(), lr=3e-4, aggregation=lioncub.SignVote())
    lioncub.ddp.hook.register(model, opt)
    for x, y in loader:
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..engine.overlap import VoteDriver

__all__ = ["DDPVote", "lioncub_comm_hook", "register", "attach_to_trainer"]


class DDPVote(VoteDriver):
    """State of the DDP comm hook: launches a vote per DDP bucket, applies in step()."""

    def __init__(self, opt, ddp_model: DistributedDataParallel):
        from ..optim.nodecub import NodeCub  # here, not at import: the hook needs hierarchy only for this check

        if isinstance(opt, NodeCub):  # it has no attach_driver either; say why rather than "not a LionCub"
            raise TypeError("opt is a NodeCub: the DDP hook drives a LionCub only, and NodeCub averages "
                            "inside the node itself (use NodeCub without DDP)")
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"ddp_model must be a DistributedDataParallel, got {type(ddp_model).__name__}")
        if getattr(ddp_model, "_lioncub_vote", None) is not None:
            raise ValueError("a Lion Cub comm hook is already registered on this DDP model "
                             "(DDP accepts one comm hook per model)")
        super().__init__(opt)  # checks opt; refuses an optimizer already driven
        try:
            ours = set(self._index)
            theirs = [p for p in ddp_model.parameters() if p.requires_grad]
            missing = sum(id(p) not in ours for p in theirs)
            if missing:
                raise ValueError(f"optimizer does not hold {missing} of the DDP model's {len(theirs)} "
                                 "trainable parameters: build LionCub from ddp_model.parameters()")
            ws = dist.get_world_size(ddp_model.process_group)
            if ws != opt.world_size:
                raise ValueError(f"DDP's process group has {ws} ranks but the optimizer's has {opt.world_size}")
        except BaseException:
            self.remove_hooks()
            raise
        self.ddp_model = ddp_model
        self.reset()

    def on_bucket(self, bucket) -> torch.futures.Future:
        idx = []
        for p in bucket.parameters():
            i = self._index.get(id(p))
            if i is None:
                raise ValueError("DDP bucket holds a parameter this LionCub does not optimize")
            idx.append(i)
        if self.accumulating:  # opt.no_sync() used instead of ddp.no_sync(): DDP still syncs
            raise RuntimeError("use the DDP model's no_sync() for gradient accumulation under DDP")
        self.launch(idx)  # DDP's bucket order; enqueues only (no host sync, see the module doc)
        self._covered.update(idx)
        buffer = bucket.buffer()
        # CUDA: a device-aware future (an event on the current stream; whoever waits, waits on
        # the device, not the host); elsewhere a plain one, as before
        fut: torch.futures.Future = (torch.futures.Future(devices=[buffer.device]) if buffer.device.type == "cuda"
                                     else torch.futures.Future())
        fut.set_result(buffer)  # unchanged: p.grad keeps the local gradient
        return fut

    def launch_rest(self) -> None:
        rest = [i for i in range(self.n_params) if i not in self._covered]
        if rest and self._pending:  # params outside DDP (same set on every rank)
            self.launch(rest)
            self._covered.update(rest)

    def reset(self) -> None:
        self._covered: set[int] = set()

    def remove_hooks(self) -> None:
        """Detach from the optimizer (DDP cannot unregister a comm hook: drop the DDP model too)."""
        model = getattr(self, "ddp_model", None)
        if model is not None and getattr(model, "_lioncub_vote", None) is self:
            model._lioncub_vote = None
        super().remove_hooks()


def lioncub_comm_hook(state, bucket):
    """DDP comm hook: ``ddp_model.register_comm_hook(DDPVote(opt, ddp_model), lioncub_comm_hook)``.

    ``state``: a :class:`DDPVote`; ``bucket``: ``dist.GradBucket``; returns a completed
    ``Future`` of the bucket's (unchanged, local) gradients. Not annotated: DDP checks
    annotations by identity and this module's are strings (``from __future__``)."""
    return state.on_bucket(bucket)


def register(ddp_model: DistributedDataParallel, opt) -> DDPVote:
    """Make ``ddp_model`` send ``opt``'s vote instead of all-reducing gradients.

    ``opt`` must be a :class:`lioncub.LionCub` (not ``vote='grad'``) over all of
    ``ddp_model``'s trainable parameters, on a process group of the same size.
    Registering twice, or an optimizer that is already hooked, raises ``ValueError``.
    """
    state = DDPVote(opt, ddp_model)
    try:
        ddp_model.register_comm_hook(state, lioncub_comm_hook)
    except BaseException:
        state.remove_hooks()
        raise
    ddp_model._lioncub_vote = state
    return state


def attach_to_trainer(trainer, opt) -> None:
    """HF ``Trainer(..., optimizers=(opt, sched))``: register the hook once the Trainer
    has wrapped the model in DDP (at ``on_train_begin``). Needs ``max_grad_norm=0``."""
    try:
        from transformers import TrainerCallback
    except ImportError as exc:  # optional dependency
        raise ImportError("attach_to_trainer needs `transformers` (pip install transformers)") from exc
    if getattr(trainer.args, "max_grad_norm", 0) and trainer.args.max_grad_norm > 0:
        raise ValueError(f"TrainingArguments.max_grad_norm={trainer.args.max_grad_norm}: the vote runs during "
                         "backward, before the Trainer clips; set max_grad_norm=0")

    class _Register(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            wrapped = trainer.model_wrapped
            if isinstance(wrapped, DistributedDataParallel):
                if getattr(wrapped, "_lioncub_vote", None) is None:
                    register(wrapped, opt)
            elif opt.world_size > 1:
                raise RuntimeError(f"Trainer did not wrap the model in DDP (got {type(wrapped).__name__})")

    trainer.add_callback(_Register())
