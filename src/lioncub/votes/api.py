r"""The majority vote as a function: every rank passes its update vector :math:`c_i`, every
rank gets the same :math:`u = \mathrm{sign}(\sum_i q(c_i)) \in \{-1, 0, +1\}`
(docs/design.md §2–§3).

The methods (``sign_allreduce``, ``gather``, ``onebit``, ``pbit``; what each sends and how it
treats zeros and ties: the table of docs/design.md §3) are objects of :mod:`lioncub.votes`
(encode → exchange → decode, their price, their reference). The tie rule (``tie=``,
:data:`TIE_RULES`) is the paper's alternating parity by default (+1 on even steps, −1 on odd;
a fixed rule biases every tied coordinate one way and diverges, its Fig. 10);
``'plus'``/``'minus'`` fix it for ablations, on the methods that have a 1-bit encoding.
:func:`reference_vote` computes what every method must return from all ranks' inputs in full
precision; the multi-process tests compare the two element for element.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import votes
from ..comm import CommStats
from . import TIE_RULES, VOTE_METHODS, pbit_levels

__all__ = ["VOTE_METHODS", "TIE_RULES", "majority_vote", "reference_vote", "pbit_levels"]


def _stateless(tie: str) -> None:
    """One vote call keeps no state between steps: refuse ``tie='hold'`` (LionCub's step only)."""
    if tie == "hold":
        raise ValueError("tie='hold' repeats each chunk owner's last vote, kept between steps by LionCub's step; "
                         "a single vote call has none: use tie='alternate', 'plus' or 'minus'")


def majority_vote(
    c: Tensor,
    *,
    method: str,
    bits: int | None = None,
    quantizer: str | None = None,
    step: int = 0,
    tie: str = "alternate",
    group=None,
    stats: CommStats | None = None,
    generator: torch.Generator | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Agree on ``u = sign(Σ_i q(c_i))`` across the ranks of ``group``.

    Every rank passes ``c`` of the same shape and gets the same ``u`` (same shape
    and dtype as ``c``, values in {-1, 0, +1}). ``step`` sets the tie/zero parity of
    the 1-bit paths, ``tie`` their rule (:data:`TIE_RULES`; ``'alternate'``: +1 on even
    steps, −1 on odd; ``'plus'``/``'minus'``: always +1/−1); ``bits``/``quantizer`` configure ``pbit`` (see
    :func:`pbit_levels`); ``generator`` seeds stochastic quantizers (``linf``);
    ``stats`` accumulates bytes and time; ``out`` (a contiguous tensor of ``c``'s
    shape and dtype, ``c`` itself allowed) receives ``u`` instead of a new tensor.
    Collective: all ranks must call it.

    Example (under ``torchrun --nproc-per-node 4``)::

        u = lioncub.majority_vote(torch.randn(1000), method="onebit", step=0)
    """
    cls = votes.lookup(method)
    if not torch.is_floating_point(c):
        raise TypeError(f"c must be a floating-point tensor, got {c.dtype}")
    cls.check_options(bits, quantizer, tie)
    _stateless(tie)
    if out is not None and (out.shape != c.shape or out.dtype != c.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous tensor of c's shape {tuple(c.shape)} and dtype {c.dtype}, "
                         f"got shape {tuple(out.shape)}, dtype {out.dtype}, contiguous={out.is_contiguous()}")
    vote = cls(dist.get_world_size(group), bits, quantizer, tie)  # world-size limits, before the empty short-cut
    stats = CommStats() if stats is None else stats
    flat = c.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros_like(c) if out is None else out
    u = torch.empty_like(flat) if out is None else out.view(-1)
    vote.vote(flat, u, step, group, stats, generator)
    return out if out is not None else u.view(c.shape)


def reference_vote(
    cs: list[Tensor],
    *,
    method: str,
    bits: int | None = None,
    quantizer: str | None = None,
    step: int = 0,
    tie: str = "alternate",
    generators: list[torch.Generator | None] | None = None,
) -> Tensor:
    """What :func:`majority_vote` must return, computed from every rank's ``c`` at once.

    Plain integer arithmetic, no packing and no collectives: the exact reference.
    ``generators[i]`` must be in the state rank ``i``'s generator had. ``tie``: as
    :func:`majority_vote` (zeros of c and, for ``onebit``, tied counts).
    """
    _stateless(tie)
    vote = votes.make(method, len(cs), bits, quantizer, tie)
    u = vote.reference([c.detach().reshape(-1) for c in cs], vote.parity(step), generators)
    return u.view(cs[0].shape).to(cs[0].dtype)
