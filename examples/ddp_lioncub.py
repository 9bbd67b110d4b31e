"""Lion Cub under plain DDP: the training loop is unchanged, DDP sends the vote.

    OMP_NUM_THREADS=1 PYTHONPATH=src torchrun --nproc-per-node 2 examples/ddp_lioncub.py

The task is learnable: recover a fixed random two-layer "teacher" network from its outputs
(each rank draws its own inputs). The printed loss falls from about 1 to well below it.
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import lioncub
from lioncub.ddp.hook import register


def teacher(x: torch.Tensor) -> torch.Tensor:
    """The function to learn: the same fixed weights on every rank, outputs of variance ~1."""
    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 1, generator=g)
    return torch.tanh(x @ w1 / 32 ** 0.5) @ w2 / 16 ** 0.25


def main(steps: int = 60, accumulate: int = 2) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = lioncub.LionCub(model.parameters(), lr=3e-3, aggregation=lioncub.SignVote())  # 4-bit lanes for P <= 15
    register(model, opt)  # no fp32 gradient all-reduce from here on
    g = torch.Generator().manual_seed(rank)  # each rank its own shard
    for step in range(steps + 1):
        for micro in range(accumulate):
            x = torch.randn(64, 32, generator=g)
            loss = (model(x) - teacher(x)).pow(2).mean()
            if micro < accumulate - 1:
                with model.no_sync():  # DDP's own accumulation: no vote launched
                    loss.backward()
            else:
                loss.backward()  # launches one vote per DDP bucket during backward
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 10 == 0:
            s = opt.last_step_stats
            print(f"step {step} loss {loss.item():.4f} sent {s.bytes_sent:.0f} B in {s.n_collectives} collectives",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
