"""Lion Cub with the HF Trainer (DDP under the hood), a tiny GPT-2 built from a config.

    OMP_NUM_THREADS=1 PYTHONPATH=src torchrun --nproc-per-node 2 examples/hf_trainer_lioncub.py

The task is learnable: each sequence counts up by one (mod 64) from a random start, so after
the first token every next token is predictable. The Trainer's logged loss falls from about
ln(64) = 4.2 towards 0.
"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import lioncub
from lioncub.ddp.hook import attach_to_trainer


def main(steps: int = 30) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    starts = torch.randint(0, 64, (512, 1), generator=torch.Generator().manual_seed(0))
    tokens = (starts + torch.arange(32)) % 64
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(output_dir="/tmp/lioncub-hf", per_device_train_batch_size=8, max_steps=steps,
                             gradient_accumulation_steps=2, max_grad_norm=0.0,  # the vote runs in backward
                             logging_steps=5, report_to=[], save_strategy="no", use_cpu=True,
                             ddp_backend="gloo", ddp_find_unused_parameters=False, disable_tqdm=True)
    if not torch.distributed.is_initialized():  # LionCub needs the group before Trainer makes it
        torch.distributed.init_process_group("gloo")
    opt = lioncub.LionCub(model.parameters(), lr=3e-3, aggregation=lioncub.SignVote())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
    attach_to_trainer(trainer, opt)  # registers the comm hook once Trainer has wrapped the model in DDP
    trainer.train()
    if trainer.is_world_process_zero():
        for record in trainer.state.log_history:
            if "loss" in record:
                print(f"step {record['step']} loss {record['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
