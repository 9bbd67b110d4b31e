"""The registry of vote methods by name (re-exported by :mod:`lioncub.votes`; a module of its own so that the
round aggregations, which :mod:`lioncub.votes` also imports, can read it)."""
from __future__ import annotations

from .base import VoteMethod
from .gather import Gather
from .onebit import OneBit
from .pbit import PBit
from .sign_allreduce import SignAllreduce

__all__ = ["METHODS"]

METHODS: dict[str, type[VoteMethod]] = {cls.name: cls for cls in (
    SignAllreduce,
    Gather,
    OneBit,
    PBit,
)}
"""The registry: adding a method is its module plus one line here."""
