r"""Many ranks per node: average inside the node, vote across nodes (:class:`NodeCub`).

A cluster that suffers from a slow network usually has several GPUs per node on a
fast link (NVLink, PCIe) and nodes on slow Ethernet. A flat :class:`~lioncub.LionCub`
sends every rank's vote over the slow links. :class:`NodeCub` uses each link for what
it is good at. With ``L`` ranks per node and ``N`` nodes, per step:

1. **Average inside the node** (fast link): one fp32 SUM all-reduce of the gradients
   over the node's ``L`` ranks, divided by ``L``. Every rank of a node now holds the
   node's mean gradient ``ḡ_k``, bit for bit.
2. **Vote across nodes** (slow link): a :class:`~lioncub.LionCub` over the *cross-node*
   group of this local rank (local rank ``j`` of every node). Its momentum is the
   node's: ``m_k ← β2·m_k + (1-β2)·ḡ_k`` — D-Lion with the node as the worker, so the
   vote has ``N`` voters, not ``N·L``.

   - ``shard=True`` (default): the parameters are split into ``L`` shards of about
     equal size; local rank ``j`` keeps the momenta of shard ``j`` only and votes on it
     with its counterparts in the other nodes. Each node then sends one voter's bytes
     in all, spread over its ``L`` ranks' connections, and holds each momentum once.
   - ``shard=False``: every local rank votes on the whole model with its counterparts
     (each node sends ``L`` copies of the same vote; no step 3). The inputs of the
     ``L`` cross-node groups are identical, so are their results.
3. **Share inside the node** (fast link, ``shard=True``): one all-gather of the
   updated shards, so every rank holds the whole updated model.

Replicas stay bit-identical on all ``N·L`` ranks: inside a node the all-reduce and
all-gather deliver the same bytes to every rank; across nodes each parameter's update
is one cross-node vote. One node (``N = 1``) is the node average, then plain Lion on
it (a vote of one). ``L = 1`` is a flat LionCub.

Groups come from :func:`node_groups` (torchrun sets ``LOCAL_WORLD_SIZE``; ranks
``k·L … k·L+L-1`` form node ``k``)::

    dist.init_process_group("nccl")                       # torchrun --nnodes 2 --nproc-per-node 8
    layout = lioncub.node_groups()                          # L = LOCAL_WORLD_SIZE
    opt = lioncub.LionCub(model.parameters(), lr=3e-4, process_group=layout)   # builds this class

``last_step_stats`` counts what crossed the nodes (the vote); ``last_intra_stats`` the
in-node average and share.

Few nodes means few voters, and an even number of voters ties. With two nodes every
disagreement is a tie: ``onebit`` (which cannot send 0) resolves it by the step's parity and
trained 0.31 nats worse than the flat vote on our GPT recipe; ``pbit`` / ``gather`` /
``sign_allreduce`` send 0 there and matched it (bench/README.md, "Many ranks per node").
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..engine import amp, auto, guard
from .. import chunks, comm
from ..comm import CommStats
from . import lioncub as _lioncub
from .lioncub import engine_lioncub
from ..engine.shell import Shell
from ..validate import check_bool, check_hyperparameters, check_int
from ..aggregations import aggregation_of
from ..options import STEP_OPTIONS, Options

__all__ = ["NodeLayout", "node_groups", "node_mean", "NodeCub"]

# LionCub arguments NodeCub sets itself (the vote's group) or does not offer


@dataclass(frozen=True)
class NodeLayout:
    """Where this rank sits: ``nodes`` nodes of ``local_size`` consecutive ranks each.

    ``intra``: this node's group (fast link). ``inter``: this local rank's cross-node
    group (local rank ``local_rank`` of every node; slow links)."""

    world_size: int
    local_size: int
    nodes: int
    rank: int
    node: int
    local_rank: int
    intra: object
    inter: object


def _check_local_size(local_size, world: int) -> int:
    if local_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError("local_size: give the ranks per node, or run under torchrun (which sets "
                             "LOCAL_WORLD_SIZE)")
        try:
            local_size = int(env)
        except ValueError:
            raise ValueError(f"local_size: LOCAL_WORLD_SIZE must be an int, got {env!r}") from None
    check_int("local_size", local_size, 1)
    if world % local_size:
        raise ValueError(f"local_size must divide the world size {world} (nodes of equal size), got {local_size}")
    return local_size


def node_groups(local_size: Optional[int] = None) -> NodeLayout:
    """Build the in-node and cross-node groups of the default (world) group. Collective:
    every rank calls it, with the same ``local_size`` (default: ``LOCAL_WORLD_SIZE``)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("node_groups needs an initialised torch.distributed process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    local = _check_local_size(local_size, world)
    nodes = world // local
    intra, _ = dist.new_subgroups_by_enumeration([list(range(k * local, (k + 1) * local)) for k in range(nodes)])
    inter, _ = dist.new_subgroups_by_enumeration([list(range(j, world, local)) for j in range(local)])
    return NodeLayout(world, local, nodes, rank, rank // local, rank % local, intra, inter)


def shard_owners(sizes: list[int], local_size: int) -> list[int]:
    """The local rank that owns each parameter: largest first onto the least-loaded rank
    (ties: lowest index, lowest rank). Deterministic, so every rank computes the same map."""
    load = [0] * local_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = min(range(local_size), key=lambda j: (load[j], j))
        owners[i] = j
        load[j] += sizes[i]
    return owners


NODE_CHUNK = 1 << 22
"""Elements of gradients (in-node mean) or parameters (in-node share) one collective carries: whole tensors, a
larger tensor in slices. The step's transient is a chunk, not the model."""


def node_mean(params: list, group, size: int, device: torch.device, stats: CommStats) -> None:
    """Every rank's gradients become their mean over ``group`` of ``size`` ranks (NodeCub's step 1, and the node mean
    inside a torchft replica group, :class:`~lioncub.ft.FTLocalCub`): fp32 SUM all-reduces, ``NODE_CHUNK`` elements at
    a time (a large tensor in slices), divided by ``size``. A missing gradient counts as zero; a parameter without a
    gradient on any rank of the group keeps ``None``, which the host reads from the flags only where this rank lacks
    one (a parameter no rank has one for lacks one here too): none of the usual steps syncs with the host."""
    lacking = any(p.grad is None for p in params)
    missing = torch.zeros(len(params), device=device)  # ranks without a gradient: 0 usually
    for i, p in enumerate(params):
        if p.grad is None:
            missing[i] = 1.0  # a scalar fill: no host-to-device copy
    uncut = frozenset(i for i, p in enumerate(params) if p.grad is not None and not p.grad.is_contiguous())
    plan = chunks.plan_chunks([p.numel() for p in params], NODE_CHUNK, uncut=uncut)
    for k, pieces in enumerate(plan):  # fp32 of a chunk at a time (a large tensor in slices); flags on the last
        parts = [(params[pc.index].grad.detach().reshape(-1)[pc.lo:pc.hi].float()
                  if params[pc.index].grad is not None else torch.zeros(pc.size, device=device))
                 for pc in pieces]
        flat = torch.cat(parts + ([missing] if k == len(plan) - 1 else []))
        parts = None
        if size > 1:
            comm.all_reduce(flat, group, stats)
        if k == len(plan) - 1:
            missing = flat[-len(params):]
        sums = flat[:sum(pc.size for pc in pieces)].div_(size)
        for pc, piece in zip(pieces, sums.split([pc.size for pc in pieces])):
            p = params[pc.index]
            if p.grad is None:  # some rank of the group may have one: decided below (a later slice reads 0)
                p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)  # (contiguous)
            if p.grad.is_contiguous():
                p.grad.view(-1)[pc.lo:pc.hi].copy_(piece)
            else:  # (never cut)
                p.grad.copy_(piece.view_as(p))
    if lacking:  # one host read
        for p, n in zip(params, missing.tolist()):
            if n == size:  # no rank of the group has one
                p.grad = None


class NodeCub(Shell, torch.optim.Optimizer):
    """LionCub for nodes of several ranks: average inside the node, vote across nodes.

    Args:
        params, lr, betas, weight_decay: as :class:`lioncub.LionCub` (param groups and
            LR schedulers work on this optimizer's ``param_groups``).
        layout: a :class:`NodeLayout` from :func:`node_groups` (default: built here from
            ``LOCAL_WORLD_SIZE``; collective).
        shard: each local rank votes on its own ``1/L`` of the parameters (and keeps only
            their momenta), then the node all-gathers the update; False: every local rank
            votes on all of them.
        aggregation: the cross-node aggregation, as :class:`lioncub.LionCub`'s.
        model: the module the params come from (parameter names in errors).
        options: as :class:`lioncub.LionCub`'s; ``nonfinite`` (a node-mean gradient holding NaN/Inf, agreed by
            all ranks of all nodes in one tiny all-reduce) and ``check_every`` (all ``N·L`` replicas
            bit-identical) cover the whole world.

    ``LionCub(params, ..., process_group=node_groups())`` builds this class (shard=True).

    ``voter`` is the cross-node :class:`~lioncub.LionCub` (its ``last_step_stats``, momenta,
    steps); ``vote`` its method's name, as on :class:`~lioncub.LionCub`.
    """

    state_key = "nodecub"

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, aggregation="onebit-mean", layout: Optional[NodeLayout] = None,
                 shard: bool = True, model: Optional[torch.nn.Module] = None, options: Optional[Options] = None):
        check_hyperparameters(lr, betas, weight_decay)
        agg = aggregation_of(aggregation, "LionCub")
        vote_args = {**agg.for_step(), **Options.of(options, "LionCub").for_("LionCub", STEP_OPTIONS)}
        self.aggregation = agg
        nonfinite, check_every = vote_args.pop("nonfinite", "raise"), vote_args.pop("check_every", 0)
        check_bool("shard", shard)
        if layout is None:
            layout = node_groups()
        if not isinstance(layout, NodeLayout):
            raise TypeError(f"layout must be a NodeLayout from lioncub.node_groups(), got {type(layout).__name__}")
        self.layout, self.shard = layout, shard
        self.steps = self.skipped_steps = 0
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                      maximize=vote_args.get("maximize", False)))
        self.params = [p for g in self.param_groups for p in g["params"]]
        # the same model on all N·L ranks, in-node ranks included, all from rank 0's values: once
        self.open_shell(self.params, group=None, model=model, nonfinite=nonfinite, check_every=check_every,
                        seed=vote_args.get("seed", 0), generator=False)
        local = layout.local_size
        owners = shard_owners([p.numel() for p in self.params], local) if shard else [layout.local_rank] * len(
            self.params)
        if shard and len(self.params) < local:
            raise ValueError(f"shard=True needs at least local_size={local} parameters to split, got "
                             f"{len(self.params)}; pass shard=False")
        self.owners = owners
        self._mine = [i for i, j in enumerate(owners) if j == layout.local_rank]
        # shard=True: per dtype and round, each local rank's slices of its parameters (chunks.slices: at most
        # NODE_CHUNK elements a round, a large tensor cut): what one all-gather carries (fixed)
        self._share_plan = []
        for dtype in sorted({p.dtype for p in self.params}, key=str):
            cut = [chunks.slices([p for i, p in enumerate(self.params) if p.dtype == dtype and owners[i] == j],
                               NODE_CHUNK) for j in range(local)]
            for k in range(max(len(x) for x in cut)):
                pieces = [x[k] if k < len(x) else [] for x in cut]
                self._share_plan.append((dtype, pieces, [sum(b - a for _, a, b in x) for x in pieces]))
        # the vote's param groups: this rank's shard of each group, the group's settings
        self._group_of_vote = []  # vote group index -> this optimizer's group index
        vote_groups, offset = [], 0
        for gi, g in enumerate(self.param_groups):
            n = len(g["params"])
            mine = [self.params[i] for i in self._mine if offset <= i < offset + n]
            offset += n
            if mine:
                vote_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine})
                self._group_of_vote.append(gi)
        self.voter = engine_lioncub(vote_groups, lr, betas, weight_decay, process_group=layout.inter,
                                    nonfinite="raise", _verified=True, **vote_args)
        """The cross-node vote: a LionCub over this local rank's shard and cross-node group."""
        if self.voter.vote_requested == "auto" and dist.get_world_size() > 1:  # one pick on every rank
            voter = self.voter
            voter._set_config(voter.config.resolved(*auto.first_pick(voter.config.vote, voter.world_size, None,
                                                                      self.device)))
        self.last_step_stats = CommStats()
        self.last_intra_stats = CommStats()

    # ------------------------------------------------------------------ step
    def _share_in_node(self, stats: CommStats) -> None:
        """shard=True: every rank gets every shard's updated values; one all-gather per dtype and chunk."""
        me = self.layout.local_rank
        for dtype, pieces, sizes in self._share_plan:
            send = chunks.pack_slices(pieces[me], torch.zeros(max(sizes), dtype=dtype, device=self.device))
            got = comm.all_gather(send, self.layout.intra, stats)  # (L, max size)
            for j, theirs in enumerate(pieces):
                if j != me:
                    chunks.unpack_slices(got[j], theirs)

    def _sync_settings(self) -> None:
        """Schedulers change this optimizer's groups; the vote's groups follow before each step."""
        for vote_group, gi in zip(self.voter.param_groups, self._group_of_vote):
            for key, value in self.param_groups[gi].items():
                if key != "params":
                    vote_group[key] = value

    _step_supports_amp_scaling = True
    """``GradScaler.step`` always calls :meth:`step` on every rank (see :mod:`lioncub.engine.amp`)."""

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """One step for every rank of every node. Collective: every rank calls it every iteration.

        ``grad_scaler`` (passed by ``GradScaler.step``): unscaled here; any rank's overflow
        is agreed by the world's non-finite all-reduce, every rank skips together and every
        scaler records the same verdict (:mod:`lioncub.engine.amp`)."""
        loss = self.run_closure(closure)
        with comm.step_context(self.steps):
            intra, inter = comm.step_stats(self.device), comm.step_stats(self.device)
            scaler_inf = amp.unscale(self, grad_scaler, self.params)
            node_mean(self.params, self.layout.intra, self.layout.local_size, self.device, intra)
            mine = [self.params[i] for i in self._mine]
            # the one agreement of the step, over the world: per parameter the ranks without a gradient
            # (a node's ranks agree after the node's mean), and the ranks with a non-finite shard mean
            verdict = guard.agree(self.params, None, self.layout.world_size, self.device, inter,
                                  finite=guard.grads_finite(mine), scaler_inf=scaler_inf)
            n_bad = verdict.bad_ranks
            if grad_scaler is not None:
                amp.record_agreed(self, grad_scaler, n_bad)
            if n_bad and grad_scaler is not None:
                self.skipped_steps += 1
            elif n_bad:
                guard.handle_nonfinite(self.nonfinite, self.params, n_bad, step=self.steps,
                                      names=self._param_names)  # raises, or all ranks skip
                self.skipped_steps += 1
            else:
                self._sync_settings()
                self.voter.step_agreed(guard.Verdict([verdict.active[i] for i in self._mine], 0, []))
                inter.add(self.voter.last_step_stats)
                if self.shard and self.layout.local_size > 1:
                    self._share_in_node(intra)
                self.steps += 1
                if self.check_due(self.steps):
                    guard.check_replicas(self.params, None, self.layout.world_size, step=self.steps,
                                         names=self._param_names, stats=inter)
            self.last_step_stats, self.last_intra_stats = inter, intra
        return loss

    @property
    def vote(self) -> str:
        """The cross-node vote's method name (``'auto'``: its pick), as :attr:`LionCub.vote`."""
        return self.voter.vote

    @property
    def vote_chosen(self) -> tuple:
        """(method, lane bits) the cross-node vote runs, as :attr:`LionCub.vote_chosen`."""
        return self.voter.vote_chosen

    # ------------------------------------------------------------------ state
    def fingerprint(self) -> dict:
        return {"nodes": self.layout.nodes, "local_size": self.layout.local_size, "shard": self.shard,
                "local_rank": self.layout.local_rank, "owners": list(self.owners)}

    def state_dict(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {self.state_key: self.envelope(dict(steps=self.steps, skipped_steps=self.skipped_steps),
                                              param_groups=copy.deepcopy(groups)),
                "vote": self.voter.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        extra = state_dict.get(self.state_key) if isinstance(state_dict, dict) else None
        if extra is not None and "config" not in extra:  # saved before the envelope: flat fields
            extra = {**extra, "config": {k: extra.get(k) for k in self.fingerprint()}, "rank": self.rank,
                     "world_size": self.world_size,
                     "counters": {"steps": extra["steps"], "skipped_steps": extra["skipped_steps"]}}
            state_dict = {**state_dict, self.state_key: extra}
        try:
            extra = self.open_envelope(state_dict)
        except ValueError as exc:
            raise ValueError(f"{exc}; NodeCub resumes on the same node layout only") from None
        if len(extra["param_groups"]) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(extra['param_groups'])} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        self.voter.load_state_dict(state_dict["vote"])
        for g, saved in zip(self.param_groups, extra["param_groups"]):
            g.update(copy.deepcopy(saved))
        self.steps = int(extra["counters"]["steps"])
        self.skipped_steps = int(extra["counters"]["skipped_steps"])


_lioncub.BUILDS["nodes"] = (NodeLayout, NodeCub)
