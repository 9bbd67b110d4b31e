"""One rank of the replica-group fault-tolerance tests (tests/test_ft_groups.py), run as its own process.

``--mode ft``: rank ``--rank`` of replica group ``--group``, a group of ``--ranks`` ranks that is its own gloo world
(``--master-port``), the model sharded over it by FSDP2 (a 1-D mesh), each rank with its own torchft Manager
(lioncub.ft.make_manager: the group's world) and FTLocalCub; the quorum's groups meet on torchft's managed groups.
``--mode plain``: the reference without torchft: rank ``group * ranks + rank`` of one gloo world of ``--groups``
x ``--ranks``, a 2-D mesh (replicate, shard), FSDP2 on its shard dimension and LocalCub across the replicate one
(the library's HSDP rounds, tests/test_sharded.py), each rank on the same batches as its ft counterpart.
``--vote every-pbit`` / ``every-sign_allreduce``: LionCub's vote every step instead (FTLionCub; the reference LionCub
on the same 2-D mesh, the vote across 'replicate').
``--inside mean``: a node mean inside the groups instead of FSDP2: ``ft``, every rank the whole model (plain
parameters on the group's world: FTLocalCub averages each step's gradients over the group); ``plain``, the reference
written out here: one gloo world of ``--groups`` x ``--ranks``, each rank's gradients summed over its node's ranks by
``dist.all_reduce`` and divided by ``--ranks``, then LocalCub (or LionCub) on the cross-node group of its local rank
(rank k of every node) as its ``process_group``.

Each rank appends a JSON line per committed round to ``--out``: the round, the participants P and contributors C,
uncommitted agreements, heals, and a hash of its own shard's bytes (equal hashes across groups at the same rank:
bit-identical shards). ``--fault REPLICA:ROUND:POINT[:ACTION]``: a failure at a chosen point (lioncub.ft.faults),
REPLICA being ``group * ranks + rank``; ``--nan-at GROUP:RANK:STEP``: that rank's gradient is NaN at its inner step STEP
(once). ``--ready-dir``: every rank of a fresh start writes a file there once its
Manager is made and waits for ``--ready-count`` of them before its first quorum (so that the lighthouse sees every
group before any asks for a quorum). ``--rounds`` with ``--stop-file``: stop together at the first commit from
round ``--rounds`` on once the file exists.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.flat, run as a script


def model_of(mesh):
    """The model, FSDP2-sharded over ``mesh`` (None: plain, every rank the whole of it)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if mesh is None:
        return model
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def shard_digest(model) -> str:
    flat = torch.cat([getattr(p, "to_local", p.detach)().detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def batch(group: int, rank: int, t: int):
    g = torch.Generator().manual_seed(1000 * (10 * group + rank) + t)
    x = torch.randn(16, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(16, 1, generator=g)
    return x, y


SETTING = dict(lr=1e-2, inner="adamw", outer="nesterov", outer_lr=0.7, outer_momentum=0.9, weight_decay=0.01,
               nonfinite="skip", vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True)
EVERY_STEP = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, nonfinite="skip")
"""LionCub's every-step vote (``--vote every-pbit``, ``every-sign_allreduce``): FTLionCub, or LionCub on the 2-D mesh."""


def wait_ready(a) -> None:
    open(os.path.join(a.ready_dir, f"{a.group}_{a.rank}"), "w").close()
    while len(os.listdir(a.ready_dir)) < a.ready_count:
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("ft", "plain"), required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--stop-file", default="")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--fault", action="append", default=[])
    ap.add_argument("--nan-at", default="-1:-1:-1", help="GROUP:RANK:STEP: that rank's gradient is NaN there, once")
    ap.add_argument("--ready-dir", default="")
    ap.add_argument("--ready-count", type=int, default=0)
    ap.add_argument("--vote", default="mean8", help="mean8: LocalCub's rounds (SETTING); every-pbit, "
                    "every-sign_allreduce: LionCub's vote every step (EVERY_STEP; FTLionCub on torchft)")
    ap.add_argument("--inside", choices=("fsdp2", "mean"), default="fsdp2")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lioncub.ft import QuorumError  # (importable without torchft: only FTLocalCub needs it)
    from tests.ft_worker import exit_cleanly

    ft = a.mode == "ft"
    every_step = a.vote.startswith("every-")
    if every_step:
        a.H = 1
    world, me = (a.ranks, a.rank) if ft else (a.groups * a.ranks, a.group * a.ranks + a.rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.master_port}", rank=me, world_size=world,
                            timeout=timedelta(seconds=60))
    if ft:
        from lioncub.ft import make_manager
        from lioncub.ft.faults import install, parse_fault
        from tests.flat import FTLocalCub

        model = model_of(init_device_mesh("cpu", (a.ranks,)) if a.inside == "fsdp2" else None)
        manager = make_manager(str(a.group), a.lighthouse, min_replicas=1, timeout_s=3.0, quorum_timeout_s=60.0)
        if every_step:
            from tests.flat import FTLionCub

            opt = FTLionCub(model.parameters(), manager, vote=a.vote[len("every-"):], **EVERY_STEP)
        else:
            opt = FTLocalCub(model.parameters(), manager, local_steps=a.H, **SETTING)
        install(opt, [parse_fault(spec) for spec in a.fault], a.group * a.ranks + a.rank)
    else:
        from tests.flat import LocalCub

        if a.inside == "fsdp2":
            mesh = init_device_mesh("cpu", (a.groups, a.ranks), mesh_dim_names=("replicate", "shard"))
            model, across = model_of(mesh["shard"]), {}
        else:  # the node's ranks (one all-reduce of each gradient), the cross-node group of this local rank
            nodes = [dist.new_group(list(range(g * a.ranks, (g + 1) * a.ranks))) for g in range(a.groups)]
            local = [dist.new_group(list(range(k, a.groups * a.ranks, a.ranks))) for k in range(a.ranks)]
            model, across, node = model_of(None), dict(process_group=local[a.rank]), nodes[a.group]
        if every_step:
            from tests.flat import LionCub

            class EveryStep(LionCub):  # LionCub's counters under the names this loop reads
                rounds = property(lambda self: self.steps)
                skipped_rounds = property(lambda self: self.skipped_steps)
                local_step = 0

            opt = EveryStep(model.parameters(), vote=a.vote[len("every-"):], **across, **EVERY_STEP)
        else:
            opt = LocalCub(model.parameters(), local_steps=a.H, **across, **SETTING)
        manager = None

    log = open(a.out, "a")

    def log_round() -> None:
        rec = dict(group=a.group, rank=a.rank, round=opt.rounds, skipped=opt.skipped_rounds, digest=shard_digest(model))
        if ft:
            rec.update(participants=opt.participants, contributors=opt.contributors, uncommitted=opt.uncommitted,
                       heals=opt.heals)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    if ft:
        if a.ready_dir:
            wait_ready(a)
        opt.join()  # the quorum (and a heal, for a group that restarts) before the first inner step
        if opt.rounds:  # it healed, then took the round's outer step with the others
            log_round()
    while True:
        if not ft and opt.rounds >= a.rounds:
            break
        if ft:  # stop together, at the commit that carries the first request
            if opt.stop_agreed:
                break
            opt.stop_requested = opt.rounds >= a.rounds - 1 and (not a.stop_file or os.path.exists(a.stop_file))
        step = opt.rounds * a.H + opt.local_step
        x, y = batch(a.group, a.rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if [a.group, a.rank, step] == [int(v) for v in a.nan_at.split(":")] and opt.skipped_rounds == 0:
            grad = model[0].weight.grad
            getattr(grad, "to_local", grad.detach)()[0, 0] = float("nan")
        if not ft and a.inside == "mean":  # the reference's node mean: fp32 sums over the node, halved
            for p in model.parameters():
                dist.all_reduce(p.grad, group=node)
                p.grad.div_(a.ranks)
        before, skipped = opt.rounds, opt.skipped_rounds
        try:
            opt.step()
        except QuorumError as exc:
            print(f"QuorumError: {exc}", file=sys.stderr, flush=True)
            os._exit(3)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if opt.rounds != before or opt.skipped_rounds != skipped:
            log_round()
    log.write(json.dumps(dict(group=a.group, rank=a.rank, done=True, round=opt.rounds,
                              digest=shard_digest(model))) + "\n")
    exit_cleanly(log, manager)


if __name__ == "__main__":
    main()
