"""The optimizers under the engine's flat keywords (``vote=``, ``bits=``, ``aggregate=``, ``delay=``, ...).

Most exact tests were written before :mod:`lioncub.aggregations`; they name settings by these keys. Each class
here is the public class itself (a subclass adding nothing but the translation): its ``__init__`` turns the flat
keys into the public arguments with :mod:`lioncub.optim.flags` and calls the public constructor, so every such
test runs through the public API. The defaults are the engine's (``vote='pbit'`` every step; ``vote='onebit'``,
``inner='lion'`` in rounds), not the public classes' (tests/test_api.py checks the public ones).
"""
from __future__ import annotations

import lioncub
from lioncub.optim.flags import node_kwargs, round_kwargs, step_kwargs
from lioncub.optim.nodecub import NodeCub as _NodeCub

BETAS = (0.9, 0.99)


class LionCub(lioncub.LionCub):
    def __init__(self, params, lr=1e-4, betas=BETAS, weight_decay=0.0, **flat):
        super().__init__(params, lr, betas, weight_decay, **step_kwargs(flat))


class LocalCub(lioncub.LocalCub):
    def __init__(self, params, lr=1e-4, betas=BETAS, weight_decay=0.0, **flat):
        super().__init__(params, lr, betas, weight_decay, **round_kwargs(flat))


class NodeCub(_NodeCub):
    def __init__(self, params, lr=1e-4, betas=BETAS, weight_decay=0.0, **flat):
        super().__init__(params, lr, betas, weight_decay, **node_kwargs(flat))


def FTLocalCub(params, manager, *, lr=1e-4, betas=BETAS, weight_decay=0.0, max_attempts=None, **flat):
    """``LocalCub(..., manager=manager)`` (the torchft class it builds), from flat keys."""
    from lioncub.ft import FTLocalCub as cls

    kw = round_kwargs(flat)
    if max_attempts is not None:
        kw["options"] = lioncub.Options(**kw["options"].given(), max_attempts=max_attempts)
    return cls(params, lr, betas, weight_decay, manager=manager, **kw)


def FTLionCub(params, manager, lr=1e-4, betas=BETAS, weight_decay=0.0, *, max_attempts=None, **flat):
    """``LionCub(..., manager=manager)`` (the torchft class it builds), from flat keys."""
    kw = step_kwargs(flat)
    if max_attempts is not None:
        kw["options"] = lioncub.Options(**kw["options"].given(), max_attempts=max_attempts)
    return lioncub.LionCub(params, lr, betas, weight_decay, manager=manager, **kw)
