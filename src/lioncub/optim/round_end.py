"""The end of a LocalCub round, one sequence for every kind of round: :func:`end_round`.

    measure → agree → non-finite → per-chunk exchange → outer step → count → replica check

Each step is written once: ``_measure``, ``_agree``, ``_nonfinite``, ``_launch`` and ``_outer_step`` of
:class:`~lioncub.optim.rounds.Rounds`, the count and replica check here (:func:`applied`). The kinds of round:

* blocking (``delay=0``): all of it at the round's end, each chunk's outer step taken as soon as its exchange is
  done (:func:`exchange`);
* streaming (``delay=1``): Δ measured since o_i, and each chunk's exchange preceded by the outer step of the
  chunk's agreement of the last round and the rebase
  (:meth:`~lioncub.optim.streaming.StreamingRounds._stream_chunks`); this round's left in flight;
* torchft's (:class:`~lioncub.optim.replicas.FTLocalCub`): the blocking one with two hooks overridden, the group
  (:meth:`~lioncub.optim.rounds.Rounds._round_group`: the manager's quorum, the aggregation sized for it) and the
  :class:`Quorum` (:meth:`~lioncub.optim.rounds.Rounds._quorum`: who contributes, the retries until the manager
  commits, the chunks' results held until then);
* a fragment's (``fragments > 1``): the same steps spread over the inner steps, so that no rank waits for the
  others (:meth:`~lioncub.optim.streaming.StreamingRounds._fragment_round`: measure, agree; ``_send_late``:
  non-finite, exchange; ``_receive_pending``: outer step, count, check).
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Optional

import torch

from .. import comm
from ..engine import guard

__all__ = ["RoundGroup", "Quorum", "end_round", "exchange", "applied"]


class RoundGroup(NamedTuple):
    """Where a round's end runs (:meth:`~lioncub.optim.rounds.Rounds._round_group`): the finite agreement's group
    and size (``agree_group``, ``agree_size``: the whole world with FSDP2 shards), the exchange's ``group`` and the
    ``aggregation`` sized for it (:mod:`lioncub.votes.rounds`)."""

    agree_group: object
    agree_size: int
    group: object
    aggregation: object


class Quorum:
    """Who takes part in a round's end and whether the round stands (:meth:`~lioncub.optim.rounds.Rounds._quorum`):
    here the optimizer's own ranks, every one contributing (``contributing``), one agreement, which stands at once,
    each chunk's outer step taken as soon as its exchange is done. torchft's
    (:class:`~lioncub.optim.replicas.ManagedQuorum`) retries on new quorums until its manager commits."""

    holds = False
    """Whether the chunks' results (d and the new residual) wait for :meth:`commits` before they are applied."""

    def __init__(self, opt, contributing: bool = True):
        self.opt, self.contributing = opt, contributing

    def attempts(self) -> Iterator[bool]:
        """Each agreement of the round in turn (one here), as whether this rank's Δ takes part in it."""
        yield self.contributing

    def slots(self, took_part: bool) -> list[float]:
        """What this rank adds to the agreement's sums ahead of the aggregation's head (nothing here)."""
        return []

    def sends(self, verdict: guard.Verdict) -> bool:
        """Whether the agreement's exchanges run: every rank's Δ is finite."""
        return verdict.bad_ranks == 0

    def count(self, verdict: guard.Verdict) -> int:
        """C, the ranks whose v the exchange counts (the mean's divisor): all of them."""
        return self.opt.world_size

    def commits(self) -> bool:
        """After an agreement's exchanges: whether the round stands (else the next of :meth:`attempts`)."""
        return True

    def close(self, verdict: guard.Verdict, group: RoundGroup) -> None:
        """The round stands on ``verdict``, agreed over ``group`` (before its non-finite handling): nothing to note
        here."""


def end_round(opt, contributing: bool = True) -> None:
    """The end of a round of ``opt`` (a LocalCub), blocking, streaming or torchft's (the module docstring):
    Δ measured (its finite check and the aggregation's per-tensor sums over the model), the one agreement read,
    the chunks exchanged (:func:`exchange`), then the round dropped where a Δ is non-finite, or its outer steps
    taken and counted. ``contributing``: whether this rank has a Δ (torchft's joining replica has none)."""
    plan, quorum = opt._plan(), opt._quorum(contributing)
    for took_part in quorum.attempts():
        stats = comm.step_stats(opt.device)
        opt._weigh_round(stats)  # Options(pace='timed'): every rank's steps, this rank's weight (optim.pace)
        group = opt._round_group()
        if took_part:
            seen = opt._measure("origin" if opt.delay else "start", plan, group.aggregation)
        else:
            seen = opt._nothing_to_send(group.aggregation)
        slots = quorum.slots(took_part)
        finite = opt._marked(seen.finite) if took_part else seen.finite
        verdict = opt._agree(group.aggregation.head(seen.scales), finite, stats, group, slots).read(stats)
        head = verdict.extra[len(slots):]
        if opt.delay:  # the last round's outer steps, the rebase and this round's exchanges (all in one pass)
            sent = opt._stream_chunks(plan, seen, verdict, head, stats)
        else:
            sent = exchange(opt, plan, seen, verdict, head, group, quorum, took_part, stats)
        if quorum.commits():
            break
    opt._bad_round, opt.last_round_stats = False, stats
    quorum.close(verdict, group)
    if verdict.bad_ranks:
        opt._nonfinite(verdict.bad_ranks)
        return
    if opt.delay:  # applied at the next round's end
        opt._pending = sent
        return
    if sent is None:  # no exchange (torchft: every replica joining)
        return
    for pieces, (result, residual) in zip(plan, sent):  # the results a quorum held for its commit
        if residual is not None:
            opt._write_residuals(residual, pieces)
        opt._outer_step(result, pieces)
    applied(opt)


def exchange(opt, plan: list, seen, verdict: guard.Verdict, head: list[float], group: RoundGroup, quorum: Quorum,
             took_part: bool, stats: comm.CommStats) -> Optional[list]:
    """A ``delay=0`` round's exchanges, a chunk at a time (None when the quorum sends nothing): each chunk's v
    (zeros from a rank with nothing to send) exchanged, then, unless the quorum holds them (a list of each chunk's
    (d, whether d holds u) and new residual, returned), its residual kept and its outer step taken at once (its
    buffers freed before the next chunk's are made)."""
    if not quorum.sends(verdict):
        return None
    count, held = quorum.count(verdict), []
    for index, pieces in enumerate(plan):
        if took_part:  # (v only: Δ is not needed here)
            v = (seen.kept or opt._pseudo_gradient("start", pieces))[1]
        else:
            v = torch.zeros(sum(pc.size for pc in pieces), dtype=torch.float32, device=opt.device)
        agreement, residual = opt._launch(v, pieces, head, seen.scales, count, stats, index, group,
                                          abstain=not took_part)
        if quorum.holds:
            held.append((agreement.result(stats), residual))
        else:
            if residual is not None:
                opt._write_residuals(residual, pieces)
            opt._outer_step(agreement.result(stats), pieces)
        v = agreement = residual = None  # (freed before the next chunk's are made)
    return held


def applied(opt) -> None:
    """A round's outer step is complete on ``opt``: count it, and check the replicas when due (every
    ``check_every`` rounds): their parameters, which hold θ_s with ``delay=0``; with ``delay=1`` θ_s itself,
    checksummed on the device, where host state goes a slice at a time."""
    opt.rounds += 1
    if not opt.check_due(opt.rounds):
        return
    if not opt.delay:
        guard.check_replicas(opt.params, opt.group, opt.world_size, step=opt.rounds, names=opt._param_names)
        return
    opt._settle()  # (a strided θ_s on the host is read there, by its reshape)
    guard.check_replicas([opt.local_state[p]["start"] for p in opt.params], opt.group, opt.world_size,
                         step=opt.rounds, names=opt._param_names, device=opt.device)
