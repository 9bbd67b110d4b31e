"""Lion Cub with PyTorch Lightning's DDP strategy: Lightning wraps the model in DDP, a callback
registers Lion Cub's comm hook on it, so DDP sends the vote instead of fp32 gradients.

    OMP_NUM_THREADS=1 PYTHONPATH=src torchrun --nproc-per-node 2 examples/lightning_lioncub.py

The task is learnable (a fixed random "teacher" network to recover, as in ddp_lioncub.py);
the printed loss falls from about 1 to well below it.
"""
import os

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import lioncub
from lioncub.ddp.hook import register


class SendLionCubVote(L.Callback):
    """Register the comm hook once Lightning has wrapped the model in DDP and built the optimizer.
    Keep Lightning's gradient clipping off: the vote runs during backward, before clipping."""

    def on_train_start(self, trainer, pl_module):
        register(trainer.strategy.model, trainer.optimizers[0])


def teacher(x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(32, 16, generator=g), torch.randn(16, 1, generator=g)
    return torch.tanh(x @ w1 / 32 ** 0.5) @ w2 / 16 ** 0.25


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        if self.global_rank == 0 and self.global_step % 10 == 0:
            print(f"step {self.global_step} loss {loss.item():.4f}", flush=True)
        return loss

    def configure_optimizers(self):
        return lioncub.LionCub(self.parameters(), lr=3e-3, aggregation=lioncub.SignVote())  # 4-bit lanes for P <= 15

    def on_train_end(self):
        opt = self.trainer.optimizers[0]
        flat = torch.cat([p.detach().reshape(-1) for p in self.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(self.trainer.world_size)]
        torch.distributed.all_gather(everyone, flat)
        if self.global_rank == 0:
            print(f"vote: {opt.last_step_stats.bytes_sent:.0f} B sent per step in "
                  f"{opt.last_step_stats.n_collectives} collectives (fp32 gradients: {4 * flat.numel()} B); "
                  f"replicas identical: {all(torch.equal(flat, e) for e in everyone)}", flush=True)


def main(steps: int = 61) -> None:
    torch.manual_seed(0)
    x = torch.randn(64 * 2 * steps, 32)
    data = DataLoader(TensorDataset(x, teacher(x)), batch_size=64, shuffle=True)  # Lightning shards it per rank
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
                        strategy=DDPStrategy(process_group_backend="gloo"), max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SendLionCubVote()])
    trainer.fit(Regressor(), data)


if __name__ == "__main__":
    main()
