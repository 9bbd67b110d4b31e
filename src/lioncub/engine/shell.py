"""The shell every Lion Cub optimizer steps inside: :class:`Shell`.

:class:`~lioncub.LionCub`, :class:`~lioncub.LocalCub` and :class:`~lioncub.NodeCub` differ in
what a step does; around it they need the same things, written here once:

* the world: this rank and the group's size (:func:`world_of`), the one communication device
  (:func:`lioncub.comm.comm_device`), the parameters' names for errors;
* the start: every rank holds the same model (:func:`lioncub.engine.guard.check_same_params`) and
  starts from rank 0's values (one broadcast per chunk), both once, over the group the
  optimizer keeps identical (NodeCub: the whole world, in-node ranks included);
* the stochastic quantizer's generator (``seed + rank``, on the device, saved);
* the closure, run with gradients enabled;
* the non-finite policy under one name: ``nonfinite='raise'`` or ``'skip'`` (the older
  spellings ``'skip_step'`` and ``'skip_round'`` are accepted and mean ``'skip'``), and the
  replica-check cadence ``check_every``;
* one state envelope: ``{"kind", "config", "counters", "rank", "world_size", "generator"}``
  under the optimizer's own key, and one fingerprint check on load (:meth:`Shell.open_envelope`).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm
from . import guard, shards
from ..votes.mean import saved_fingerprint
from ..options import NONFINITE_ALIASES, NONFINITE_POLICIES  # (re-exported: the engine's names for them)
from ..validate import check_hyperparameters

__all__ = ["Shell", "world_of", "NONFINITE_POLICIES", "NONFINITE_ALIASES"]


def world_of(group) -> tuple[int, int]:
    """(this rank in ``group``, the group's size); (0, 1) without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("process_group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class Shell:
    """Mixed into a :class:`torch.optim.Optimizer` subclass; :meth:`open_shell` runs after
    ``torch.optim.Optimizer.__init__`` (it needs the param groups).

    ``state_key``: the optimizer's entry in its ``state_dict`` (``'lioncub'``, ``'local'``, ...).
    """

    state_key: str

    def open_shell(self, params: Sequence[Tensor], *, group, model: Optional[torch.nn.Module], nonfinite: str,
                   check_every: int, seed: int, verify: bool = True, generator: bool = True,
                   chunks: Optional[Iterable[Sequence[Tensor]]] = None, sharding=None,
                   frozen: Sequence[Tensor] = ()) -> None:
        """World, device, names, policy; then (``verify``) the same-model check and rank 0's values
        over ``group``, broadcast ``chunks`` at a time (default: all at once), and (``generator``)
        this rank's quantizer generator. Collective when ``verify``. ``frozen``: parameters outside the
        step (``requires_grad=False``) checked and broadcast with the others.

        ``sharding``: FSDP2's layout (:class:`~lioncub.engine.shards.Sharding`): ``params`` are then the
        local shards, ``group`` the replicas' group (this rank and size from the sharding: 0 of 1 without
        replicas), and the step's agreement spans the whole world (``agree_group``, ``agree_size``)."""
        self.nonfinite = NONFINITE_ALIASES.get(nonfinite, nonfinite)  # (both checked by Options, where given)
        self.check_every = check_every
        if sharding is None:
            shards.refuse_dtensors(params, type(self).__name__)
        self.sharding = sharding
        """FSDP2's layout of the parameters (:mod:`lioncub.engine.shards`), None for plain parameters."""
        self.group = group
        # agree_group / agree_size: the ranks that agree on each step (which gradients exist, whether all are
        # finite): the optimizer's group, or with FSDP2 parameters the whole world (every shard of every replica)
        if sharding is None:
            self.rank, self.world_size = world_of(group)
            self.agree_group, self.agree_size = group, self.world_size
        else:
            self.rank, self.world_size = sharding.rank, sharding.size
            self.agree_group, self.agree_size = None, dist.get_world_size()
        self.device = comm.comm_device(list(params), group)
        """The one device of the parameters, the optimizer's state, messages and every collective."""
        self._param_names = guard.param_names(model, params if sharding is None else sharding.params)
        if verify:  # frozen parameters too: the forward pass reads them
            frozen = [shards.local_of(p) for p in frozen]
            guard.check_same_params(list(params) + frozen, group, self.world_size, names=self._param_names)
            if self.world_size > 1:
                with torch.no_grad():
                    for chunk in [*(chunks if chunks is not None else [params]), frozen]:
                        comm.broadcast_from_first(list(chunk), group)
        self.generator = comm.make_generator(self.device, seed + self.rank) if generator else None
        """The stochastic quantizer's (``linf``) draws: this rank's own, on the device, saved."""

    @staticmethod
    def run_closure(closure: Optional[Callable[[], float]]):
        """``closure()`` with gradients enabled (steps run under ``no_grad``), or None."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def check_due(self, count: int) -> bool:
        """Whether the replicas are checked after ``count`` steps (rounds): every ``check_every``."""
        return bool(self.check_every) and count > 0 and count % self.check_every == 0

    # ------------------------------------------------------------------ state
    def fingerprint(self) -> dict:
        """The settings a checkpoint must match to resume bit-exactly (subclasses extend)."""
        raise NotImplementedError

    def envelope(self, counters: dict, **extra) -> dict:
        """This optimizer's ``state_dict`` entry: kind, config, counters, whose state, generator."""
        return {"kind": type(self).__name__, "config": self.fingerprint(), "counters": dict(counters),
                "rank": self.rank, "world_size": self.world_size,
                "generator": None if self.generator is None else self.generator.get_state(),
                **extra}

    def open_envelope(self, state_dict: dict, *, same_rank: bool = True) -> dict:
        """The checked envelope of ``state_dict``: saved by this kind of optimizer, with this
        config (one message per differing setting), by this rank of this world (``same_rank``;
        else this world size). ``ValueError`` otherwise; nothing is restored here."""
        kind = type(self).__name__
        env = state_dict.get(self.state_key) if isinstance(state_dict, dict) else None
        if env is None:
            raise ValueError(f"state_dict has no {self.state_key!r} entry: it was not saved by {kind}.state_dict()")
        if env.get("kind", kind) != kind:
            raise ValueError(f"state_dict was saved by {env['kind']}, not {kind}")
        mine = self.fingerprint()
        for key, value in saved_fingerprint(env["config"]).items():
            if key in mine and mine[key] != value:
                raise ValueError(f"checkpoint was saved with {key}={value!r} but this optimizer has "
                                 f"{key}={mine[key]!r}")
        if same_rank and (env["rank"], env["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"checkpoint holds the state of rank {env['rank']} of {env['world_size']}, but this is rank "
                f"{self.rank} of {self.world_size}; load each rank's own state dict, or convert a checkpoint "
                "from another world size with lioncub.engine.resume.reshard_states")
        if not same_rank and env["world_size"] != self.world_size:
            raise ValueError(f"checkpoint was saved by {env['world_size']} workers, this run has "
                             f"{self.world_size}: the saved state is per worker")
        return env


class CheckedGroups:
    """``add_param_group`` with the constructor's checks: valid hyper-parameters, and after construction
    the optimizer's one device (a mixin before ``torch.optim.Optimizer``)."""

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]  # now filled with defaults
        try:
            check_hyperparameters(g["lr"], g["betas"], g["weight_decay"])
            if hasattr(self, "device"):  # a group added after construction: the same one device
                for i, p in enumerate(g["params"]):
                    if p.device != self.device:
                        raise ValueError(f"parameter {i} of the new group is on {p.device}, this optimizer's "
                                         f"parameters on {self.device}: one optimizer communicates on one device")
        except (TypeError, ValueError) as exc:
            self.param_groups.pop()
            raise type(exc)(f"param group {len(self.param_groups)}: {exc}") from None
