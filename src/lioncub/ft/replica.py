"""The replica role of ``lioncub train --ft`` (:mod:`lioncub.ft.train` is the supervisor's): one replica group's rank,
``lioncub train --ft-replica K [--ft-rank R --nproc-per-replica N]``, training with :class:`FTLocalCub` (or
:class:`FTLionCub`) across the replica groups through the lighthouse, and logging its committed rounds."""
from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import timedelta
from typing import Optional

import torch

from .. import comm
from .train import STARTUP_S

def params_digest(params) -> str:
    """A hash of this rank's parameters (its own shards, when the model is FSDP2-sharded over its replica group; the
    whole model with a node mean inside it)."""
    from ..engine.shards import local_of

    flat = torch.cat([local_of(p).detach().reshape(-1).float().cpu() for p in params])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def replica_main(config, replica: int, replicas: int, lighthouse: str, *, host: str = "127.0.0.1",
                 deadline: Optional[float] = None, min_replicas: int = 2, timeout_s: float = 10.0,
                 faults=(), standby: bool = False, stop_round: Optional[int] = None, rank: int = 0, ranks: int = 1,
                 group_port: int = 0, ready_dir: Optional[str] = None, inside: str = "fsdp2") -> int:
    """One replica's run (see the module docstring); returns the exit code. ``deadline``: the
    wall time after which it asks to stop; None: ``config.time_budget`` seconds after it joined
    (the replicas of a fresh start join at the same commit). ``faults``: the
    :class:`~lioncub.ft.faults.Fault` s to arm (this replica's only fire). ``standby``: a warm spare
    (:mod:`lioncub.ft.spare`): everything before the Manager is made, then wait to be activated. ``stop_round``:
    also ask to stop at a commit of that round or later whose quorum holds all ``replicas``. ``rank`` of ``ranks``:
    this process's rank in its replica group of ``ranks`` ranks, the group's own torch.distributed world (its
    rendezvous at ``host:group_port``; one worker when ``ranks`` is 1), the model FSDP2-sharded over it, the data
    shard of worker ``replica * ranks + rank``; its faults armed on the group's last rank, its log written by rank 0
    (the final line with every rank's hash, ``digests``). ``ready_dir``: a fresh start's barrier (the supervisor's,
    first lives only): every rank of every replica marks itself there once its Manager is made and waits for all
    of them before its first quorum, so that none forms without a replica still starting (a lighthouse forms one
    as soon as ``min_replicas`` ask). ``inside``: with ``ranks`` > 1, ``'fsdp2'`` (the model sharded over the group)
    or ``'mean'`` (every rank the whole model, each step's gradients averaged over the group: a node mean)."""
    import importlib

    import torch.distributed as dist

    from ..harness.models import build_model, param_groups
    from ..harness.train import _Data, batch_loss, evaluate, lane_options, lr_factor
    from . import make_manager
    from .. import LionCub, LocalCub
    from ..optim.flags import round_kwargs, step_kwargs

    device = torch.device("cpu")
    if ranks == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the harness's world of one
    else:  # the replica group's own world (NCCL for CUDA parameters), its rendezvous on the group's host
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://{host}:{group_port}",
                                rank=rank, world_size=ranks, timeout=timedelta(seconds=max(60.0, 4 * timeout_s)))
    worker = replica * ranks + rank
    torch.manual_seed(config.seed)
    data = _Data(config, worker, replicas * ranks, device)
    model = build_model(config, data.info).to(device)
    if ranks > 1 and inside == "fsdp2":  # ('mean': plain copies, whose gradients the optimizer averages)
        shard_model(model, device, ranks)
    torch.manual_seed(config.seed + 1000 + worker)
    groups = param_groups(model, lr=config.lr, weight_decay=config.weight_decay, lr_embed=config.lr_embed,
                          lr_head=config.lr_head)
    base_lrs = [g["lr"] for g in groups]
    if standby:  # a warm spare: ready up to its Manager, which would take the lost replica's place in the quorum
        from .spare import wait_for_activation

        importlib.import_module("torch._dynamo")  # the first torch Optimizer() imports it: ~2 s, spent before the wait
        _warm_up(model, data, lambda x, y: batch_loss(model, x.to(device), y.to(device), config.is_gpt)[0])
        deadline = wait_for_activation()
    manager = make_manager(str(replica), lighthouse, min_replicas=min_replicas, host=host, timeout_s=timeout_s,
                           quorum_timeout_s=max(60.0, 4 * timeout_s), device=device)
    if config.local_steps == 1:  # LionCub's vote every step, a quorum per step
        opt = LionCub(groups, lr=config.lr, betas=config.betas, **step_kwargs(dict(
            manager=manager, vote=config.vote, tie=config.tie, seed=config.seed, model=model,
            nonfinite=config.nonfinite, **lane_options(config))))
    else:
        opt = LocalCub(groups, lr=config.lr, betas=config.betas, **round_kwargs(dict(
            manager=manager, local_steps=config.local_steps, inner=config.inner, vote=config.vote,
            outer=config.outer, outer_lr=config.outer_lr, error_feedback=config.error_feedback,
            aggregate=config.aggregate, model=model, nonfinite=config.nonfinite, **lane_options(config))))
    from .faults import install

    install(opt, faults if rank == ranks - 1 else (), replica)  # a group's failure: its last rank's
    os.makedirs(config.out, exist_ok=True)
    log = open(os.path.join(config.out, f"replica_{replica}.jsonl"), "a") if rank == 0 else None
    params = [p for g in groups for p in g["params"]]

    def write(kind: str, **rec) -> None:
        if log is None:  # the group's log is its rank 0's
            return
        log.write(json.dumps(dict(kind=kind, replica=replica, pid=os.getpid(), wall=time.time(), **rec)) + "\n")
        log.flush()

    def committed(loss: Optional[float]) -> None:
        s = opt.last_round_stats
        write("round", round=opt.rounds, participants=opt.participants, contributors=opt.contributors,
              uncommitted=opt.uncommitted, heals=opt.heals, stall=opt.last_stall_s, loss=loss,
              bytes_sent=s.bytes_sent)
        everyone = stop_round is not None and opt.rounds >= stop_round and opt.participants == replicas
        if everyone or time.time() >= stop_at:
            opt.stop_requested = True

    straggler = None
    if config.slow_workers or config.pause_workers:  # the testbed's slower replica (lioncub.testbed.straggler)
        from ..testbed.straggler import Straggler

        straggler = Straggler.for_rank(replica, config.slow_workers, config.pause_workers)
    write("start")
    if ready_dir is not None:
        _ready(ready_dir, f"{replica}_{rank}", replicas * ranks)
    model.train()
    before = opt.rounds
    opt.join()  # the quorum, and a heal when this replica (re)joins a running job
    if opt.rounds != before:  # healed into a running job: its shard continues where a replica that never
        data.loader.seek(opt.rounds * opt.H)  # stopped would read, not from the start
    write("joined", round=opt.rounds, heals=opt.heals, participants=opt.participants, data=data.loader.state_dict())
    stop_at = deadline if deadline is not None else time.time() + config.time_budget
    if opt.rounds != before:
        committed(None)
    began = time.perf_counter()  # a pause's clock: this life's seconds since it joined, its pauses taken out
    while not opt.stop_agreed:
        step = opt.rounds * opt.H + opt.local_step
        scale = lr_factor(step, config)
        for g, base in zip(opt.param_groups, base_lrs):
            g["lr"] = base * scale
        x, y = data.loader.next_batch()
        t0 = time.perf_counter()
        loss, _ = batch_loss(model, x.to(device), y.to(device), config.is_gpt)
        loss.backward()
        if straggler is not None:
            now = time.perf_counter()
            straggler.after_backward(now - t0, now - began)
        before = opt.rounds
        opt.step()
        opt.zero_grad(set_to_none=True)
        if opt.rounds != before:
            committed(float(loss.detach()))
    scores = evaluate(model, data.val, config.is_gpt, device)
    digests = [params_digest(params)] if ranks == 1 else comm.all_gather_object(params_digest(params), device=device)
    write("final", round=opt.rounds, digest=digests[0], **({"digests": digests} if ranks > 1 else {}), **scores,
          **({"straggler": dict(straggler.totals(), train_s=time.perf_counter() - began)} if straggler else {}))
    if log is not None:
        log.close()
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return 0



def _ready(folder: str, me: str, count: int) -> None:
    """Mark ``me`` ready in ``folder`` and wait until ``count`` are (at most ``4 * STARTUP_S``: a replica that
    fails to start is the supervisor's to report)."""
    open(os.path.join(folder, me), "w").close()
    end = time.time() + 4 * STARTUP_S
    while len(os.listdir(folder)) < count and time.time() < end:
        time.sleep(0.05)


def shard_model(model, device, ranks: int) -> None:
    """FSDP2 over the replica group's world (a 1-D mesh of its ``ranks``): each of ``model.blocks`` (a transformer's)
    its own unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (ranks,))
    for block in getattr(model, "blocks", ()):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _warm_up(model, data, loss_of) -> None:
    """A spare's forward and backward on its first batch before it waits (the first step's allocations and
    one-time set-up, off the path back), leaving no trace: the gradients dropped, the buffers (a norm's running
    statistics), the loader and torch's random state as they were."""
    rng, position = torch.get_rng_state(), data.loader.state_dict()
    buffers = [b.detach().clone() for b in model.buffers()]
    loss_of(*data.loader.next_batch()).backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for b, kept in zip(model.buffers(), buffers):
            b.copy_(kept)
    data.loader.load_state_dict(position)
    torch.set_rng_state(rng)
