"""The vote methods, one module each, registered by name (docs/design.md §11).

:data:`METHODS` maps the ``vote=`` / ``method=`` string to its :class:`VoteMethod` subclass;
every caller (:class:`~lioncub.LionCub`, overlap, the DDP hook, :func:`~lioncub.majority_vote`,
:mod:`lioncub.engine.cost`, :mod:`lioncub.engine.auto`, the instruments, :class:`~lioncub.LocalCub`) reaches a
method through :func:`lookup` or :func:`make`, never by testing its name.
"""
from __future__ import annotations

from typing import Optional, Union

from .base import TIE_RULES, VoteMethod, binary_signs, check_sign_options, check_tie_rule, decide, parity_step
from .feedback import ERROR_FEEDBACK
from .pbit import pbit_levels
from .registry import METHODS
from .rounds import (ROUND_AGGREGATES, ROUND_AGGREGATIONS, Agreement, RoundAggregation, round_aggregation,
                     round_class)

__all__ = ["METHODS", "VOTE_METHODS", "AUTO_CANDIDATES", "TIE_RULES", "VoteMethod", "lookup", "make",
           "check_tie", "check_sign_options", "ERROR_FEEDBACK", "parity_step", "binary_signs",
           "decide", "pbit_levels", "ROUND_AGGREGATES", "ROUND_AGGREGATIONS", "Agreement", "RoundAggregation",
           "round_aggregation", "round_class", "STREAMING_VOTES"]


VOTE_METHODS = tuple(METHODS)
AUTO_CANDIDATES = tuple(sorted((name for name, cls in METHODS.items() if cls.auto_rank is not None),
                               key=lambda name: METHODS[name].auto_rank))
"""Methods ``vote='auto'`` considers, in tie-break order (the earlier wins a tie)."""


def lookup(method: str) -> type[VoteMethod]:
    """The class of vote method ``method``; ValueError naming the allowed ones otherwise."""
    cls = METHODS.get(method) if isinstance(method, str) else None
    if cls is None:
        raise ValueError(f"method must be one of {VOTE_METHODS}, got {method!r}")
    return cls


def make(method: str, world: int, bits: Optional[int] = None, quantizer: Optional[str] = None,
         tie: str = "alternate", *, error_feedback: str = "none", stochastic_signs: Union[bool, float] = False) -> VoteMethod:
    """Vote method ``method`` configured for ``world`` ranks (validated: see :class:`VoteMethod`;
    ``error_feedback`` / ``stochastic_signs``: :mod:`lioncub.votes.feedback`)."""
    return lookup(method)(world, bits, quantizer, tie, error_feedback=error_feedback,
                          stochastic_signs=stochastic_signs)


def check_tie(tie: str, vote: str, quantizer: Optional[str] = None) -> None:
    """An optimizer's check of ``tie=`` for ``vote`` (``'grad'`` and ``'auto'`` have no tie rule)."""
    cls = METHODS.get(vote)
    check_tie_rule(tie, cls is not None and cls.has_tie_rule(quantizer), vote, quantizer)


STREAMING_VOTES = tuple(name for name in VOTE_METHODS if METHODS[name](2).one_allreduce)
"""Vote methods whose exchange is one all-reduce, so a streaming round (``delay=1``) can keep it in flight."""
