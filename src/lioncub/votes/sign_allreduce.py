"""``sign_allreduce``: int8 signs, one SUM all-reduce; u = sign of the sum.

Exact: a tied count votes 0 and a zero of c sends 0. The int8 sum holds at most 127
ranks. Bytes per element per rank: 2(P−1)/P · 1 (docs/design.md §3).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import comm, fused
from .base import VoteMethod

__all__ = ["SignAllreduce"]


class SignAllreduce(VoteMethod):
    name = "sign_allreduce"
    gamma = (2.3e-9, 0.0)  # fused sign(c) -> int8; sign of the sum
    auto_rank = 0

    def configure(self, world, bits, quantizer) -> int:
        if world > 127:
            raise ValueError(f"vote='sign_allreduce' sums int8 signs and needs world size <= 127, got {world}")
        return 8

    def plan(self, n):
        return [("allreduce", n)]

    def encode(self, c, dst, step, generator=None, work=None, use_fused=False, sizes=None, residuals=None):
        dst.view(torch.int8).copy_(torch.sign(c))

    def exchange(self, msg, m, step, group, stats) -> Tensor:
        comm.all_reduce(msg[:m], group, stats)  # int8 sums
        return msg

    def decode(self, voted, offset, n, out):
        return out.copy_(voted[offset:offset + n].view(torch.int8).sign())

    @classmethod
    def partial_vote(cls, quantizer):  # a rank that abstains sends sign 0: the sum's sign is the voters'
        return True

    def decode_for(self, voted, offset, n, out, count):
        return self.decode(voted, offset, n, out)

    def encode_fused(self, exp_avgs, grads, beta1, maximize, dst, step) -> bool:
        return fused.encode(exp_avgs, grads, beta1, maximize, dst, bits=8, step=0, signs=True)

    def reference(self, cs, step, generators=None):
        return torch.sign(sum(torch.sign(c).long() for c in cs))
