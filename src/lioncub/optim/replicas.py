r"""LocalCub whose rounds survive a lost replica: the agreement through a torchft ``Manager``.

Each *replica group* (one worker, or the ranks of a node with FSDP2 shards inside: below) trains its H inner steps
alone, exactly as :class:`~lioncub.LocalCub` does. At a round's end it agrees with whichever replicas are alive::

    repeat:
        start_quorum()                  # the lighthouse's quorum of live replicas (may heal us)
        P = num_participants()          # the replicas in this quorum
        head  = Σ_r [bad_r, took_part_r, stop_r, mean|v_r| per tensor]   # one float64 all-reduce
        C     = head[1]                 # the replicas whose Δ is a contribution
        d     = Σ_r q(v_r) / C          # 'grad': fp32 Δ; 'pbit' + 'mean': 8-bit L1 lanes sized for P
        if should_commit(): break       # every replica in the quorum finished every collective
    e_r ← v_r − C(v_r);  θ_s ← outer(θ_s, d);  θ_r ← θ_s          (only on a commit)

(The round's end is LocalCub's, :func:`lioncub.optim.round_end.end_round`, on the quorum's group,
with :class:`ManagedQuorum` deciding who contributes and whether the round stands.)
A round that loses a member mid-collective is not committed on any survivor: θ_s, the outer
state and the error-feedback residuals are untouched, and the agreement is retried on the next
quorum **with the same Δ** (the survivors' H inner steps are still pseudo-gradients from the
same θ_s, so no work is redone). The dead replica drops out of the next quorum after the
lighthouse's heartbeat timeout. Since lane widths, scales and the mean follow the quorum
(``P``, ``C``), a 2-replica round is an ordinary 2-replica LocalCub round.

A replica that (re)joins calls the agreement before its first inner step, with nothing to
contribute (``took_part = 0``, Δ = 0: it adds nothing to any sum, and the mean is over ``C``).
Being behind the quorum's step, it is *healed* by torchft inside ``start_quorum`` from a live
peer, which is then at its round's end (no inner step in flight): θ_s, the outer state (momenta),
the round counters and the peer's inner optimizer state are copied (copied, not reset: AdamW's
moments and step count then scale its first steps as the peers' do; a fresh AdamW's first step
is a full-lr step in every coordinate); its error-feedback residual is zero (a residual is
what *this* replica meant and did not send: a peer's would resend that peer's mass twice).
It then applies the round's outer step with everyone else, and is bit-identical to the
survivors from that commit on.

On a fresh start every replica does the same empty agreement (``C = 0``: nothing is applied,
no round is counted); torchft's ``init_sync`` makes the starts identical.

A replica group of G ranks (torchft's FT-HSDP layout) is its own torch.distributed world, the model sharded over
it by FSDP2 (a 1-D mesh), each rank with its own Manager (the group's ``replica_id``, its ``group_rank``; torchft's
ManagerServer on group rank 0 asks the lighthouse once for the group). The round is the HSDP round of
:class:`~lioncub.LocalCub` with the groups as its replicas: the agreement sums over the group's ranks, then over
the quorum's groups (:class:`QuorumRanks`; the shards' head sums each in its shard's slot), and each rank's exchange
travels on torchft's managed group of its group rank (rank k of every group: the same shard). ``should_commit()``
is the group's: its ManagerServer commits only when every rank of the group does, so a group's ranks commit or
retry together. A rank that dies takes its group out of the quorum (its peers in the group fail on their next
collective inside it, or wait on a quorum that their ManagerServer cannot ask for, and are restarted with it); the
restarted group's ranks heal, each its own shard from the same group rank of a live group (torchft's heal is per
group rank).

Or a **node mean** inside the group: plain parameters (no FSDP2) on the group's own world of G ranks, every rank
holding the whole model. After each backward the group's gradients become their mean over the group (one fp32 SUM
all-reduce over the group's world, divided by G: :func:`lioncub.optim.nodecub.node_mean`, NodeCub's step 1), so the
group's ranks take the same inner steps and hold the same Δ; the round then runs on each rank's own managed group
alone (rank k of every group in the quorum, the whole model), with no sum over the group: every rank of a group adds
the same head and Δ, so rank k's agreement is the group's. Each group sends G copies of the exchange (one per rank);
the ranks' quantizer generators are seeded alike (``seed``, as a one-worker replica's), so their draws are too. A
restarted group's ranks heal each from the same rank of a live group (the whole model, identical on every rank).

The healing transfer is loaded with ``weights_only=True`` (:class:`TensorTransport`): a peer's
state can hold tensors, numbers and strings only, never code.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
from torch import Tensor

from .. import comm
from . import lioncub as _lioncub
from . import localcub as _localcub
from .localcub import LocalCub
from .nodecub import node_mean
from .round_end import Quorum, RoundGroup, end_round
from ..engine.shards import local_of
from ..validate import check_int
from ..votes.rounds import PARTIAL_NEEDS, round_aggregation, round_partial
from ..aggregations import OneBitMean, SignVote, aggregation_of
from ..options import Options

__all__ = ["FTLocalCub", "FTLionCub", "ReplicaGroup", "QuorumRanks", "TensorTransport", "QuorumError",
           "require_torchft"]


def require_torchft():
    """The ``torchft`` module, or a one-line ImportError naming the extra to install."""
    try:
        import torchft
    except ImportError as exc:
        raise ImportError("fault tolerance needs torchft: pip install 'lioncub[ft]' (torchft 0.2.0)") from exc
    return torchft


class QuorumError(RuntimeError):
    """No quorum of ``min_replica_size`` replicas formed in time, or a round could not commit."""


class ReplicaGroup(comm.ExternalGroup):
    """The replicas of the manager's current quorum, as a group :func:`lioncub.comm.all_reduce` takes: with replica
    groups of many ranks, this rank and the ranks of the same group rank in the quorum's other groups (torchft's
    managed process group is per group rank).

    Failures do not raise: torchft records them, later all-reduces of the quorum are no-ops,
    and ``Manager.should_commit()`` is then False on every replica."""

    def __init__(self, manager):
        self.manager = manager

    def size(self) -> int:
        return self.manager.num_participants()

    def launch(self, t: Tensor, op: str):
        return self.manager.allreduce(t, reduce_op=comm.REDUCE_OPS[op])


class QuorumRanks(ReplicaGroup):
    """Every rank of every replica group in the quorum (a round's agreement with FSDP2 shards inside the groups): a
    sum over this replica group's own ranks (its torch.distributed world, blocking: a dead peer there raises, and the
    group is out), then over the quorum's groups (:class:`ReplicaGroup`, this group rank's managed group)."""

    def __init__(self, manager, ranks: int):
        super().__init__(manager)
        self.ranks = ranks

    def size(self) -> int:
        return self.ranks * super().size()

    def launch(self, t: Tensor, op: str):
        comm.all_reduce(t, None, op=op)
        return super().launch(t, op)


def _transport_class():
    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class _TensorTransport(HTTPTransport):
        """torchft's HTTP checkpoint transport, loading with ``weights_only=True`` and
        advertising the host it is given (torchft's advertises ``socket.gethostname()``)."""

        host = "127.0.0.1"

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

        def address(self) -> str:
            return f"http://{self.host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return _TensorTransport


def TensorTransport(host: str = "127.0.0.1", timeout: timedelta = timedelta(seconds=60)):
    """A torchft checkpoint transport whose loads cannot run code, advertised at ``host``
    (for ``Manager(checkpoint_transport=...)``)."""
    require_torchft()
    transport = _transport_class()(timeout=timeout, num_chunks=0)
    transport.host = host
    return transport


class ManagedQuorum(Quorum):
    """A round's quorum under torchft (:meth:`FTLocalCub._quorum`): each attempt on the quorum the manager forms
    (which may heal this replica first), contributing unless this replica joins or was healed this round; the
    agreement also sums who contributed (C, the exchange's count) and who asked to stop; the chunks' results are
    held until ``should_commit()``, and a round that does not commit is tried again on a new quorum with the same
    Δ, at most ``max_attempts`` times."""

    holds = True

    def attempts(self):
        opt, self.began = self.opt, time.perf_counter()
        opt._healed = False  # a heal in any attempt of this round voids this replica's Δ
        for _ in range(opt.max_attempts):
            opt._start_quorum()
            opt._fault("head", self.contributing)
            yield self.contributing and not opt._healed
            opt.uncommitted += 1  # (not committed) θ_s, outer state and residuals untouched: retry on a new quorum
        raise QuorumError(f"round {opt.rounds} did not commit in {opt.max_attempts} agreements "
                          "(max_attempts): replicas keep failing")

    def slots(self, took_part: bool) -> list[float]:
        return [float(took_part), float(self.opt.stop_requested)]  # C, and a stop asked for

    def sends(self, verdict) -> bool:
        if self.opt.manager.errored() is None and verdict.bad_ranks == 0 and self.count(verdict) > 0:
            self.opt._fault("lanes", self.contributing)
            return True
        return False

    def count(self, verdict) -> int:  # (with shards, every rank of a group adds its group's flag)
        return int(round(verdict.extra[0] / (1 if self.opt.node_mean else self.opt.group_ranks)))

    def commits(self) -> bool:
        self.opt._fault("commit", self.contributing)
        return self.opt.manager.should_commit()

    def close(self, verdict, group: RoundGroup) -> None:
        opt = self.opt
        opt.participants, opt.contributors = group.group.size(), self.count(verdict)
        opt.stop_agreed = opt.stop_agreed or verdict.extra[1] > 0
        opt.last_stall_s = time.perf_counter() - self.began


class FTLocalCub(LocalCub):
    """:class:`~lioncub.LocalCub` across torchft replica groups (see the module docstring); what
    ``LocalCub(..., manager=m)`` builds, with LocalCub's arguments.

    Args:
        manager: a ``torchft.Manager`` built with ``use_async_quorum=False`` (healing then
            happens inside ``start_quorum``, while every replica is at its round's end) and
            without ``load_state_dict``/``state_dict`` of its own for the optimizer: this
            optimizer registers its state under ``'lioncub'``. :func:`lioncub.ft.make_manager`
            builds one.
        options: ``Options(max_attempts=...)``: agreements tried per round before :class:`QuorumError` (each
            failed one costs at most the process group's timeout, then a new quorum; default 20).
        aggregation: one whose sum a replica with nothing to send leaves unchanged (``LaneMean``, ``Mean``,
            ``SignVote('pbit')`` binary lanes, ``SignVote('sign_allreduce')``); no ``streaming``, no
            ``process_group``: one worker per replica group, FSDP2 parameters sharded over the group's own
            world, or plain parameters on the group's own world, whose gradients each step averages over the
            group first (a node mean: the module docstring).

    Attributes beyond LocalCub's: ``uncommitted`` (agreements that did not commit), ``heals``
    (times this replica was healed from a peer), ``participants`` (P of the last committed
    round), ``contributors`` (its C), ``last_stall_s`` (seconds from the round's end to its
    commit, quorums and retries included), ``node_mean`` (whether each step averages the gradients over the
    replica group's ranks first), ``last_intra_stats`` (that mean's bytes in the last step).

    ``fault_hook``: None, or ``fault_hook(point, round)`` called at the first inner step of a round
    (``'inner'``), after its quorum (``'head'``), before its data all-reduce (``'lanes'``) and before
    ``should_commit()`` (``'commit'``) of every contributing agreement: failures at chosen points,
    armed by :func:`lioncub.ft.faults.install`.

    Stopping together: a replica that sets ``stop_requested = True`` (its clock ran out) says so
    in the next agreement; ``stop_agreed`` then turns True on every replica of that commit at
    once, so no replica is left waiting for a quorum that will not come.

    Its round's end is LocalCub's (:func:`lioncub.optim.round_end.end_round`); this class overrides only the group
    (:meth:`_round_group`: the quorum's replicas) and the quorum (:meth:`_quorum`: :class:`ManagedQuorum`).
    """

    def _configure(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, manager=None,
                   max_attempts: int = 20, **kwargs):
        require_torchft()
        if manager is None:
            raise ValueError(f"{type(self).__name__} needs manager= (a torchft.Manager)")
        for key, allowed in (("delay", 0), ("process_group", None)):
            if kwargs.get(key, allowed) != allowed:
                raise ValueError(f"{key} must be {allowed!r} with torchft, got {kwargs[key]!r}")
        if kwargs.get("local_steps") == "auto":
            raise ValueError("local_steps='auto' times the first round on a fixed group; under torchft give an int")
        vote = kwargs.get("vote", "onebit")
        if not round_partial(vote, kwargs.get("aggregate", "vote"), kwargs.get("quantizer")):
            got = getattr(self, "aggregation", None) or f"vote={vote!r}"
            raise ValueError(f"under torchft a round's aggregation must be a sum that a replica with nothing to send "
                             f"leaves unchanged: Mean(), LaneMean(), SignVote('pbit') without a quantizer or "
                             f"SignVote('sign_allreduce') (engine settings: {PARTIAL_NEEDS}); got {got!r}")
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("manager must be built with use_async_quorum=False (a replica heals inside "
                             "start_quorum, at a round's end)")
        self.max_attempts = check_int("max_attempts", max_attempts, 1)
        super()._configure(params, lr, betas, weight_decay, **kwargs)
        self.group_ranks = self._check_group(manager)
        """The ranks of this replica group (torchft's ``group_world_size``): 1, its FSDP2 shard mesh's, or its
        world's (a node mean)."""
        self.node_mean = self.sharding is None and self.group_ranks > 1
        self.last_intra_stats = comm.CommStats()
        if self.node_mean and self.generator is not None:  # the group's ranks draw alike (a one-worker replica's)
            self.generator = comm.make_generator(self.device, self.config.seed)
        pg = getattr(manager, "_pg", None)
        if pg is not None and self.device.type == "cuda" and "NCCL" not in type(pg).__name__.upper():
            raise ValueError(f"manager: its process group is {type(pg).__name__} but the parameters are on "
                             f"{self.device}; build it with make_manager(..., device={str(self.device)!r}) (NCCL)")
        self.manager = manager
        self.uncommitted, self.heals, self.participants, self.contributors = 0, 0, 0, 0
        self.last_stall_s = 0.0
        self._joined, self._healed = False, False
        self.stop_requested, self.stop_agreed = False, False
        self._aggregations: dict = {}
        self.fault_hook = None  # fault_hook(point, round): failures at chosen points (lioncub.ft.faults)
        manager.register_state_dict_fn("lioncub", self._load_heal, self._heal_state)

    def _check_group(self, manager) -> int:
        """The ranks of this replica group, checked: one worker, FSDP2 shards over the group's own world, or plain
        parameters on it (a node mean; each replica group its own torch.distributed world, every rank with its
        Manager)."""
        ranks = getattr(manager, "_group_world_size", 1)
        if self.sharding is not None and self.sharding.replicas is not None:
            raise ValueError("under torchft the replicas are the manager's replica groups: shard the model with FSDP2 "
                             "over the replica group's own world (a 1-D mesh, each group its own torch.distributed "
                             "world), not on a 2-D mesh with replicas of its own")
        mine = self.world_size if self.sharding is None else self.agree_size
        if ranks != mine:
            how = f"sharded over {mine}" if self.sharding is not None else f"plain on a world of {mine} (a node mean)"
            raise ValueError(f"manager: its replica group has {ranks} ranks (world_size=) but the parameters are "
                             f"{how}; build it on each rank of the group with make_manager, which takes "
                             "the group's torch.distributed world")
        return ranks

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        if self.node_mean and grad_scaler is not None:
            raise ValueError("grad_scaler: a node mean inside a replica group averages the gradients before each "
                             "rank's own loss scale is taken out; train without a GradScaler (bf16)")
        if not self._joined:  # a (re)started replica's empty agreement: the quorum, maybe a heal
            self.join()
        if self.local_step == 0:
            self._fault("inner", True)
        if not self.node_mean:
            return super().step(closure, grad_scaler)
        loss = self.run_closure(closure)
        self.last_intra_stats = comm.step_stats(self.device)  # the group's mean gradient on each of its ranks
        node_mean(self.params, None, self.group_ranks, self.device, self.last_intra_stats)
        super().step(None)
        return loss

    @torch.no_grad()
    def join(self) -> None:
        """Join the replicas now (the first :meth:`step` does it): an agreement with nothing to
        contribute, healed from a peer when this replica is behind. Every replica's first."""
        self._joined = True
        with comm.step_context(self.rounds):
            end_round(self, contributing=False)

    def _fault(self, point: str, contributing: bool) -> None:
        if self.fault_hook is not None and contributing:
            self.fault_hook(point, self.rounds + 1)

    def _aggregation(self, P: int):
        if P not in self._aggregations:  # lanes sized for the quorum's P (every member builds the same)
            self._aggregations[P] = round_aggregation(self.config.vote, self.config.method(P), P, self.aggregate)
        return self._aggregations[P]

    def _round_group(self) -> RoundGroup:
        """The round's group: the replicas of the manager's current quorum, the agreement and the exchanges on it,
        with the aggregation sized for its P."""
        group = ReplicaGroup(self.manager)
        P = group.size()
        if self.group_ranks == 1 or self.node_mean:  # one worker, or a node mean: this rank's Δ is its group's
            return RoundGroup(group, P, group, self._aggregation(P))
        ranks = QuorumRanks(self.manager, self.group_ranks)  # the agreement over every shard of every group
        return RoundGroup(ranks, ranks.size(), group, self._aggregation(P))

    def _quorum(self, contributing: bool) -> "ManagedQuorum":
        """Who takes part in the round and when it stands: torchft's quorum, until its manager commits."""
        return ManagedQuorum(self, contributing)

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except TimeoutError as exc:
            raise QuorumError(f"no quorum of min_replica_size={self.manager._min_replica_size} replicas within "
                              f"the quorum timeout ({self.manager._quorum_timeout}) at round {self.rounds}: "
                              f"{exc}") from exc

    # ------------------------------------------------------------------ healing
    def _heal_state(self) -> dict:
        """What a joining replica copies from this one (called by torchft at this replica's round end)."""
        self._settle()  # (host state: the round's copies into it landed)
        keys = self.rule.state_keys
        return dict(start=[self.local_state[p]["start"].detach().clone() for p in self.params],
                    outer=[{k: self.local_state[p][k].clone() for k in keys} for p in self.params],
                    inner=_clone(self.inner.state_dict()),  # (FSDP2: this rank's shard, plain tensors)
                    counters=dict(rounds=self.rounds, skipped_rounds=self.skipped_rounds))

    def _load_heal(self, sd: dict) -> None:
        """Become the peer's replica at its round's end: θ_s, outer and inner state, counters;
        this replica's own residual is zero and its parameters are θ_s."""
        self._settle()  # (host state: written here by the host, nothing in flight may read or write it after)
        with torch.no_grad():
            for p, start, outer in zip(self.params, sd["start"], sd["outer"]):
                s = self.local_state[p]
                s["start"].copy_(start)
                p.copy_(start)
                for k, value in outer.items():
                    s[k].copy_(value)
                if self.error_feedback:
                    s["residual"].zero_()
        self.inner.load_state_dict(sd["inner"])
        if self.sharding is not None:  # the inner state as its parameters' DTensors again
            for p, entry in self.inner.state.items():
                for k, value in entry.items():
                    if torch.is_tensor(value) and value.ndim and value.shape == local_of(p).shape:
                        entry[k] = self.sharding.wrap(local_of(p), value)
        self.param_groups = self.inner.param_groups
        self.rounds = int(sd["counters"]["rounds"])
        self.skipped_rounds = int(sd["counters"]["skipped_rounds"])
        self.local_step, self._bad_round = 0, False
        self._healed = True
        self.heals += 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["ft"] = dict(self.manager.state_dict())
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        ft = state_dict.get("ft") if isinstance(state_dict, dict) else None
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "ft"})
        if ft is not None:
            self.manager.load_state_dict(ft)


class FTLionCub(FTLocalCub):
    """LionCub's every-step vote across torchft replica groups: :class:`FTLocalCub` with one inner Lion step per
    round, the outer step ``θ ← θ·(1 − η·λ) − η·u`` (``outer='sgd', outer_lr=1``), which is exactly
    :class:`~lioncub.LionCub`'s step (docs/local_steps.md, "H = 1 is LionCub"): a quorum every step (torchft's
    DDP pattern), the vote over the step's contributing replicas, the momentum healed from a peer.

    ``vote``: a vote whose all-reduce leaves a replica out by adding nothing: ``'pbit'`` without a quantizer
    (binary lanes sized for the quorum, the vote decided among the C that voted) or ``'sign_allreduce'``.
    With no failure it equals LionCub on a fixed group bit for bit (tests/test_ft.py); on replica groups of many
    ranks (FSDP2 inside, the module docstring) LionCub on a 2-D mesh whose replicas are the groups
    (tests/test_ft_groups.py); with a node mean inside, the node's mean gradient then LionCub on the cross-node group
    of each local rank (tests/test_ft_node_mean.py)."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0, *, manager,
                 aggregation="sign-vote", model=None, options=None):
        agg = aggregation_of(aggregation, "LionCub")
        flags = agg.for_step()
        if isinstance(agg, OneBitMean):
            raise ValueError("LionCub with a torchft manager votes with SignVote(transport='pbit') every step, not the "
                             "1-bit mean (OneBitMean, its default): its all-to-all makes every replica the decoder of "
                             "a chunk, so a lost replica cannot be left out by adding nothing; or run LocalCub's "
                             "rounds (LaneMean, Mean) with the manager")
        if not isinstance(agg, SignVote) or agg.error_feedback != "none" or agg.stochastic_signs:
            raise ValueError(f"LionCub with a torchft manager votes with SignVote(transport='pbit') (binary lanes) or "
                             f"SignVote(transport='sign_allreduce'), whose all-reduce leaves a replica out by adding "
                             f"nothing; got {agg!r}")
        opts = Options.of(options, "LionCub").for_("LionCub with a manager", ("seed", "nonfinite", "max_attempts"))
        self.aggregation = agg
        self._configure(params, lr, betas, weight_decay, manager=manager, local_steps=1, inner="lion", outer="sgd",
                        outer_lr=1.0, vote=flags["vote"], bits=flags["bits"], quantizer=flags["quantizer"],
                        tie=flags["tie"], model=model, **opts)

    steps = property(lambda self: self.rounds, doc="Steps taken (committed), as LionCub counts them.")
    skipped_steps = property(lambda self: self.skipped_rounds, doc="Non-finite steps skipped on every replica.")


def _clone(obj):
    if isinstance(obj, Tensor):
        return local_of(obj).detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


_lioncub.BUILDS["manager"] = FTLionCub
_localcub.BUILDS["manager"] = FTLocalCub
