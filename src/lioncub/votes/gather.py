"""``gather``: packed sign bits, one all-gather; every rank counts all P ranks' bits.

Zeros of c follow the tie rule (a 1-bit wire has no 0); a tied count votes 0. Bytes per
element per rank: (P−1) · 1/8 (docs/design.md §3). The local count grows with P
(bit-sliced over ⌈log2(P+1)⌉ planes), hence its γ's ``b·P`` term.
"""
from __future__ import annotations


import torch
from torch import Tensor

from .. import comm, fused
from ..wire import kernels
from .base import PackedSigns

__all__ = ["Gather"]


class Gather(PackedSigns):
    name = "gather"
    TIES = "zero"
    gamma = (1.9e-9, 0.5e-9)  # fused pack; bit-sliced count of all P ranks' bits (3.9 ns at P = 4)
    auto_rank = 3

    def plan(self, n):
        return [("all_gather", -(-n // 8))]

    def exchange(self, msg, m, step, group, stats) -> Tensor:
        """Voted bytes of shape (2, ·): row 0 the packed mask 2k > P, row 1 the mask 2k < P."""
        everyone = comm.all_gather(msg[:m], group, stats)  # (P, m)
        t0 = comm.clock(stats)
        gt, eq = fused.vote_bits(everyone, self.world)  # packed words (one GPU kernel for CUDA rows)
        masks = torch.empty((2,) + gt.shape, dtype=gt.dtype, device=gt.device)
        masks[0].copy_(gt)
        torch.bitwise_or(gt, eq, out=masks[1])
        masks[1].bitwise_not_()  # 2k < P
        stats.t_unpack_vote += comm.clock(stats) - t0
        return masks.view(torch.uint8)

    def decode(self, voted, offset, n, out):
        nb = self.part_nbytes(n)
        return kernels.spread_votes(voted[0, offset:offset + nb], voted[1, offset:offset + nb], n, out.dtype, out=out)

    def apply_fused(self, params, exp_avgs, grads, part, hyper) -> bool:
        fused.apply_bits(params, exp_avgs, grads, part[0], part[1], **hyper)
        return True
