"""LionCub's checkpoints: what ``state_dict`` adds to torch's and what ``load_state_dict`` checks
before it takes anything (:mod:`lioncub.engine.resume`: settings, rank, world, shapes, finite momenta)."""
from __future__ import annotations

import copy

import torch

from .. import comm
from ..engine import resume
from ..engine.step import BucketPlan
from ..votes.rounds import Agreement

__all__ = ["StepCheckpoint", "RoundCheckpoint"]


class StepCheckpoint:
    """``state_dict`` / ``load_state_dict`` of the every-step optimizer (a mixin before
    ``torch.optim.Optimizer``): counters, the generator, momentum sync, ``vote='auto'``'s pick and
    the chunk owners' state, in one envelope (:class:`~lioncub.engine.shell.Shell`)."""

    def state_dict(self) -> dict:
        sd = super().state_dict()
        server = self.method is not None and self.method.owner_state  # the chunk owners' residuals / held votes
        sd[self.state_key] = self.envelope(dict(steps=self.steps, skipped_steps=self.skipped_steps),
                                           vote_requested=self.vote_requested,
                                           momentum_sync=self.momentum_sync.state_dict(),
                                           **(dict(server_residuals=self.bucket_step.owners.saved()) if server else {}))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        if isinstance(state_dict, dict) and isinstance(state_dict.get(self.state_key), dict):
            state_dict = {**state_dict, self.state_key: resume.upgrade_envelope(state_dict[self.state_key])}
        extra = state_dict.get(self.state_key) if isinstance(state_dict, dict) else None
        if isinstance(extra, dict) and "server_residuals" in extra:  # before the rank check: say why
            resume.check_server_world(extra["config"]["error_feedback"], extra["world_size"], self.world_size,
                                      tie=extra["config"].get("tie", "alternate"),
                                      aggregate=extra["config"].get("aggregate", "vote"))
        if extra is not None and self.vote_requested == "auto" and extra.get("vote_requested") == "auto":
            saved = extra["config"]  # resume with the run's pick
            self._set_config(self.config.resolved(saved["vote"], saved["bits"]))
        extra = resume.check_loadable(self, state_dict)  # settings, rank, world, shapes, finite momenta: once
        # a copy: torch keeps same-dtype tensors by reference, which would share momenta
        base = copy.deepcopy({k: v for k, v in state_dict.items() if k != self.state_key})
        super().load_state_dict(base)
        self.plan = BucketPlan(self.param_groups, self.config.bucket_mb, self.config.fused)  # torch's new groups
        self.bucket_step.state = self.state  # torch's new state dict
        self.steps = int(extra["counters"]["steps"])
        self.skipped_steps = int(extra["counters"].get("skipped_steps", 0))
        comm.restore_generator(self.generator, extra["generator"])
        self.momentum_sync.load_state_dict(extra.get("momentum_sync", {}))
        self.bucket_step.owners.load(extra.get("server_residuals", []),
                                     self.method is not None and self.method.owner_state == "held", self.device)


class RoundCheckpoint:
    """``state_dict`` / ``load_state_dict`` of LocalCub (a mixin before ``torch.optim.Optimizer``):
    counters, the inner optimizer, the generator, a streaming round's agreement in flight, and each
    rank's own parameters inside a round."""

    def state_dict(self) -> dict:
        """The state (see docs/local_steps.md). With ``delay=1`` and an agreement in flight it
        waits for it (a collective in flight cannot be saved) and saves its ``d``, not yet applied."""
        pending = None
        if self._pending is not None:
            d, signed = self._pending.result()
            pending = dict(d=d.clone(), signed=signed)
        sd = super().state_dict()
        counters = dict(rounds=self.rounds, local_step=self.local_step, skipped_rounds=self.skipped_rounds,
                        bad_round=self._bad_round)
        sd[self.state_key] = self.envelope(
            counters, inner=self.inner.state_dict(), vote_requested=self.vote_requested,
            # inside a round every rank's parameters are its own (a model checkpoint holds one rank's)
            params=[p.detach().clone() for p in self.params] if self.local_step else None, pending=pending)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        extra = state_dict.get(self.state_key) if isinstance(state_dict, dict) else None
        if extra is not None and "counters" not in extra:  # saved before the envelope: flat counters
            extra = {**extra, "counters": {k: extra[k] for k in ("rounds", "local_step", "skipped_rounds",
                                                                 "bad_round")}}
            state_dict = {**state_dict, self.state_key: extra}
        if extra is not None and self.vote_requested == "auto" and extra.get("vote_requested") == "auto":
            saved = extra["config"]  # resume with the run's pick
            self._set_config(self.config.resolved(saved["vote"], saved["bits"]))
        extra = self.open_envelope(state_dict)  # kind, settings, rank and world size
        base = copy.deepcopy({k: v for k, v in state_dict.items() if k != self.state_key})
        super().load_state_dict(base)
        self.inner.load_state_dict(copy.deepcopy(extra["inner"]))
        self.param_groups = self.inner.param_groups
        counters = extra["counters"]
        self.rounds, self.local_step = int(counters["rounds"]), int(counters["local_step"])
        self.skipped_rounds, self._bad_round = int(counters["skipped_rounds"]), bool(counters["bad_round"])
        if extra.get("generator") is not None:  # (checkpoints before the generator: global RNG)
            comm.restore_generator(self.generator, extra["generator"])
        pending = extra.get("pending")
        self._pending = None if pending is None else Agreement.finished(pending["d"].clone(), pending["signed"])
        if extra.get("params") is not None:
            with torch.no_grad():
                for p, saved in zip(self.params, extra["params"]):
                    p.copy_(saved)
        elif self.delay:  # at a round's end a streaming replica is its origin o_i
            with torch.no_grad():
                for p in self.params:
                    p.copy_(self.state[p]["origin"])
