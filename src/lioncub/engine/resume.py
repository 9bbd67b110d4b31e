"""Resuming LionCub: what a checkpoint must hold, and moving it to another world size.

Same world size (bit-exact). Save ``opt.state_dict()`` on every rank (it is per
rank: local momenta ``m_i`` differ across ranks) and the parameters once (they are
identical). ``LionCub.state_dict()`` holds everything the next step depends on:

=====================  ==============================================================
entry                  why a bit-exact continuation needs it
=====================  ==============================================================
``state[i].exp_avg``   this rank's momentum ``m_i`` (never communicated in full)
``state[i]`` residual  ``ef_residual`` (``error_feedback='worker'``): this rank's ``e_i``
``server_residuals``   ``error_feedback='server'``: this chunk owner's ``r`` per message layout;
                       ``tie='hold'``: its chunk's last voted bits (uint8)
``counters.steps``     tie/zero parity of the 1-bit votes (+1 even, -1 odd steps)
``generator``          RNG of ``linf`` and ``stochastic_signs``, seeded ``seed + rank``
``momentum_sync``      counters of the momentum-sync policy (when the next sync is)
``counters.skipped``   non-finite steps skipped so far (a metric; steps do not advance)
``rank, world_size``   whose momenta these are: loading another rank's is refused
``config``             the vote settings (:meth:`VoteConfig.fingerprint`)
=====================  ==============================================================

The entry is the envelope every Lion Cub optimizer saves (``kind``, ``config``,
``counters``, ``rank``, ``world_size``, ``generator``; :class:`lioncub.engine.shell.Shell`).
Loading is refused with a ``ValueError`` for another vote method / lane width /
quantizer / tie rule / grad dtype, another rank or world size, another model (parameter
count, shapes) or non-finite momenta (:func:`check_loadable`). Checkpoints written before
the envelope (flat fields) load through :func:`upgrade_envelope`.

Another world size. :func:`reshard_states` is a pure function from the old
world's per-rank state dicts to the new world's. **Rule:** every new rank starts
from the mean of the old ranks' momenta (computed in float64, cast back): the
same operation as a full momentum synchronisation (``momentum_sync='all'``) at the
resize point, which the paper treats as harmless (§5). Error-feedback residuals
(``ef_residual``) are averaged the same way: each new rank starts with the mean
worker's un-sent mass (docs/votes.md). Server residuals (``error_feedback='server'`` or
``'both'``) belong to the chunks a P-rank world cuts the messages into: resharding them is
refused (``ValueError``). The step counter (and so the tie parity), the skipped-step count
and the momentum-sync counters carry over
(they are equal on all old ranks; rank 0's sync state is kept). Each new rank's
quantizer RNG is seeded from a hash of the old ranks' RNG states and its new rank:
deterministic, and distinct across ranks. Same world size returns an unchanged
copy.

Elastic restarts (``torchrun --max-restarts=N`` or ``--nnodes=MIN:MAX``): when a
worker dies, the survivors' next collective fails within the process group's
timeout with a :class:`lioncub.comm.CollectiveError` naming the collective and
step; the process exits non-zero, torchrun restarts every worker, and the training
script loads its newest complete checkpoint — calling :func:`reshard_states` first
when the restarted world is smaller or larger than the saved one.
"""
from __future__ import annotations

import copy
import hashlib
from typing import Sequence

import torch

from ..validate import check_int
from ..votes.feedback import owner_state_what

__all__ = ["reshard_states", "check_loadable", "upgrade_envelope", "check_server_world"]

_LEGACY_CONFIG = ("vote", "bits", "quantizer", "grad_dtype")
_LEGACY_COUNTERS = ("steps", "skipped_steps")


def upgrade_envelope(extra: dict) -> dict:
    """A LionCub entry in the envelope's form: unchanged if it is; one saved before the
    envelope (its settings and counters as flat fields, no tie rule: ``'alternate'``) moved in."""
    if "config" in extra:
        return extra
    out = {k: v for k, v in extra.items() if k not in _LEGACY_CONFIG + _LEGACY_COUNTERS}
    out["kind"] = "LionCub"
    out["config"] = {**{k: extra.get(k) for k in _LEGACY_CONFIG}, "tie": "alternate"}
    out["counters"] = {"steps": extra.get("steps", 0), "skipped_steps": extra.get("skipped_steps", 0)}
    return out


def _extra(sd: dict, where: str) -> dict:
    if not isinstance(sd, dict) or "lioncub" not in sd:
        raise ValueError(f"{where} has no 'lioncub' entry: it was not saved by LionCub.state_dict()")
    return upgrade_envelope(sd["lioncub"])


def _same_on_all_ranks(extra: dict) -> dict:
    """What every rank of one run saved alike: the settings and the counters."""
    return {**extra["config"], **extra["counters"]}


def _check_old_world(states: Sequence[dict]) -> None:
    old = len(states)
    extras = [_extra(sd, f"states[{r}]") for r, sd in enumerate(states)]
    for r, ex in enumerate(extras):
        if ex["world_size"] != old or ex["rank"] != r:
            raise ValueError(
                f"states must be every rank's state dict in rank order: states[{r}] was saved by rank "
                f"{ex['rank']} of {ex['world_size']}, but {old} states were given"
            )
        mine, first = _same_on_all_ranks(ex), _same_on_all_ranks(extras[0])
        for key in first.keys() | mine.keys():
            if mine.get(key) != first.get(key):
                raise ValueError(f"states disagree: rank {r} has {key}={mine.get(key)!r}, "
                                 f"rank 0 has {first.get(key)!r}")
        if states[r]["param_groups"] != states[0]["param_groups"]:
            raise ValueError(f"states disagree: rank {r}'s param_groups differ from rank 0's")


def _mean_momenta(states: Sequence[dict]) -> dict:
    """{param index: {key: mean over ranks}}; a rank without a state counts as zeros."""
    indices = sorted({i for sd in states for i in sd["state"]})
    merged = {}
    for i in indices:
        keys = sorted({k for sd in states if i in sd["state"] for k in sd["state"][i]})
        merged[i] = {}
        for k in keys:
            present = [(r, sd["state"][i][k]) for r, sd in enumerate(states) if k in sd["state"].get(i, {})]
            ref = present[0][1]
            if not torch.is_tensor(ref) or not torch.is_floating_point(ref):
                merged[i][k] = copy.deepcopy(ref)  # non-tensor entries: rank 0's (none today)
                continue
            total = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
            for r, t in present:
                if t.shape != ref.shape:
                    raise ValueError(f"states disagree: state[{i}][{k!r}] has shape {tuple(t.shape)} on "
                                     f"rank {r} and {tuple(ref.shape)} on rank {present[0][0]}")
                total += t.to(torch.float64)
            merged[i][k] = (total / len(states)).to(ref.dtype)
    return merged


def _derived_generator_state(states: Sequence[dict], new_rank: int) -> torch.Tensor:
    """A state for new rank ``new_rank``'s quantizer generator, of the old states' kind.

    Generator states are CPU byte tensors, a CUDA generator's too (``.cpu()`` in case a
    caller moved them). The new state is that of a generator like the saved one (a CPU one,
    or a CUDA one when the saved state is not a CPU generator's) seeded from the hash."""
    h = hashlib.sha256(b"lioncub.reshard")
    for sd in states:
        h.update(sd["lioncub"]["generator"].cpu().numpy().tobytes())
    h.update(new_rank.to_bytes(8, "little"))
    seed = int.from_bytes(h.digest()[:8], "little")
    cpu = torch.Generator()
    if states[0]["lioncub"]["generator"].numel() == cpu.get_state().numel():
        return cpu.manual_seed(seed).get_state()
    if torch.cuda.is_available():  # a CUDA generator's state (its seed and offset)
        return torch.Generator(device="cuda").manual_seed(seed).get_state()
    raise ValueError("the saved quantizer generator state is not a CPU generator's and CUDA is not available "
                     "here: reshard a checkpoint saved on CUDA where CUDA is available")


def check_server_world(error_feedback: str, saved: int, world: int, tie: str = "alternate",
                       aggregate: str = "vote") -> None:
    """Refuse, naming the argument, chunk-owner state (server residuals, ``tie='hold'``'s last
    votes, the 1-bit mean's residuals: :func:`~lioncub.votes.feedback.owner_state_what`) saved by
    ``saved`` ranks for ``world`` ranks: each is one chunk owner's, and the chunks are the P-rank world's."""
    what = owner_state_what(error_feedback, tie, aggregate)
    if saved == world or what is None:
        return
    raise ValueError(f"{what} for the chunks of the saved {saved}-rank world: they do not reshard to {world} "
                     f"ranks; resume on {saved} ranks")


def reshard_states(states: Sequence[dict], world_size: int) -> list[dict]:
    """Per-rank LionCub state dicts of an old world -> those of a ``world_size`` world.

    ``states[r]`` must be old rank ``r``'s ``LionCub.state_dict()``. Returns one state
    dict per new rank, to pass to that rank's ``LionCub.load_state_dict``. Momenta are
    averaged into every new rank (see the module docstring for the full rule).
    Pure: the inputs are not modified.

    Example (a 4-rank checkpoint resumed on 2 ranks)::

        old = [torch.load(f"ckpt/rank{r}.pt")["optimizer"] for r in range(4)]
        opt.load_state_dict(lioncub.engine.resume.reshard_states(old, 2)[dist.get_rank()])
    """
    check_int("world_size", world_size, 1)
    if len(states) == 0:
        raise ValueError("states must hold at least one rank's state dict, got none")
    _check_old_world(states)
    if world_size == len(states):
        return [copy.deepcopy(sd) for sd in states]
    config = _extra(states[0], "states[0]")["config"]
    check_server_world(config.get("error_feedback", "none"), len(states), world_size,
                       tie=config.get("tie", "alternate"), aggregate=config.get("aggregate", "vote"))
    merged = _mean_momenta(states)
    out = []
    for r in range(world_size):
        sd = {"state": copy.deepcopy(merged), "param_groups": copy.deepcopy(states[0]["param_groups"])}
        extra = copy.deepcopy(_extra(states[0], "states[0]"))
        extra.update(rank=r, world_size=world_size, generator=_derived_generator_state(states, r))
        sd["lioncub"] = extra
        out.append(sd)
    return out


def check_loadable(optimizer, state_dict: dict) -> dict:
    """Raise ``ValueError`` unless ``state_dict`` fits ``optimizer`` (a LionCub): its envelope
    (the same settings, rank and world size: :meth:`~lioncub.engine.shell.Shell.open_envelope`),
    the parameter count and shapes, finite momenta. Returns the checked envelope."""
    extra = optimizer.open_envelope({**state_dict, "lioncub": _extra(state_dict, "state_dict")})
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = [i for g in state_dict["param_groups"] for i in g["params"]]
    if len(saved) != len(params) or [len(g["params"]) for g in state_dict["param_groups"]] != \
            [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(
            f"checkpoint is for another model: it has {len(saved)} parameters in groups of "
            f"{[len(g['params']) for g in state_dict['param_groups']]}, this optimizer has {len(params)} in "
            f"groups of {[len(g['params']) for g in optimizer.param_groups]}"
        )
    names = getattr(optimizer, "_param_names", None)
    for k, (i, p) in enumerate(zip(saved, params)):
        for key, t in state_dict["state"].get(i, {}).items():
            if not torch.is_tensor(t):
                continue
            label = f"parameter {k}" + (f" ({names[k]!r})" if names and names[k] else "")
            if t.shape != p.shape:
                raise ValueError(f"checkpoint is for another model: {label} has shape {tuple(p.shape)}, "
                                 f"its saved {key!r} has shape {tuple(t.shape)}")
            if torch.is_floating_point(t) and not bool(torch.isfinite(t).all()):
                raise ValueError(f"checkpoint holds a non-finite {key!r} for {label}")
    return extra
