"""Lion Cub with FSDP2: shard inside a node, vote across nodes (HSDP with the vote on the slow link).

    OMP_NUM_THREADS=1 PYTHONPATH=src torchrun --nproc-per-node 4 examples/hsdp_lioncub.py

Four ranks form a 2 x 2 mesh: 2 replicas (on a real cluster: nodes) x 2 shards (GPUs inside a node).
FSDP2 shards every block over the mesh's "shard" dimension only, so its reduce-scatter stays inside
a replica; LionCub votes each rank's shard across the replicas (the group is inferred from the mesh),
1 bit per element. Halfway through, the model and optimizer are saved with torch.distributed.checkpoint
and loaded back (into ./hsdp_lioncub_checkpoint). The task: recover a fixed random "teacher" network (each rank draws its own inputs);
the printed loss falls from about 1 to well below it.
"""
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lioncub


def teacher(x: torch.Tensor) -> torch.Tensor:
    """The function to learn: the same fixed weights on every rank, outputs of variance ~1."""
    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 1, generator=g)
    return torch.tanh(x @ w1 / 32 ** 0.5) @ w2 / 16 ** 0.25


def main(steps: int = 60, replicas: int = 2) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda" if cuda else "cpu", (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])  # the shard dimension: no all-reduce across replicas
    fully_shard(model, mesh=mesh["shard"])
    opt = lioncub.LionCub(model.parameters(), lr=3e-3, aggregation=lioncub.SignVote("onebit"))  # votes across mesh["replicate"]
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    path = "hsdp_lioncub_checkpoint"  # a directory in the working directory
    for step in range(steps + 1):
        x = torch.randn(64, 32, generator=g)
        loss = (model(x) - teacher(x)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == steps // 2:  # save and load back: every replica's momenta, the step count
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0 and step % 10 == 0:
            s = opt.last_step_stats
            print(f"step {step} loss {loss.item():.4f} sent {s.bytes_sent:.0f} B across {opt.world_size} replicas",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
