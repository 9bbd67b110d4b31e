"""``onebit``: packed sign bits; all-to-all of P chunks, each rank votes its chunk, all-gather
of the voted bits.

Zeros of c and tied counts follow the tie rule (the paper's alternating parity by
default). The message is padded to P equal chunks (zero bytes). Bytes per element per
rank: 2(P−1)/P · 1/8 (docs/design.md §3).
"""
from __future__ import annotations


from torch import Tensor

from .. import comm, fused
from ..wire import kernels
from .base import PackedSigns

__all__ = ["OneBit"]


class OneBit(PackedSigns):
    name = "onebit"
    TIES = "parity"
    gamma = (1.8e-9, 0.0)  # fused pack; count own chunk of P ranks on words; apply from bits
    auto_rank = 1

    def message_nbytes(self, m):
        return -(-m // self.world) * self.world

    def plan(self, n):
        N = -(-n // (8 * self.world)) * self.world  # padded so each rank owns N/P whole bytes
        return [("all_to_all", N), ("all_gather", N // self.world)]

    def exchange(self, msg, m, step, group, stats) -> Tensor:
        mine = comm.all_to_all(msg[:self.message_nbytes(m)], group, stats)  # rank j gets everyone's chunk j
        t0 = comm.clock(stats)
        voted = kernels.majority_bits(mine.view(self.world, -1), self.world, self.parity(step))
        stats.t_unpack_vote += comm.clock(stats) - t0
        return comm.all_gather(voted, group, stats).reshape(-1)

    def decode(self, voted, offset, n, out):
        return kernels.unpack_pm1(voted[offset:offset + self.part_nbytes(n)], n, out.dtype, out=out)

    def apply_fused(self, params, exp_avgs, grads, part, hyper) -> bool:
        fused.apply_bits(params, exp_avgs, grads, part, None, **hyper)
        return True
