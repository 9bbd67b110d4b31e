"""Data-parallel baselines through PyTorch DDP: AdamW (fp32, bf16 hook, PowerSGD) and Lion.

Each is DDP as a user would set it up: ``DistributedDataParallel(model)`` (bucketed
gradient all-reduce overlapped with backward, averaged gradients), optionally one of
PyTorch's stock communication hooks, then a plain single-process optimizer:

    adamw-ddp       fp32 all-reduce (DDP's default)
    adamw-bf16      ``default_hooks.bf16_compress_hook``: gradients cast to bf16, summed, cast back
    adamw-psgd-r1/4 ``powerSGD_hook`` with rank 1 / 4 (error feedback, warm start; small tensors and
                    those that would not compress 2x go uncompressed, PyTorch's rule)
    lion-ddp        fp32 all-reduce, then :class:`lioncub.Lion` (momentum identical on every rank)

Replicas stay identical after every step: every rank applies the same averaged gradient.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ..lion import Lion
from .base import Adapter

__all__ = ["DDPMethod", "AdamWDDP", "LionDDP"]

BETAS = (0.9, 0.99)  # both families (nanoGPT's small-model setting for AdamW; Lion's default)


class DDPMethod(Adapter):
    """``DDP(module)`` + optional comm hook + ``optimizer`` (subclasses state the ``family``)."""

    def __init__(self, module: nn.Module, make_opt, *, name: str, group=None,
                 hook=None, hook_state=None, bucket_cap_mb=None):
        super().__init__(module, group=group)
        self.name = name
        # broadcasts rank 0's params; bucket_cap_mb=None: DDP's default buckets (1 MiB first, then 25)
        self.ddp = DDP(module, process_group=group, bucket_cap_mb=bucket_cap_mb)
        if hook is not None:
            self.ddp.register_comm_hook(hook_state, hook)
        self.opt = make_opt(module.parameters())

    def forward_module(self) -> nn.Module:
        return self.ddp


def _bf16_hook(process_group, bucket):
    """PyTorch's ``bf16_compress_hook``, unchanged. DDP refuses that hook *by name* unless CUDA
    and NCCL are present, although it only casts to bf16 and calls ``all_reduce`` (which gloo
    sums in bf16 on CPU); calling it through this wrapper lifts the name check, nothing else."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


class AdamWDDP(DDPMethod):
    """AdamW + DDP; ``compress``: 'fp32' (no hook), 'bf16' or 'powersgd' (with ``rank``)."""

    family = "adamw"

    def __init__(self, module: nn.Module, *, lr: float, compress: str = "fp32", rank: int = 1, group=None,
                 weight_decay: float = 0.0):
        def make_opt(params):
            return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=weight_decay)

        if compress == "fp32":
            super().__init__(module, make_opt, name="adamw-ddp", group=group)
        elif compress == "bf16":
            super().__init__(module, make_opt, name="adamw-bf16", group=group, hook=_bf16_hook, hook_state=group)
        elif compress == "powersgd":
            # start_powerSGD_iter=2: compress from the 2nd step on (PyTorch requires > 1 with error
            # feedback); the run is a few hundred steps, so the default 1000 would never compress
            state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                                start_powerSGD_iter=2)
            # One bucket: the hook issues its P and Q all-reduces from future callbacks (a gloo
            # thread), so with several buckets the ranks can interleave collectives in different
            # orders (on 4 gloo ranks we hit "Received data size doesn't match expected size").
            # Cost: PowerSGD's traffic no longer overlaps backward.
            super().__init__(module, make_opt, name=f"adamw-psgd-r{rank}", group=group,
                             hook=powerSGD_hook.powerSGD_hook, hook_state=state, bucket_cap_mb=4096)
        else:
            raise ValueError(f"compress must be 'fp32', 'bf16' or 'powersgd', got {compress!r}")


class LionDDP(DDPMethod):
    """Lion + DDP fp32: standard distributed Lion (32 bits per element on the wire)."""

    family = "lion"

    def __init__(self, module: nn.Module, *, lr: float, group=None, weight_decay: float = 0.0):
        super().__init__(module, lambda params: Lion(params, lr=lr, betas=BETAS, weight_decay=weight_decay),
                         name="lion-ddp", group=group)
