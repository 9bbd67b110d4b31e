"""The optimizers' arguments from the engine's flat settings (``vote``, ``bits``, ``aggregate``, ``delay``, ...).

The harness's run configuration, the recorded method names of the races and the study, and the exact tests
written before :mod:`lioncub.aggregations` name settings by these flat keys; each function here turns them into
the public arguments (an aggregation object, :class:`~lioncub.Outer`, :class:`~lioncub.Streaming`,
:class:`~lioncub.Options`), so every such caller builds its optimizer through the public constructor. A key
that is neither an engine setting nor a public argument is a ``TypeError``, as Python's own.
"""
from __future__ import annotations

from ..aggregations import round_aggregation_of, step_aggregation
from ..options import ROUND_OPTIONS, STEP_OPTIONS, Options, Outer, Streaming
from ..validate import check_bool, check_int

__all__ = ["step_kwargs", "round_kwargs", "node_kwargs", "flat_lioncub", "flat_localcub", "flat_nodecub"]


def _options(flat: dict, allowed: tuple) -> Options:
    return Options(**{k: flat.pop(k) for k in allowed if k in flat})


def _unknown(flat: dict, owner: str) -> None:
    if flat:
        raise TypeError(f"{owner}() got unexpected keyword arguments {sorted(flat)}")


def step_kwargs(flat: dict, owner: str = "LionCub") -> dict:
    """LionCub's ``aggregation`` and ``options`` from the flat keys (``vote`` default ``'pbit'``); the public
    arguments in ``flat`` (``process_group``, ``overlap``, ``model``, ``manager``) pass through."""
    flat = dict(flat)
    keep = {k: flat.pop(k) for k in ("process_group", "overlap", "model", "manager") if k in flat}
    agg = step_aggregation(flat)
    opts = _options(flat, STEP_OPTIONS)
    _unknown(flat, owner)
    return dict(aggregation=agg, options=opts, **keep)


def round_kwargs(flat: dict, owner: str = "LocalCub") -> dict:
    """LocalCub's ``aggregation``, ``outer``, ``streaming`` and ``options`` from the flat keys (``vote`` default
    ``'onebit'``, ``aggregate='vote'``, ``inner='lion'``: the engine's defaults); ``local_steps``, ``inner``,
    ``process_group``, ``model`` and ``manager`` pass through."""
    flat = dict(flat)
    keep = {k: flat.pop(k) for k in ("local_steps", "process_group", "model", "manager") if k in flat}
    keep["inner"] = flat.pop("inner", "lion")
    outer = Outer(rule=flat.pop("outer", "sgd"), lr=flat.pop("outer_lr", 1.0), momentum=flat.pop("outer_momentum", 0.9),
                  betas=tuple(flat.pop("outer_betas", (0.9, 0.99))))
    delay = check_int("delay", flat.pop("delay", 0), 0, 1, what="rounds an outer step is applied late")
    fragments, eager = flat.pop("fragments", 1), check_bool("eager", flat.pop("eager", False))
    if not delay and eager:
        raise ValueError("eager=True stands in for an agreement in flight: it needs delay=1")
    if not delay and fragments != 1:
        check_int("fragments", fragments, 1, None, what="parts of the model streamed in turn")
        raise ValueError(f"fragments={fragments} staggers streaming rounds: it needs delay=1")
    streaming = Streaming(fragments=fragments, eager=eager) if delay else False
    agg = round_aggregation_of(flat)
    opts = _options(flat, ROUND_OPTIONS)
    _unknown(flat, owner)
    return dict(aggregation=agg, outer=outer, streaming=streaming, options=opts, **keep)


def node_kwargs(flat: dict) -> dict:
    """NodeCub's ``aggregation`` and ``options`` from the flat keys; ``layout``, ``shard`` and ``model`` pass
    through."""
    flat = dict(flat)
    for name in ("process_group", "overlap"):
        if name in flat:
            raise ValueError(f"{name} is not a NodeCub argument: NodeCub sets the vote's group itself and does not "
                             "overlap")
    keep = {k: flat.pop(k) for k in ("layout", "shard", "model") if k in flat}
    return dict(step_kwargs(flat, "NodeCub"), **keep)


def flat_lioncub(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **flat):
    """``LionCub`` built from flat keys (the bench scripts' and the device paths' recipes)."""
    from .lioncub import LionCub

    return LionCub(params, lr, betas, weight_decay, **step_kwargs(flat))


def flat_localcub(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **flat):
    """``LocalCub`` built from flat keys."""
    from .localcub import LocalCub

    return LocalCub(params, lr, betas, weight_decay, **round_kwargs(flat))


def flat_nodecub(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **flat):
    """The node layout's optimizer built from flat keys (``layout``, ``shard`` and the vote's)."""
    from .nodecub import NodeCub

    return NodeCub(params, lr, betas, weight_decay, **node_kwargs(flat))
