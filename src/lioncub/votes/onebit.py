"""``onebit``: packed sign bits; all-to-all of P chunks, each rank votes its chunk, all-gather
of the voted bits.

Zeros of c and tied counts follow the tie rule (the paper's alternating parity by
default). The message is padded to P equal chunks (zero bytes). Bytes per element per
rank: 2(P−1)/P · 1/8 (docs/design.md §3).

With server error feedback (``error_feedback='server'`` / ``'both'``) the owner of a chunk
sends ``sign(a + r)`` instead of the majority, ``a`` the mean of the P signs and ``r`` its
residual (:func:`~lioncub.votes.feedback.server_signs_`); the residual is ``8·N/P`` fp32 on
the owner, and the wire is unchanged: the same all-to-all of ``N`` bytes and all-gather of
``N/P`` bytes per rank, nothing else (``N`` the message padded to P chunks).

With ``tie='hold'`` a tied count repeats the element's previous vote: the owner keeps its
chunk's last voted bits (``N/P`` bytes, all +1 before the first step) and ORs them into the
ties (:func:`~lioncub.wire.kernels.majority_bits_held`); the wire is unchanged.
"""
from __future__ import annotations


from torch import Tensor

from .. import comm, fused
from ..wire import kernels
from .base import PackedSigns
from .feedback import server_signs_

__all__ = ["OneBit"]


class OneBit(PackedSigns):
    name = "onebit"
    TIES = "parity"
    gamma = (1.8e-9, 0.0)  # fused pack; count own chunk of P ranks on words; apply from bits
    auto_rank = 1
    CHUNK_OWNERS = True

    @classmethod
    def round_mean(cls, quantizer):  # the all-to-all and all-gather carry a two-phase compressed mean
        return "scatter_mean"

    def message_nbytes(self, m):
        return -(-m // self.world) * self.world

    def plan(self, n):
        N = -(-n // (8 * self.world)) * self.world  # padded so each rank owns N/P whole bytes
        return [("all_to_all", N), ("all_gather", N // self.world)]

    def owner_elements(self, m):
        return self.message_nbytes(m) // self.world * 8

    def exchange(self, msg, m, step, group, stats, residual=None) -> Tensor:
        mine = comm.all_to_all(msg[:self.message_nbytes(m)], group, stats)  # rank j gets everyone's chunk j
        t0 = comm.clock(stats)
        rows = mine.view(self.world, -1)  # (P, N/P): row i is rank i's bits of this rank's chunk
        if self.owner_state == "held" and residual is None:
            raise ValueError("tie='hold' keeps each chunk owner's last vote between steps: it runs in "
                             "LionCub's step (not a single vote call)")
        if residual is None:
            voted = kernels.majority_bits(rows, self.world, self.parity(step), count=fused.vote_bits)
        elif self.owner_state == "held":
            voted = kernels.majority_bits_held(rows, self.world, residual, count=fused.vote_bits)
        else:
            voted = server_signs_(rows, self.world, residual, self.parity(step))
        stats.t_unpack_vote += comm.clock(stats) - t0
        return comm.all_gather(voted, group, stats).reshape(-1)

    def decode(self, voted, offset, n, out):
        return kernels.unpack_pm1(voted[offset:offset + self.part_nbytes(n)], n, out.dtype, out=out)

    def apply_fused(self, params, exp_avgs, grads, part, hyper) -> bool:
        fused.apply_bits(params, exp_avgs, grads, part, None, **hyper)
        return True
