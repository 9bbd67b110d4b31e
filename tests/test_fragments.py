"""LocalCub's streaming in fragments (``delay=1, fragments=F``) and the exchanges a streaming round keeps in
flight, on real gloo groups (2-4 workers).

Fragment j's round ends at steps (j+1)·H/F of every round: the fragment in flight is received (θ_s ← outer(θ_s,
d); θ_i ← θ_s + θ_i − o_i), then fragment j's Δ_i = θ_s − θ_i is launched and o_i ← θ_i (docs/local_steps.md,
"Streaming in fragments"). The tests write that schedule by hand and hold the optimizer to it element for
element."""
from __future__ import annotations

import copy
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from lioncub import comm
from tests.flat import LocalCub
from lioncub.chunks import Piece, plan_chunks, plan_fragments
from lioncub.votes.rounds import ScatterMean
from lioncub.votes.scatter import owner_span
from tests.dist import run_workers
from tests.test_streaming import _flat, _grads, _params, _resume, _sgd, in_flight

LR = 2 ** -6  # SHAPES: 35, 13 and 27 elements, so that with F = 3 each tensor is one fragment


# ------------------------------------------------------------------ the fragments' cut (a pure function)
def test_plan_fragments_cuts_at_tensor_ends_nearest_equal_shares_and_one_part_is_plan_chunks():
    assert plan_fragments([35, 13, 27], 3, 1 << 20, align=1 << 20) == [[[Piece(0, 0, 35)]], [[Piece(1, 0, 13)]],
                                                                       [[Piece(2, 0, 27)]]]
    # 100 elements in 2: the tensor end nearest 50 is 40 (60 is as near; the earlier wins)
    assert plan_fragments([40, 20, 40], 2, 1000, align=64) == [[[Piece(0, 0, 40)]], [[Piece(1, 0, 20), Piece(2, 0, 40)]]]
    # inside a tensor a fragment ends only on a multiple of align; each fragment then cut into chunks of <= chunk
    # (40 in 2: 16 and 24 are as near 20, the earlier wins; the second fragment's 24 elements in chunks of 16)
    assert plan_fragments([40], 2, 16, align=8) == [[[Piece(0, 0, 16)]], [[Piece(0, 16, 32)], [Piece(0, 32, 40)]]]
    for sizes, chunk, align in (([5, 0, 7, 100, 3], 16, 4), ([0], 8, 1), ([3, 3], 2, 1)):
        assert plan_fragments(sizes, 1, chunk, align=align) == [plan_chunks(sizes, chunk, align=align)]
    with pytest.raises(ValueError, match=r"fragments must be at most the places .* \(2 fragments"):
        plan_fragments([10, 10], 3, 100, align=64)


# ------------------------------------------------------------------ the schedule by hand
def _fragments_by_hand(rank, world, H, F, steps, alpha=1.0, eager=False):
    """Each step: (θ_i, θ_s, o_i equal the schedule by hand, exactly; θ_s the same on every rank). The fp32
    mean (``vote='grad'``) and ``outer='sgd'`` with α = ``alpha``: θ_s ← θ_s − α·d, d the ranks' mean of v (one
    SUM all-reduce, as the optimizer's, then / P). ``eager``: at a fragment's launch θ_i ← θ_s − α·Δ_i."""
    params = _params()
    opt = LocalCub(params, lr=LR, local_steps=H, inner=_sgd, vote="grad", outer="sgd", outer_lr=alpha, delay=1,
                   fragments=F, eager=eager)
    theta = [p.detach().clone() for p in params]  # θ_i by hand, per tensor (fragment j = tensor j)
    start = [t.clone() for t in theta]
    origin = [t.clone() for t in theta]
    flight = None  # (fragment, v) in flight
    checks = []
    for t in range(1, steps + 1):
        grads = _grads(params, rank, t)
        for p, g, mine in zip(params, grads, theta):
            p.grad = g
            mine.add_(g, alpha=-LR)  # the inner SGD step (torch's SGD: p.add_(g, alpha=-lr))
        opt.step()
        s = t % H or H
        if s % (H // F) == 0:
            j = s // (H // F) - 1
            if flight is not None:
                k, v = flight
                total = v.clone()
                dist.all_reduce(total)
                progress = theta[k].float() - origin[k].float()
                start[k].add_(total.div_(world).view(start[k].shape), alpha=-alpha)
                theta[k] = start[k].float() + progress
            v = (start[j] - theta[j]).reshape(-1)
            if eager:  # the rule's step by this worker's own Δ_i stands in while the fragment flies
                theta[j] = start[j].add(v.view(start[j].shape), alpha=-alpha)
            origin[j] = theta[j].clone()
            flight = (j, v)
        starts = _flat(opt.state[p]["start"] for p in params)
        everyone = [torch.empty_like(starts) for _ in range(world)]
        dist.all_gather(everyone, starts)
        checks.append((all(torch.equal(p, m) for p, m in zip(params, theta)),
                       all(torch.equal(opt.state[p]["start"], x) for p, x in zip(params, start)),
                       all(torch.equal(opt.state[p]["origin"], x) for p, x in zip(params, origin)),
                       all(torch.equal(x, everyone[0]) for x in everyone)))
    # the fragment last ended: its exchange in flight, or (H/F > 1) its verdict, the exchange due at the next step
    return checks, opt.rounds, opt._pending_fragment if opt._agreeing is None else opt._agreeing.fragment


@pytest.mark.parametrize("H, F, alpha, eager", [(6, 3, 1.0, False), (3, 3, 1.0, False), (6, 3, 0.5, True)])
def test_each_fragment_is_received_h_over_f_steps_after_its_launch_and_carries_its_progress(H, F, alpha, eager):
    for checks, rounds, flying in run_workers(_fragments_by_hand, 2, H, F, 4 * H, alpha, eager):
        for t, (theta, start, origin, same) in enumerate(checks, 1):
            assert theta, f"step {t}: θ_i is not the schedule by hand"
            assert start, f"step {t}: θ_s is not the schedule by hand"
            assert origin, f"step {t}: o_i is not where the fragment's launch put it"
            assert same, f"step {t}: θ_s differs between ranks"
        assert rounds == 3 and flying == F - 1  # the last fragment's round 4 is in flight


# ------------------------------------------------------------------ a two-stage exchange kept in flight
def _scatter_stages(rank, world, bits):
    """The scatter mean launched, advanced without waiting until its second stage (the all-gather) is in flight,
    then read: equal, d and the owner's residual, to the same exchange run through at once. Streamed, the
    all-gather counts in the stats of the step that launches it (``later``), not in the launching step's."""
    n, sizes = 75, [35, 13, 27]
    g = torch.Generator().manual_seed(7 + rank)
    v = torch.randn(n, generator=g)
    scales = torch.stack([x.abs().mean() for x in v.split(sizes)]).double()
    head = scales.clone()
    dist.all_reduce(head)
    agg = ScatterMean(world, bits=bits)
    E = owner_span(n, world, bits)
    group = comm.own_group(None, torch.device("cpu"))
    out = []
    for streamed in (False, True):
        owner = torch.full((E,), 0.01 * (rank + 1))
        stats = comm.CommStats()
        agreement, sent = agg.launch(v.clone(), sizes, head=head.tolist(), count=world, step=3, generator=None,
                                     group=group, stats=stats, feedback=True, scales=scales, owner=owner)
        later = comm.CommStats() if streamed else stats
        stages = [stats.n_collectives]
        if streamed:
            deadline = time.monotonic() + 60
            while later.n_collectives < 1 and time.monotonic() < deadline:  # only the all-to-all launched so far
                agreement.advance(later)
                time.sleep(0.005)
            stages.append(later.n_collectives)
        d, signed = agreement.result(later)
        out.append((d, owner, sent, stages, stats.n_collectives + (later.n_collectives if streamed else 0), signed,
                    stats.n_collectives))
    return out


@pytest.mark.parametrize("bits", [1, 4])
def test_the_scatter_means_all_gather_is_launched_between_steps_and_the_result_is_the_blocking_one(bits):
    for blocking, streamed in run_workers(_scatter_stages, 3, bits):
        assert torch.equal(blocking[0], streamed[0]) and torch.equal(blocking[1], streamed[1])
        assert torch.equal(blocking[2], streamed[2]) and blocking[5] is streamed[5] is False
        assert blocking[3] == [1] and streamed[3] == [1, 1]  # launch: the all-to-all; advance: the all-gather
        assert blocking[4] == streamed[4] == 2 and streamed[6] == 1  # the all-gather in the advancing step's stats


# ------------------------------------------------------------------ the scatter mean in fragments, resumed
CONFIGS = [
    dict(vote="onebit", aggregate="mean", bits=4, error_feedback=True, outer="nesterov", outer_lr=0.7, fragments=3),
    dict(vote="onebit", aggregate="mean", bits=2, error_feedback=True, outer="nesterov", outer_lr=0.7),
    dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True, inner="adamw", fragments=3),
    dict(vote="onebit", aggregate="mean", bits=4, error_feedback=True, outer="nesterov", outer_lr=0.7, fragments=3,
         eager=True),
]


def test_the_scatter_mean_streams_in_fragments_keeps_replicas_agreed_and_resumes_mid_flight_bit_exact():
    # H = 6: with F = 3 fragments end at steps 5, 7, 9, 11 (0-based); step 6: fragment 2's verdict or exchange in
    # flight; 7 and 11: a fragment's end, its verdict in flight (read at a later step). Without fragments: round
    # 0's exchange in flight at steps 6 and 7 (read between steps or not); 11: round 1's end, just launched
    for res in run_workers(_resume, 3, CONFIGS, 6, 20, (6, 7, 11)):
        for cfg, resumed, rounds, identical, owners in res:
            assert identical, f"θ_s differs between ranks: {cfg}"
            assert rounds == 3, cfg  # 20 steps of H = 6: three rounds complete (the last by flush)
            assert owners == (cfg["vote"] == "onebit"), cfg
            for at, (_, same) in resumed.items():
                assert same, f"resumed from step {at} differs for {cfg}"
            flying = {at: kind for at, (kind, _) in resumed.items()}  # each save was taken mid-flight
            if cfg.get("fragments", 1) > 1:
                assert flying[7] == flying[11] == "verdict" and flying[6] is not None, (cfg, flying)
            else:
                assert flying[11] == "exchange" and {flying[6], flying[7]} <= {"exchange", "agreed"}, (cfg, flying)


# ------------------------------------------------------------------ two replica groups
def _two_groups(rank, world):
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    params = _params(seed=rank % 2)
    opt = LocalCub(params, lr=1e-2, local_steps=4, vote="onebit", aggregate="mean", bits=4, error_feedback=True,
                   delay=1, fragments=2, process_group=mine)
    for step in range(13):
        for p, g in zip(params, _grads(params, rank, step)):
            p.grad = g
        opt.step()
        loss = torch.ones(1)
        dist.all_reduce(loss)  # a collective of the caller's on the world, a fragment in flight
    opt.flush()
    return _flat(opt.state[p]["start"] for p in params), opt.rounds


def test_two_replica_groups_stream_fragments_on_their_own_groups():
    (s0, r0), (s1, r1), (s2, r2), (s3, r3) = run_workers(_two_groups, 4)
    assert torch.equal(s0, s2) and torch.equal(s1, s3) and not torch.equal(s0, s1)
    assert r0 == r1 == r2 == r3 == 3


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kw, match", [
    (dict(fragments=2, vote="grad"), "fragments=2 staggers streaming rounds: it needs delay=1"),
    (dict(fragments=0, vote="grad", delay=1), r"Streaming.fragments must be an int >= 1"),
    (dict(fragments=4, vote="grad", delay=1, local_steps=6), "fragments must divide local_steps=6"),
    (dict(fragments=2, vote="grad", delay=1, local_steps="auto", alpha=1e-4, beta=1e-9),
     "fragments=2 needs a fixed local_steps"),
    (dict(fragments=2, vote="pbit", bits=4, quantizer="l1", delay=1, local_steps=4),
     "fragments=2 needs an aggregation that decides each tensor alone"),
    (dict(fragments=4, vote="grad", delay=1, local_steps=4), r"fragments must be at most the places"),
])
def test_bad_fragment_arguments_are_named(kw, match):
    kw = {"local_steps": 2, **kw}
    with pytest.raises(ValueError, match=match):
        LocalCub(_params(), **kw)


def test_a_checkpoint_of_other_fragments_is_refused():
    a = LocalCub(_params(), local_steps=2, vote="grad", delay=1, fragments=2)
    b = LocalCub(_params(), local_steps=2, vote="grad", delay=1)
    with pytest.raises(ValueError, match="fragments=2"):
        b.load_state_dict(a.state_dict())


# ------------------------------------------------------------------ lioncub train --delay 1 --fragments F
@pytest.mark.slow  # ~25 s: two 2-worker runs of gpt-tiny
def test_lioncub_train_streams_fragments_and_resumes_mid_flight_bit_for_bit(tmp_path, corpus_cache):
    """--local-steps 4 --delay 1 --fragments 2: a fragment's round ends every 2 steps (its exchange sent by the
    next end), and a run resumed from the checkpoint at step 6 (fragment 0's verdict in flight: the checkpoint
    launches its exchange) reproduces the uninterrupted one's losses."""
    from tests.test_harness_train import TINY, _losses, _resumed_from, lioncub, read_csv, read_jsonl

    common = [*TINY, "--vote", "onebit", "--bits", "4", "--local-steps", "4", "--inner", "adamw", "--aggregate",
              "mean", "--error-feedback", "--outer-lr", "0.7", "--delay", "1", "--fragments", "2", "--steps", "12",
              "--eval-every", "4", "--check-every", "1", "--nproc", "2", "--cache-dir", str(corpus_cache)]
    full = tmp_path / "full"
    lioncub("train", *common, "--ckpt-every", "6", "--out", str(full))
    records = read_jsonl(full / "metrics.jsonl")
    sent = [r["bytes_sent"] for r in records if r["kind"] == "step"]
    # a fragment's end (steps 2, 4, ...) sends its verdict; its exchange goes at the first step that finds the
    # verdict in, at the latest the next end (then, once its all-to-all is done, the all-gather: counted in the
    # step that launches it)
    verdict = sent[1]
    assert sent[0] == 0 and 0 < verdict < 1000 and all(x >= verdict for x in sent[1::2]), sent
    assert all(sent[k] + sent[k + 1] > 10 * verdict for k in range(2, len(sent) - 1, 2)), sent
    assert read_csv(full / "summary.csv")[0]["label"] == "lioncub-onebit-4b-h4-mean-streaming-f2"
    assert _resumed_from(full, 6, tmp_path / "resumed", common) == _losses(records)


# ------------------------------------------------------------------ the fragment's verdict, read when it is in
HELD_S = 30.0
"""Seconds a rank held back (or waiting for a verdict) waits before the test fails: what it waits for comes in
milliseconds unless the optimizer makes a rank wait for the held one (then never)."""
NAP = 0.5
"""Seconds the late rank sleeps between rank 0 starting a step that must wait for it and its own step: a step that
did not wait returns in milliseconds, a hundredth of this or less."""


def _await(key: str, what: str) -> None:
    """Until ``key`` is set in the group's store by another rank; fails naming ``what`` after :data:`HELD_S`."""
    try:
        _get_default_store().wait([key], timedelta(seconds=HELD_S))
    except Exception:  # (the store's timeout: DistStoreError)
        raise AssertionError(f"rank {dist.get_rank()} waited {HELD_S:g} s for {what}") from None


def _slow_rank(rank, world):
    """H = 4, F = 2: fragment 0's round ends at step 6, fragment 1's at step 8. Rank 1 is held before its step 6
    until rank 0 has taken steps 6 and 7 and begins step 8: a rank 0 that waited for rank 1 at the fragment's end
    or at the next step would never get there (rank 1's wait fails). Then rank 1 sleeps :data:`NAP`, marks that it
    sends, and steps; returns (rank 0: whether that mark was set when its step 8 returned, rounds). (Steps here take
    microseconds: each rank waits for fragment 1's verdict after step 4, so that step 5 launches its exchange, as a
    step of a real model's compute would.)"""
    params = _params()
    opt = LocalCub(params, lr=LR, local_steps=4, inner=_sgd, vote="grad", outer="sgd", delay=1, fragments=2)
    store, sent_first = _get_default_store(), None
    for t in range(1, 11):
        for p, g in zip(params, _grads(params, rank, t)):
            p.grad = g
        if rank == 1 and t == 6:
            _await("rank 0 at step 8", "rank 0 to get through steps 6 and 7: it waited for the late rank there")
            time.sleep(NAP)
            store.set("rank 1 sends", "1")
        if rank == 0 and t == 8:
            store.set("rank 0 at step 8", "1")
        opt.step()
        if rank == 0 and t == 8:
            sent_first = store.check(["rank 1 sends"])
        if t == 4:  # fragment 1's verdict in before step 5, as a step of real compute gives it time to be
            _verdict_in(opt)
    opt.flush()
    return sent_first, opt.rounds


def test_a_late_rank_holds_the_others_only_at_the_next_fragments_end():
    (sent_first, rounds0), (_, rounds1) = run_workers(_slow_rank, 2)
    assert sent_first, "rank 0 went on at the next fragment's end before rank 1 sent: it cannot have received"
    assert rounds0 == rounds1 == 2


def _verdict_in(opt, timeout: float = HELD_S) -> None:
    """Until the fragment's verdict in flight is complete on this rank (its read then falls in the next step);
    fails after ``timeout`` seconds (it takes milliseconds)."""
    assert opt._agreeing is not None, f"rank {dist.get_rank()}: no fragment's verdict in flight to wait for"
    deadline = time.monotonic() + timeout
    while not opt._agreeing.verdict.ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {dist.get_rank()}: the fragment's verdict was not in after {timeout:g} s")
        time.sleep(0.001)


def _checkpoint_between(rank, world):
    """H = 4, F = 2, 12 steps; rank 0 is held before its step 6 (fragment 0's end) until rank 1 has taken step 7,
    then waits until the verdict is in, so that its step 7 launches the exchange, where rank 1's step 7 (taken
    before rank 0 sent its verdict) cannot have (after step 4 both wait for fragment 1's verdict, so that rank 1's
    steps 6 and 7 do not wait for rank 0). Both save after step 7, then a world all-gather; (what was in flight on
    this rank when it saved: tests.test_streaming.in_flight, the uninterrupted run's parameters, those of the run
    resumed from that checkpoint)."""
    store = _get_default_store()

    def build():
        params = _params()
        return params, LocalCub(params, lr=LR, local_steps=4, inner=_sgd, vote="grad", outer="sgd", delay=1,
                                fragments=2)

    def steps(params, opt, first, last):
        for t in range(first, last + 1):
            for p, g in zip(params, _grads(params, rank, t)):
                p.grad = g
            if rank == 0 and t == 6:
                _await("rank 1 took step 7", "rank 1 to take steps 6 and 7: it waited for rank 0 there")
            opt.step()
            if rank == 1 and t == 7:
                store.set("rank 1 took step 7", "1")
            if t == 4 or (rank == 0 and t == 6):
                _verdict_in(opt)

    params, opt = build()
    steps(params, opt, 1, 7)
    flying = in_flight(opt)
    saved = copy.deepcopy(opt.state_dict())  # (state_dict holds the optimizer's own tensors)
    dist.all_gather([torch.zeros(1) for _ in range(world)], torch.ones(1))  # a caller's collective after the save
    steps(params, opt, 8, 12)
    opt.flush()
    params2, opt2 = build()
    opt2.load_state_dict(saved)
    steps(params2, opt2, 8, 12)
    opt2.flush()
    return flying, _flat(params), _flat(params2)


def test_a_checkpoint_while_one_rank_has_launched_a_fragments_exchange_and_another_not():
    (flying0, full0, resumed0), (flying1, full1, resumed1) = run_workers(_checkpoint_between, 2, timeout_s=60.0)
    # the case: rank 0 in its exchange, rank 1 still before it (its verdict in flight)
    assert flying0 in ("exchange", "agreed") and flying1 == "verdict", (flying0, flying1)
    assert torch.equal(full0, resumed0) and torch.equal(full1, resumed1)


def _nan_at_fragment_end(rank, world, nonfinite):
    """H = 4, F = 2: rank 1's gradient is NaN at step 6 (fragment 0's end). Per step from 6: (θ_i == θ_s on
    every tensor, a verdict due, skipped rounds), step 7 taken once the verdict is in (it reads it); then θ_s the same
    on both ranks after 12 steps, and rounds."""
    params = _params()
    opt = LocalCub(params, lr=LR, local_steps=4, inner=_sgd, vote="grad", outer="sgd", delay=1, fragments=2,
                   nonfinite=nonfinite)
    seen = []
    for t in range(1, 13):
        for p, g in zip(params, _grads(params, rank, t)):
            p.grad = torch.full_like(g, float("nan")) if (rank, t) == (1, 6) else g
        try:
            opt.step()
        except FloatingPointError as e:
            return str(e), t
        if t == 6:
            _verdict_in(opt)
        if t >= 6:
            seen.append((all(torch.equal(p, opt.state[p]["start"]) for p in params), opt._agreeing is not None,
                         opt.skipped_rounds))
    opt.flush()
    starts = _flat(opt.state[p]["start"] for p in params)
    everyone = [torch.empty_like(starts) for _ in range(world)]
    dist.all_gather(everyone, starts)
    return seen, torch.equal(everyone[0], everyone[1]), opt.rounds


def test_a_nonfinite_fragment_is_dropped_on_every_rank_at_the_step_that_reads_its_verdict():
    for seen, same, rounds in run_workers(_nan_at_fragment_end, 2, "skip"):
        assert seen[0] == (False, True, 0)  # step 6: the verdict launched, not read; θ_i moved on
        assert seen[1] == (True, False, 1)  # step 7: read; every replica back to θ_s, the round dropped
        assert seen[2][2] == 1 and same and rounds == 3  # the rounds go on (round 2 without fragment 0's agreement)
    for message, t in run_workers(_nan_at_fragment_end, 2, "raise"):
        assert t == 7 and "non-finite" in message and "nonfinite='skip'" in message
