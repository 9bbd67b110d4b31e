r"""How the update travels between ranks: one typed object per algorithm, the same for every optimizer.

:class:`~lioncub.LionCub` (every step) and :class:`~lioncub.LocalCub` (local steps, a round every H) both take
``aggregation=``, one of the objects below or its string shortcut. Each object holds its own options with their
defaults and refuses, in one line naming the option, what it cannot run::

    Mean(dtype='fp32')             the exact mean: fp32 (or bf16, every step) all-reduce of the gradient / of Δ
    SignVote(transport='pbit', …)  the majority vote of the signs (Lion Cub, arXiv 2411.16462), 1-8 bits a vote
    OneBitMean(…)                  every step only: a 1-bit compressed mean of the gradients, Lion's exact update
                                   on it with a momentum all ranks share (the recommended every-step setting)
    LaneMean(bits=8)               local steps only: Δ's mean in 2-8-bit lanes of one all-reduce (L1 scale)
    ScatterMean(bits=4)            local steps only: Δ's mean in 1-8 bits on an all-to-all then an all-gather,
                                   each chunk owner keeping a residual (the recommended long-round setting)

String shortcuts: ``'mean'``, ``'sign-vote'``, ``'onebit-mean'``, ``'lane-mean'``, ``'scatter-mean'`` (each the
object with its defaults). Which to use, with the figures that chose each default: docs/api.md.

Each object turns itself into the engine's settings for an every-step optimizer (:meth:`for_step`) or a round
(:meth:`for_round`); one that cannot run there refuses (``ValueError`` naming the aggregation and what to use).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Optional, Union

from . import votes
from .quantize import QUANTIZERS, STOCHASTIC
from .votes.mean import ADAPT_DEFAULT, MEAN_DEFAULTS, NORM_DEFAULT, NORMS, RANGE_DEFAULT, RESTART_DEFAULT
from .validate import check_choice

__all__ = ["Mean", "SignVote", "OneBitMean", "LaneMean", "ScatterMean", "Aggregation", "AGGREGATIONS",
           "aggregation_of"]

TRANSPORTS = votes.VOTE_METHODS + ("auto",)
"""What :class:`SignVote`'s ``transport`` takes: every registered vote collective, or ``'auto'`` (the cheapest
for this world size and link by the α-β model)."""
ROUND_FEEDBACK = ("none", "worker")
"""What a round keeps of :data:`lioncub.votes.ERROR_FEEDBACK`: no chunk owner counts a round's votes."""


def _check_bits(name: str, bits, allowed: tuple, *, optional: bool = False) -> None:
    if bits is None and optional:
        return
    if isinstance(bits, bool) or bits not in allowed:
        none = "None or " if optional else ""
        raise ValueError(f"{name}.bits must be {none}one of {allowed}, got {bits!r}")


@dataclass(frozen=True)
class Mean:
    """The exact mean, no compression: every step the gradients' all-reduce (``dtype`` ``'fp32'`` or
    ``'bf16'``) then plain Lion with identical momenta (the baseline); in rounds Δ's fp32 all-reduce (DiLoCo's
    outer pseudo-gradient)."""

    dtype: str = "fp32"
    name = "mean"

    def __post_init__(self):
        check_choice("Mean.dtype", self.dtype, ("fp32", "bf16"))

    def for_step(self) -> dict:
        return dict(vote="grad", grad_dtype=self.dtype)

    def for_round(self) -> dict:
        if self.dtype != "fp32":
            raise ValueError("Mean(dtype='bf16') is the every-step all-reduce's; a round averages Δ in fp32: "
                             "use Mean()")
        return dict(vote="grad")


@dataclass(frozen=True)
class SignVote:
    """The majority vote of the signs: ``u = sign(Σ_i q(v_i))`` in 1-8 bits a vote.

    Args:
        transport: the collective that carries the votes: ``'pbit'`` (p-bit lanes of one all-reduce, the paper's
            4-bit Lion Cub), ``'onebit'`` (1-bit all-to-all + all-gather), ``'sign_allreduce'``, ``'gather'``,
            or ``'auto'`` (the cheapest binary-sign one for this world by the α-β model; every step only).
        bits: ``'pbit'``'s lane width (2, 4 or 8); None: the smallest that is exact for the world size.
        quantizer: ``'pbit'`` only: None (binary signs) or one of ``'sign', 'l1', 'lp', 'l0', 'linf', 'log'``.
        tie: where zeros and tied counts go on the 1-bit paths: ``'alternate'`` (the paper's parity),
            ``'plus'``, ``'minus'``, or ``'hold'`` (``'onebit'`` every step: the element's last vote).
        error_feedback: what the message carries beyond the sign: ``'none'``, each worker's residual
            (``'worker'``), every step also each chunk owner's (``'server'``, ``'both'``; ``'onebit'``).
        stochastic_signs: every step only: signs drawn with probability (1 + v/M)/2 (True, or a float M scale).
    """

    transport: str = "pbit"
    bits: Optional[int] = None
    quantizer: Optional[str] = None
    tie: str = "alternate"
    error_feedback: str = "none"
    stochastic_signs: Union[bool, float] = False
    name = "sign-vote"

    def __post_init__(self):
        check_choice("SignVote.transport", self.transport, TRANSPORTS)
        if self.quantizer is not None:
            check_choice("SignVote.quantizer", self.quantizer, QUANTIZERS)
        cls = votes.METHODS.get(self.transport)
        if self.bits is not None and not (cls and cls.LANE_BITS):
            raise ValueError(f"SignVote.bits is the lane width of transport='pbit', got transport={self.transport!r}")
        if self.bits is not None:
            _check_bits("SignVote", self.bits, cls.LANE_BITS, optional=True)
        if self.quantizer is not None and not (cls and cls.TAKES_QUANTIZER):
            raise ValueError(f"SignVote.quantizer applies to transport='pbit', got transport={self.transport!r}")
        check_choice("SignVote.tie", self.tie, votes.TIE_RULES)
        check_choice("SignVote.error_feedback", self.error_feedback, votes.ERROR_FEEDBACK)
        if self.transport != "auto":
            votes.check_tie(self.tie, self.transport, self.quantizer)

    def for_step(self) -> dict:
        votes.check_sign_options(self.transport, self.quantizer, self.error_feedback, self.stochastic_signs)
        return dict(vote=self.transport, bits=self.bits, quantizer=self.quantizer, tie=self.tie,
                    error_feedback=self.error_feedback, stochastic_signs=self.stochastic_signs)

    def for_round(self) -> dict:
        if self.error_feedback not in ROUND_FEEDBACK:
            raise ValueError(f"SignVote.error_feedback={self.error_feedback!r} keeps chunk owners' residuals of "
                             "every step; a round keeps the worker's: use 'none' or 'worker'")
        if self.stochastic_signs:
            raise ValueError("SignVote.stochastic_signs draws every step's signs; a round votes once: use False")
        if self.tie == "hold":
            raise ValueError("SignVote.tie='hold' repeats the last step's vote; a round votes once: use "
                             "'alternate', 'plus' or 'minus'")
        if self.error_feedback == "worker" and self.quantizer in STOCHASTIC:  # C(v) is computed apart from the message
            raise ValueError(f"SignVote.error_feedback='worker' cannot replay the stochastic quantizer "
                             f"{self.quantizer!r} in a round; use quantizer="
                             + ", ".join(repr(q) for q in QUANTIZERS if q not in STOCHASTIC))
        return dict(vote=self.transport, bits=self.bits, quantizer=self.quantizer, tie=self.tie,
                    error_feedback=self.error_feedback == "worker")


@dataclass(frozen=True)
class OneBitMean:
    """Every step: the gradients' mean compressed to 1 bit an element on onebit's all-to-all and all-gather,
    each side keeping its residual, then Lion's exact update on it with a momentum every rank shares.

    Args:
        adapt, range: the per-tensor scale's adaptation (≥ 1) and its shape's range (≥ 1).
        norm: how the scale averages: ``'arithmetic'`` or ``'geometric'``.
        restart: steps between restarts of the residuals (0: never).
        tie: where a zero goes: ``'alternate'``, ``'plus'`` or ``'minus'``.
    """

    adapt: float = ADAPT_DEFAULT
    range: float = RANGE_DEFAULT
    norm: str = NORM_DEFAULT
    restart: int = RESTART_DEFAULT
    tie: str = "alternate"
    name = "onebit-mean"

    def __post_init__(self):
        for key in ("adapt", "range"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, Real) or not (math.isfinite(value) and value >= 1):
                raise ValueError(f"OneBitMean.{key} must be a finite number >= 1, got {value!r}")
        check_choice("OneBitMean.norm", self.norm, NORMS)
        if isinstance(self.restart, bool) or not isinstance(self.restart, int) or self.restart < 0:
            raise ValueError(f"OneBitMean.restart must be an int >= 0, got {self.restart!r}")
        check_choice("OneBitMean.tie", self.tie, ("alternate", "plus", "minus"))

    def for_step(self) -> dict:
        return dict(vote="onebit", aggregate="mean", tie=self.tie, mean_adapt=self.adapt, mean_range=self.range,
                    mean_norm=self.norm, mean_restart=self.restart)

    def for_round(self) -> dict:
        raise ValueError("OneBitMean shares a momentum across every step; for local steps use ScatterMean (the same "
                         "two 1-bit collectives, on Δ) or LaneMean")


@dataclass(frozen=True)
class LaneMean:
    """Local steps only: Δ's mean in ``bits``-bit lanes of one all-reduce. Every rank quantizes v_i with one
    shared L1 scale, the lanes' sum returns Σ_i q_i exactly, ``d`` is their dequantized mean.

    Args:
        bits: the lane width, 2, 4 or 8 (None: the smallest exact for the world size).
        error_feedback: keep each worker's residual e_i (what was meant minus what was sent).
    """

    bits: Optional[int] = 8
    error_feedback: bool = True
    name = "lane-mean"

    def __post_init__(self):
        _check_bits("LaneMean", self.bits, votes.METHODS["pbit"].LANE_BITS, optional=True)
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"LaneMean.error_feedback must be a bool, got {self.error_feedback!r}")

    def for_step(self) -> dict:
        raise ValueError("LaneMean averages a round's Δ; every step use OneBitMean (or Mean)")

    def for_round(self) -> dict:
        return dict(vote="pbit", bits=self.bits, quantizer="l1", aggregate="mean", error_feedback=self.error_feedback)


@dataclass(frozen=True)
class ScatterMean:
    """Local steps only: Δ's mean in ``bits`` bits an element in each of two collectives: each rank sends every
    chunk owner its code of that span (all-to-all), the owner decodes the mean, adds its residual and sends the
    mean's code back (all-gather). Every worker and every owner keeps its residual (4/P bytes a parameter).

    Args:
        bits: the code width, 1, 2, 4 or 8.
    """

    bits: int = 4
    name = "scatter-mean"

    def __post_init__(self):
        from .votes.scatter import SCATTER_BITS

        _check_bits("ScatterMean", self.bits, SCATTER_BITS)

    def for_step(self) -> dict:
        raise ValueError("ScatterMean averages a round's Δ; every step use OneBitMean (the same two collectives on "
                         "the gradient, with a shared momentum)")

    def for_round(self) -> dict:
        return dict(vote="onebit", bits=self.bits, aggregate="mean", error_feedback=True)


Aggregation = Union[Mean, SignVote, OneBitMean, LaneMean, ScatterMean]
AGGREGATIONS = {cls.name: cls for cls in (Mean, SignVote, OneBitMean, LaneMean, ScatterMean)}
"""The string shortcuts: each name is its class with the defaults."""


def aggregation_of(value, where: str) -> Aggregation:
    """``value`` (an aggregation object or its shortcut) as an object; ``where`` (``'LionCub'`` or
    ``'LocalCub'``) names the argument's owner in the refusal."""
    if isinstance(value, str):
        if value not in AGGREGATIONS:
            raise ValueError(f"{where}: aggregation must be one of {tuple(AGGREGATIONS)} or an object of "
                             f"lioncub.aggregations, got {value!r}")
        return AGGREGATIONS[value]()
    if not isinstance(value, tuple(AGGREGATIONS.values())):
        raise TypeError(f"{where}: aggregation must be one of {tuple(AGGREGATIONS)} or an object of "
                        f"lioncub.aggregations, got {type(value).__name__}")
    return value


def step_aggregation(flags: dict) -> Aggregation:
    """The object an every-step optimizer's engine ``flags`` (``vote``, ``bits``, ``quantizer``, ``tie``,
    ``error_feedback``, ``stochastic_signs``, ``aggregate``, ``mean_*``, ``grad_dtype``) describe: how the harness
    and the recorded method names reach the objects. Unknown keys are left in ``flags``."""
    vote = flags.pop("vote", "pbit")
    keys = ("bits", "quantizer", "tie", "error_feedback", "stochastic_signs", "aggregate", "grad_dtype",
            "mean_adapt", "mean_range", "mean_norm", "mean_restart")
    got = {k: flags.pop(k) for k in keys if k in flags}
    aggregate = got.pop("aggregate", "vote")
    check_choice("aggregate", aggregate, ("vote", "mean"))
    if vote == "grad":
        _nothing_else(got, "grad_dtype", vote)
        return Mean(dtype=got.get("grad_dtype", "fp32"))
    check_choice("grad_dtype", got.pop("grad_dtype", "fp32"), ("fp32", "bf16"))
    if aggregate == "mean":
        if vote != "onebit":
            raise ValueError(f"aggregate='mean' runs on onebit's collectives: it needs vote='onebit', got vote={vote!r}")
        mean = {k[5:]: got.pop(k) for k in list(got) if k.startswith("mean_")}
        for name, default in (("error_feedback", "none"), ("stochastic_signs", False)):
            if got.get(name, default) not in (default,):
                raise ValueError(f"aggregate='mean' keeps its own residuals on both sides: {name} must keep its "
                                 f"default, got {name}={got[name]!r}")
        if got.get("tie") == "hold":
            raise ValueError("tie='hold' repeats a voted sign; aggregate='mean' votes none")
        return OneBitMean(tie=got.get("tie", "alternate"), **mean)
    for k in [k for k in got if k.startswith("mean_")]:
        if got.pop(k) != MEAN_DEFAULTS[k]:
            raise ValueError(f"{k} applies to aggregate='mean' only, got aggregate={aggregate!r}")
    return SignVote(transport=vote, **got)


def round_aggregation_of(flags: dict) -> Aggregation:
    """As :func:`step_aggregation`, for a round (LocalCub's engine flags, ``error_feedback`` a bool)."""
    vote = flags.pop("vote", "onebit")
    got = {k: flags.pop(k) for k in ("bits", "quantizer", "tie", "error_feedback", "aggregate") if k in flags}
    aggregate = got.pop("aggregate", "vote")
    check_choice("aggregate", aggregate, ("vote", "mean"))
    ef = got.pop("error_feedback", False)
    if not isinstance(ef, bool):
        raise TypeError(f"error_feedback must be a bool, got {ef!r}")
    if vote == "grad":
        if ef:
            raise ValueError("error_feedback needs a compressed vote: vote='grad' sends Δ exactly")
        _nothing_else(got, None, vote)
        return Mean()
    if aggregate == "mean" and vote == "pbit":
        if got.get("quantizer") != "l1":
            raise ValueError(f"aggregate='mean' on vote='pbit' needs quantizer='l1' (the lane mean), got "
                             f"{got.get('quantizer')!r}")
        return LaneMean(bits=got.get("bits"), error_feedback=ef)
    if aggregate == "mean" and vote == "onebit":
        if not ef:
            raise ValueError("aggregate='mean' on vote='onebit' sends Δ in 1-8 bits and keeps what it loses: it "
                             "needs error_feedback=True")
        bits = got.get("bits")
        return ScatterMean(bits=1 if bits is None else bits)
    if aggregate == "mean":
        raise ValueError(f"aggregate='mean' needs vote='pbit' with quantizer='l1' or vote='onebit', got {vote!r}")
    return SignVote(transport=vote, error_feedback="worker" if ef else "none", **got)


def _nothing_else(got: dict, allowed: Optional[str], vote: str) -> None:
    defaults = dict(tie="alternate", error_feedback="none", stochastic_signs=False, **MEAN_DEFAULTS)
    for k, v in got.items():
        if k != allowed and v is not None and v != defaults.get(k):
            where = "the 1-bit paths only" if k == "tie" else "the votes only"
            raise ValueError(f"{k}={v!r} applies to {where}, not to vote={vote!r}")

