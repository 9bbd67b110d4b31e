"""LionCub's checkpoints: what ``state_dict`` adds to torch's and what ``load_state_dict`` checks
before it takes anything (:mod:`lioncub.engine.resume`: settings, rank, world, shapes, finite momenta)."""
from __future__ import annotations

import copy

import torch

from .. import comm
from ..engine import resume
from ..engine.shards import local_of
from ..votes.feedback import owner_state_what
from ..engine.step import BucketPlan
from ..votes.rounds import Agreement

__all__ = ["StepCheckpoint", "RoundCheckpoint"]


class StepCheckpoint:
    """``state_dict`` / ``load_state_dict`` of the every-step optimizer (a mixin before
    ``torch.optim.Optimizer``): counters, the generator, momentum sync, ``vote='auto'``'s pick and
    the chunk owners' state, in one envelope (:class:`~lioncub.engine.shell.Shell`)."""

    def state_dict(self) -> dict:
        """torch's state (momenta per parameter; with FSDP2 parameters DTensors placed like them, and the
        step count in each parameter's ``'step'``, what ``torch.distributed.checkpoint`` keeps) and this
        optimizer's envelope under ``state_key`` (which torch.distributed.checkpoint drops)."""
        sd = super().state_dict()
        if self.sharding is not None:  # every replica's state, told apart (Sharding.stacked), and the count
            ordered = [self._local(p) for g in self.param_groups for p in g["params"]]
            sd["state"] = {k: {**{key: self.sharding.stacked(ordered[k], local_of(t)) if torch.is_tensor(t) else t
                                  for key, t in v.items()}, "step": torch.tensor(float(self.steps))}
                           for k, v in sd["state"].items()}
        server = self.method is not None and self.method.owner_state  # the chunk owners' residuals / held votes
        sd[self.state_key] = self.envelope(dict(steps=self.steps, skipped_steps=self.skipped_steps),
                                           vote_requested=self.vote_requested,
                                           momentum_sync=self.momentum_sync.state_dict(),
                                           **(dict(server_residuals=self.bucket_step.owners.saved()) if server else {}))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        if self.sharding is not None and isinstance(state_dict, dict):
            return self._load_sharded(state_dict)
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
        self._load_torch_state(base)
        self._restore(extra)

    def _restore(self, env: dict) -> None:
        """What the checked envelope ``env`` holds beside torch's state: counters, generator, momentum
        sync, the chunk owners' state."""
        self.steps = int(env["counters"]["steps"])
        self.skipped_steps = int(env["counters"].get("skipped_steps", 0))
        comm.restore_generator(self.generator, env["generator"])
        self.momentum_sync.load_state_dict(env.get("momentum_sync", {}))
        self.bucket_step.owners.load(env.get("server_residuals", []),
                                     self.method is not None and self.method.owner_state == "held", self.device)


    def _load_torch_state(self, base: dict) -> None:
        """torch's ``load_state_dict`` of ``base``, then a plan of torch's new groups and the engine's view
        of its new state (without the ``'step'`` counts a sharded save adds)."""
        super().load_state_dict(base)
        for p, entry in self.state.items():
            entry.pop("step", None)
            if self.sharding is not None:  # this replica's slice, kept as its parameter's DTensor
                local = self._local(p)
                for key, t in entry.items():
                    if torch.is_tensor(t):
                        entry[key] = self.sharding.wrap(local, self.sharding.unstacked(local, t))
        self.plan = BucketPlan(self.param_groups, self.config.bucket_mb, self.config.fused, self._local)
        self.bucket_step.state = self.local_state

    def _load_sharded(self, state_dict: dict) -> None:
        """A state dict of FSDP2 parameters: this rank's own (``torch.save``; the envelope checked as for
        plain parameters), or as ``torch.distributed.checkpoint``'s ``set_optimizer_state_dict`` hands it
        (torch's ``state`` and ``param_groups``, no envelope: the step count from the parameters'
        ``'step'``; the chunk owners' state does not fit that format, so a setting that keeps it is
        refused). Each replica takes its own slice of the saved momenta."""
        env = state_dict.get(self.state_key)
        if env is not None:
            env = self.open_envelope({self.state_key: resume.upgrade_envelope(env)})
        elif self.method is not None and self.method.owner_state:
            what = owner_state_what(self.config.error_feedback, self.config.tie, self.config.aggregate)
            raise ValueError(f"state_dict: {what} outside the parameters' state, which torch.distributed.checkpoint "
                             "does not save; save each rank's opt.state_dict() with torch.save instead")
        saved = state_dict.get("state", {})
        steps = {float(v["step"]) for v in saved.values() if isinstance(v, dict) and "step" in v}
        if len(steps) > 1 or (saved and not steps):
            raise ValueError("state_dict: the parameters' 'step' counts differ or are missing: it was not saved by "
                             f"{type(self).__name__}.state_dict() of FSDP2 parameters")
        for i, entry in saved.items():
            for key, t in entry.items():
                if key != "step" and torch.is_floating_point(t) and not bool(torch.isfinite(local_of(t)).all()):
                    raise ValueError(f"state_dict holds a non-finite {key!r} for parameter {i}")
        self._load_torch_state(copy.deepcopy({k: v for k, v in state_dict.items() if k != self.state_key}))
        if env is None:
            self.steps = int(steps.pop()) if steps else 0
        else:
            self._restore(env)


class RoundCheckpoint:
    """``state_dict`` / ``load_state_dict`` of LocalCub (a mixin before ``torch.optim.Optimizer``):
    counters, the inner optimizer, the generator, a streaming round's agreement in flight, and each
    rank's own parameters inside a round."""

    def state_dict(self) -> dict:
        """The state (see docs/local_steps.md). With ``delay=1`` and an agreement in flight it
        waits for it (a collective in flight cannot be saved) and saves its ``d``, not yet applied."""
        pending, sent = None, comm.step_stats(self.device)  # (counted in the next step's record: self._unreported)
        if self._agreeing is not None:  # a fragment's verdict due: every rank reads it and launches the exchange now
            self._send_late(sent)  # (what it sends is the same at any step before it lands)
        if self._pending is not None:  # one agreement per chunk of the round (:meth:`Rounds._plan`)
            results = [agreement.result(sent) for agreement in self._pending]
            self._unreported = sent
            pending = dict(d=torch.cat([d for d, _ in results]) if results else torch.zeros(0, device=self.device),
                           signed=results[0][1] if results else False, fragment=self._pending_fragment)
        self._settle()  # (host state: the copies into it in flight landed, before it is handed out)
        sd = super().state_dict()
        counters = dict(rounds=self.rounds, local_step=self.local_step, skipped_rounds=self.skipped_rounds,
                        bad_round=bool(self._bad_round))
        sd[self.state_key] = self.envelope(
            counters, inner=self.inner.state_dict(), vote_requested=self.vote_requested,
            # inside a round (with fragments, always) every rank's parameters are its own (a model checkpoint holds
            # one rank's)
            params=[p.detach().clone() for p in self.params] if self.local_step or self.fragments > 1 else None,
            pending=pending,
            owner_residuals={str(k): r.clone() for k, r in self.owner_residuals.items()}, steps_pick=self.steps_pick,
            **({} if self.pace == "slowest" else dict(pace=self._pace_saved())))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        extra = state_dict.get(self.state_key) if isinstance(state_dict, dict) else None
        if extra is not None and "counters" not in extra:  # saved before the envelope: flat counters
            extra = {**extra, "counters": {k: extra[k] for k in ("rounds", "local_step", "skipped_rounds",
                                                                 "bad_round")}}
            state_dict = {**state_dict, self.state_key: extra}
        if extra is None and self.sharding is not None:
            raise ValueError(f"state_dict has no {self.state_key!r} entry (torch.distributed.checkpoint drops it): "
                             f"{type(self).__name__} keeps its inner optimizer and counters there; save and load each "
                             "rank's opt.state_dict() with torch.save")
        if extra is not None and self.vote_requested == "auto" and extra.get("vote_requested") == "auto":
            saved = extra["config"]  # resume with the run's pick
            self._set_config(self.config.resolved(saved["vote"], saved["bits"]))
        if extra is not None:
            self._restore_setting(extra.get("steps_pick"))  # aggregation='auto': the saved run's rounds
        extra = self.open_envelope(state_dict)  # kind, settings, rank and world size
        base = copy.deepcopy({k: v for k, v in state_dict.items() if k != self.state_key})
        self._settle()  # (host state: nothing in flight reads or writes what is replaced)
        # torch would cast the state to the parameters' dtype (a bf16 parameter's fp32 residual and momentum to bf16)
        # and onto their device, whole: ours instead, as saved, where it lives
        saved, base["state"] = base.get("state", {}), {}
        super().load_state_dict(base)
        self._load_outer_state(saved, [i for g in base["param_groups"] for i in g["params"]])
        self.inner.load_state_dict(copy.deepcopy(extra["inner"]))
        self.param_groups = self.inner.param_groups
        counters = extra["counters"]
        self.rounds, self.local_step = int(counters["rounds"]), int(counters["local_step"])
        self.skipped_rounds, self._bad_round = int(counters["skipped_rounds"]), bool(counters["bad_round"])
        if extra.get("generator") is not None:  # (checkpoints before the generator: global RNG)
            comm.restore_generator(self.generator, extra["generator"])
        pending = extra.get("pending")
        self._pending, self._agreeing = None, None
        if pending is not None:
            d = pending["d"].to(self.device)
            self._pending_fragment = int(pending.get("fragment", 0))
            lo, hi = self._fragment_spans()[self._pending_fragment]
            sizes = [sum(pc.size for pc in pieces) for pieces in self._plan()[lo:hi]]
            if d.numel() != sum(sizes):
                raise ValueError(f"state_dict's round in flight has {d.numel()} elements; these parameters have "
                                 f"{sum(sizes)}")
            self._pending = [Agreement.finished(part.clone(), pending["signed"]) for part in d.split(sizes)]
        if extra.get("agreeing") is not None:
            raise ValueError("state_dict holds a fragment's verdict without its exchange ('agreeing'), saved by a "
                             "LocalCub before 2026-12-05 that this one cannot resume; resume from a checkpoint of another step")
        self._restore_steps(extra.get("steps_pick"))
        self._restore_pace(extra.get("pace"))  # Options(pace='timed'): T and the time into the round
        self._restore_owner_residuals(extra.get("owner_residuals") or {})
        if extra.get("params") is not None:
            with torch.no_grad():
                for p, saved in zip(self.params, extra["params"]):
                    p.copy_(saved)
        elif self.delay:  # at a round's end a streaming replica is its origin o_i
            with torch.no_grad():
                for p in self.params:
                    p.copy_(self.local_state[p]["origin"], non_blocking=True)

    def _load_outer_state(self, saved: dict, ids: list) -> None:
        """The outer state of a checkpoint (torch's ``state``, by the saved parameter ids ``ids`` in the parameters'
        order) copied where this run keeps it (:meth:`~lioncub.optim.rounds.Rounds._placed`), in the dtype it was
        saved in, a tensor at a time (from a checkpoint of either ``outer_state``)."""
        for n, (p, i) in enumerate(zip(self.params, ids)):
            entry = self.local_state[p]
            for key, value in saved.get(i, {}).items():
                value = local_of(value)
                if value.shape != p.shape:
                    raise ValueError(f"state_dict's {key!r} of parameter {n} has shape {tuple(value.shape)}, the "
                                     f"parameter {tuple(p.shape)}")
                entry[key] = torch.empty_like(p, dtype=value.dtype, **self._placed()).copy_(value)

    def _restore_owner_residuals(self, saved: dict) -> None:
        """The aggregation's per-chunk state of a checkpoint, checked against this run's chunks."""
        plan = self._plan()
        self.owner_residuals = {}
        for key, r in saved.items():
            index = int(key)
            size = self.exchange.owner_elements(sum(pc.size for pc in plan[index])) if index < len(plan) else 0
            if r.numel() != size:
                raise ValueError(f"state_dict's owner residual of chunk {index} has {r.numel()} elements; this run's "
                                 f"round keeps {size} there (another round_chunk or aggregation)")
            self.owner_residuals[index] = torch.zeros(size, dtype=torch.float32, **self._placed()).copy_(r)
