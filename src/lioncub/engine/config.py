"""The engine's record of an optimizer's vote settings: :class:`VoteConfig`.

Every optimizer that votes (:class:`~lioncub.LionCub`, :class:`~lioncub.LocalCub`, the node layout's
voter) holds one: which vote, its lane width and quantizer, the tie rule, the stochastic quantizer's
seed, what a binary-sign message carries beyond the sign (``error_feedback``, ``stochastic_signs``:
:mod:`lioncub.votes.feedback`), and (every step) the backend and the sizes of buckets and messages.
It checks nothing itself: each setting was checked once where the user gave it, by its aggregation
object (:mod:`lioncub.aggregations`) or :class:`lioncub.Options`; what depends on the world size is
checked by :meth:`VoteConfig.method`. ``vote='auto'`` is resolved by :meth:`VoteConfig.resolved`,
which returns a new config (the object is frozen: a config never changes under the optimizer holding it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from .. import votes
from ..votes.mean import MEAN_DEFAULTS, OneBitMean, make_step_method, mean_fingerprint
from ..validate import check_int

__all__ = ["VoteConfig", "VoteSettings", "StepSettings", "OPTIMIZER_VOTES", "GRAD_DTYPE_NAMES"]

OPTIMIZER_VOTES = ("grad",) + votes.VOTE_METHODS + ("auto",)
"""What ``vote=`` takes: the gradient all-reduce baseline, every registered method, ``'auto'``."""
GRAD_DTYPE_NAMES = ("fp32", "bf16")
"""What ``grad_dtype=`` takes (``vote='grad'``'s all-reduce dtype)."""


@dataclass(frozen=True)
class VoteConfig:
    """What an optimizer votes with, built from an aggregation object's ``for_step()`` / ``for_round()`` and
    :class:`lioncub.Options` (which checked them); the world-size limits are checked by :meth:`method`."""

    vote: str = "pbit"
    bits: Optional[int] = None
    quantizer: Optional[str] = None
    tie: str = "alternate"
    seed: int = 0
    grad_dtype: str = "fp32"
    fused: Optional[bool] = None
    bucket_mb: float = 25.0
    message_mb: float = 25.0
    error_feedback: str = "none"
    stochastic_signs: Union[bool, float] = False
    aggregate: str = "vote"
    mean_adapt: float = OneBitMean.ADAPT
    mean_range: float = OneBitMean.SHAPE_RANGE
    mean_norm: str = OneBitMean.NORM
    mean_restart: int = OneBitMean.RESTART

    def __post_init__(self):  # (checked where they were given: the aggregation object, Options)
        object.__setattr__(self, "bucket_mb", float(self.bucket_mb))
        object.__setattr__(self, "message_mb", float(self.message_mb))

    @property
    def votes(self) -> bool:
        """Whether this is a vote (a registered method), not ``'grad'`` or an unresolved ``'auto'``."""
        return self.vote in votes.METHODS

    def method(self, world: int) -> Optional[votes.VoteMethod]:
        """The vote method object for ``world`` ranks (None for ``'grad'``). Refuses, naming the
        argument, what cannot be exact for that many ranks (e.g. lanes too narrow)."""
        check_int("world", world, 1)
        if self.vote == "auto":
            raise ValueError("vote='auto' is resolved first (VoteConfig.resolved)")
        if not self.votes:
            return None
        return make_step_method(self.vote, world, self.bits, self.quantizer, self.tie, aggregate=self.aggregate,
                                error_feedback=self.error_feedback, stochastic_signs=self.stochastic_signs,
                                **self._mean())

    def _mean(self) -> dict:
        """The ``mean_*`` settings (:data:`~lioncub.votes.mean.MEAN_DEFAULTS`)."""
        return {name: getattr(self, name) for name in MEAN_DEFAULTS}

    def resolved(self, vote: str, bits: Optional[int]) -> "VoteConfig":
        """This config with ``vote='auto'``'s pick (a binary-sign method: no quantizer)."""
        return dataclasses.replace(self, vote=vote, bits=bits)

    def fingerprint(self) -> dict:
        """The settings a checkpoint must have been saved with to resume bit-exactly."""
        return dict(vote=self.vote, bits=self.bits, quantizer=self.quantizer, tie=self.tie,
                    grad_dtype=self.grad_dtype, error_feedback=self.error_feedback,
                    stochastic_signs=self.stochastic_signs, aggregate=self.aggregate,
                    **mean_fingerprint(self.aggregate, **self._mean()))


class VoteSettings:
    """The vote settings an optimizer exposes, read from its ``config`` (a :class:`VoteConfig`):
    one source, so an attribute never disagrees with what the optimizer votes with."""

    config: VoteConfig
    vote = property(lambda self: self.config.vote, doc="The vote method's name (``'auto'``: its pick).")
    bits = property(lambda self: self.config.bits, doc="``pbit``'s lane width (None: the smallest valid).")
    quantizer = property(lambda self: self.config.quantizer, doc="``pbit``'s quantizer (None: binary signs).")
    tie = property(lambda self: self.config.tie, doc="Where zeros and ties go on the 1-bit paths.")
    seed = property(lambda self: self.config.seed, doc="The stochastic quantizer's seed (``seed + rank``).")


class StepSettings(VoteSettings):
    """:class:`VoteSettings` and the settings only the every-step optimizer has (LionCub's)."""

    grad_dtype = property(lambda self: self.config.grad_dtype, doc="``vote='grad'``'s all-reduce dtype.")
    fused = property(lambda self: self.config.fused, doc="The requested backend (None: fused where it runs).")
    bucket_mb = property(lambda self: self.config.bucket_mb, doc="Bucket size, MiB of fp32 elements.")
    message_mb = property(lambda self: self.config.message_mb, doc="Message size on the wire, MiB.")
    error_feedback = property(lambda self: self.config.error_feedback,
                              doc="``'none'``, ``'worker'`` (each rank's residual of its scaled sign), ``'server'`` "
                                  "(each chunk owner's residual of its voted sign) or ``'both'``.")
    aggregate = property(lambda self: self.config.aggregate,
                         doc="``'vote'`` (the majority vote of signs) or ``'mean'`` (the 1-bit compressed mean).")
    stochastic_signs = property(lambda self: self.config.stochastic_signs,
                                doc="Whether the binary signs are drawn, +1 with probability (1 + v/M)/2.")
