"""LocalCub's scatter mean (``vote='onebit', aggregate='mean', bits=1|2|4|8``) on real gloo groups, against an
independent float64 reference of its math written here from the docstring (both residuals by hand)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.flat import LocalCub
from tests.dist import run_workers

SIZES = (39, 11)  # 50 elements: 3 ranks own uneven spans, with padding at every code width
ROUNDS = 3
CLIP = 4


def _grads(rank: int, rnd: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients in round ``rnd``; the second tensor 1000x smaller (its own scale must keep it)."""
    g = torch.Generator().manual_seed(100 * rnd + rank)
    out = [torch.randn(SIZES[0], generator=g), 1e-3 * torch.randn(SIZES[1], generator=g)]
    if rnd == 0:
        out[0][0], out[0][1] = 50.0, -50.0  # clipped at every width above 1 bit
        out[0][2] = 0.0  # a zero: the sign code takes the round's parity
    return out


def _run(rank, world, bits):
    # parameters at 0, inner SGD at lr 1, one local step: Δ = g exactly; outer SGD at 1: θ_s ← θ_s − d
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    opt = LocalCub(ps, lr=1.0, local_steps=1, inner=lambda groups: torch.optim.SGD(groups), vote="onebit",
                   aggregate="mean", bits=bits, error_feedback=True, outer="sgd", outer_lr=1.0)
    out = []
    for rnd in range(ROUNDS):
        before = [p.detach().clone() for p in ps]
        for p, g in zip(ps, _grads(rank, rnd)):
            p.grad = g.clone()
        opt.step()
        stats = opt.last_round_stats
        out.append(dict(d=torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, ps)]),
                        residual=torch.cat([opt.state[p]["residual"].reshape(-1) for p in ps]),
                        owner=opt.owner_residuals[0].clone(), sent=stats.bytes_sent, calls=stats.n_collectives))
    return out


def _levels(bits):
    return 1 if bits == 1 else 2 ** (bits - 1) - 1


EDGE = 1e-4
"""How near, in levels, a value of the references' data may come to the edge between two levels: no nearer, so that
fp32 and float64 (~1e-6 of a level apart here) decide the same level. Values exactly 0 are decided by the rule."""


def _quantize(x: torch.Tensor, unit: float, bits: int, parity: int) -> torch.Tensor:
    """Levels of ``x`` (float64): the sign at 1 bit, ±1/2 and ±3/2 at 2 bits (zeros: up on even rounds, down on
    odd), else round and clamp to ±(2^(b−1) − 1). Asserts that no value lies within EDGE of an edge."""
    s = _levels(bits)
    y = x / unit if unit > 0 else torch.zeros_like(x)
    edge = {1: y, 2: y - y.round().clamp(-1, 1)}.get(bits, y.abs() - y.abs().floor() - 0.5)  # edges: 0; 0, ±1; k+½
    near = (edge.abs() < EDGE) & (x != 0) & (y.abs() < s if bits > 2 else True)
    assert not bool(near.any()), f"{y[near].tolist()} levels: too near an edge for fp32 to agree; choose other data"
    if bits == 1:
        zero = -1.0 if parity else 1.0
        return torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, zero)).double()
    if bits == 2:
        return torch.where(x == 0, -0.5 if parity else 0.5, y.floor() + 0.5).clamp(-1.5, 1.5)
    return y.round().clamp(-s, s)


def _unit(scale: float, bits: int) -> float:
    if bits <= 2:
        return scale * (1.0 if bits == 1 else 1.25)
    s = _levels(bits)
    return scale * min(s, CLIP) / s


def _span(n: int, world: int, bits: int) -> int:
    """Elements each owner holds of a message of ``n``: ceil(n / P), rounded up to a whole byte of codes."""
    per = 8 // bits
    return math.ceil(math.ceil(n / world) / per) * per


def _encode(v: list[torch.Tensor], tensor_of: list[int], units: dict, bits: int,
            parity: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The workers' half of one message's scatter mean in float64 (ScatterMean's docstring). ``v``: every rank's v
    over the message (element k of tensor ``tensor_of[k]``), ``units``: unit_t. q_i = levels(v_i; unit_t); returns
    every rank's C(v_i) = unit_t·q_i and their mean a = unit_t·Σ_i q_i / P."""
    unit = torch.tensor([units[t] for t in tensor_of], dtype=torch.float64)
    sent = []
    for x in v:
        q = torch.zeros(len(tensor_of), dtype=torch.float64)
        for t in units:
            idx = [k for k, u in enumerate(tensor_of) if u == t]
            q[idx] = _quantize(x[idx], units[t], bits, parity)
        sent.append(q * unit)
    return sent, sum(sent) / len(v)


def _own(a: torch.Tensor, tensor_of: list[int], owners: list[torch.Tensor], bits: int,
         parity: int) -> tuple[torch.Tensor, dict]:
    """The owners' half: owner j over its span j of E elements (:func:`_span`), ``owners[j]`` its residual r_j
    (replaced): x = a + r_j; per tensor t in the span w = levels(x; unit'_t), unit'_t from mean|x| over t's part of
    the span; r_j ← x − unit'_t·w (its padding beyond the message kept); d = unit'_t·w. Returns d and each tensor's
    least unit'_t."""
    world, n = len(owners), len(tensor_of)
    span = _span(n, world, bits)
    d, least = torch.zeros(n, dtype=torch.float64), {}
    for j in range(world):
        lo, hi = j * span, min(n, (j + 1) * span)
        x = owners[j].clone()
        for t in dict.fromkeys(tensor_of[lo:hi]):
            mine = [k - lo for k in range(lo, hi) if tensor_of[k] == t]
            x[mine] += a[[lo + k for k in mine]]
            u2 = _unit(float(x[mine].abs().mean()), bits)
            w = _quantize(x[mine], u2, bits, parity)
            d[[lo + k for k in mine]] = u2 * w
            x[mine] -= u2 * w
            if u2 > 0:
                least[t] = min(least.get(t, math.inf), u2)
        owners[j] = x
    return d, least


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor, what) -> None:
    """|got − want| ≤ tol element for element (tol 0: exactly equal)."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), (what, float((err - tol).max()), int((err - tol).argmax()))


LEVEL = 1e-3
"""The tolerance of fp32 against float64: this fraction of each tensor's smallest unit (a level), element for
element. fp32's rounding was measured at most 2e-4 of it (8 bits, beside the clipped ±50's residuals), below 2e-5
at 1-4 bits; a level decided otherwise is a whole unit."""


def _reference(world: int, bits: int) -> list[dict]:
    """Every round's d, every rank's worker residual, every owner's residual and each tensor's smallest unit (the
    workers' unit_t or an owner's unit'_t), in float64: the whole model one message."""
    n = sum(SIZES)
    tensor_of = [0] * SIZES[0] + [1] * SIZES[1]
    span = _span(n, world, bits)
    e = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    r = [torch.zeros(span, dtype=torch.float64) for _ in range(world)]
    out = []
    for rnd in range(ROUNDS):
        v = [torch.cat(_grads(i, rnd)).double() + e[i] for i in range(world)]
        units = {t: _unit(sum(float(x[part].abs().mean()) for x in v) / world, bits)
                 for t, part in enumerate([slice(0, SIZES[0]), slice(SIZES[0], n)])}
        sent, a = _encode(v, tensor_of, units, bits, rnd % 2)
        d, least = _own(a, tensor_of, r, bits, rnd % 2)
        e = [x - c for x, c in zip(v, sent)]
        unit = torch.tensor([min(units[t], least.get(t, math.inf)) for t in tensor_of], dtype=torch.float64)
        out.append(dict(d=d, residual=e, owner=[x.clone() for x in r], span=span, unit=unit))
    return out


def _agreement_bytes(world: int, tensors: int) -> float:
    """Bytes a rank sends in a round's one small agreement: a ring all-reduce (2(P−1)/P of the vector) of a
    non-finite count and each parameter's head, fp64."""
    return 2 * (world - 1) / world * 8 * (1 + tensors)


def _planned_bytes(world: int, bits: int, chunks: list[tuple[int, int]]) -> float:
    """Bytes a rank sends in the exchanges of ``chunks`` ((elements, tensors) each) by ScatterMean.plan, the
    collectives' bytes per rank turned into bytes sent by their ring definitions: an all-to-all of a buffer of B
    sends (P−1)/P·B, an all-gather of B from each rank sends (P−1)·B."""
    from lioncub.votes.rounds import ScatterMean

    ring = {"all_to_all": lambda b: (world - 1) / world * b, "all_gather": lambda b: (world - 1) * b}
    return sum(ring[kind](b) for n, t in chunks for kind, b in ScatterMean(world, None, bits).plan(n, t))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_scatter_mean_equals_the_reference_with_both_residuals(bits):
    world = 3
    got = run_workers(_run, world, bits)
    ref = _reference(world, bits)
    for rnd, want in enumerate(ref):
        tol = LEVEL * want["unit"]  # per tensor: the second is 1000x smaller, so is its tolerance
        owned = [torch.cat([tol, torch.zeros(want["span"] * world - tol.numel(), dtype=torch.float64)])[
            j * want["span"]:(j + 1) * want["span"]] for j in range(world)]  # padding: exactly 0
        for rank in range(world):
            mine = got[rank][rnd]
            assert torch.equal(mine["d"], got[0][rnd]["d"])  # one d on every rank
            _assert_close(mine["d"], want["d"], tol, ("d", bits, rnd, rank))
            _assert_close(mine["residual"], want["residual"][rank], tol, ("residual", bits, rnd, rank))
            _assert_close(mine["owner"], want["owner"][rank], owned[rank], ("owner", bits, rnd, rank))
            assert mine["calls"] == 3  # the round's agreement, the all-to-all, the all-gather
            # bytes on the wire, on every rank: the agreement's and what ScatterMean.plan prices
            assert mine["sent"] == pytest.approx(_agreement_bytes(world, len(SIZES))
                                                 + _planned_bytes(world, bits, [(sum(SIZES), len(SIZES))]), rel=1e-12)


def _one_rank(bits):
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    opt = LocalCub(ps, lr=1.0, local_steps=1, inner=lambda groups: torch.optim.SGD(groups), vote="onebit",
                   aggregate="mean", bits=bits, error_feedback=True)
    for rnd in range(2):
        for p, g in zip(ps, _grads(0, rnd)):
            p.grad = g.clone()
        opt.step()
    return ps, opt


@pytest.mark.parametrize("bits", [1, 4])
def test_one_rank_runs_the_same_math_and_a_checkpoint_keeps_the_owner_residual(bits):
    ps, opt = _one_rank(bits)
    ref = _reference(1, bits)
    assert torch.allclose(-torch.cat([p.detach().reshape(-1) for p in ps]).double(), ref[0]["d"] + ref[1]["d"],
                          rtol=0, atol=1e-5)
    sd = opt.state_dict()
    again = LocalCub([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1.0, local_steps=1,
                     inner=lambda groups: torch.optim.SGD(groups), vote="onebit", aggregate="mean", bits=bits,
                     error_feedback=True)
    again.load_state_dict(sd)
    assert torch.equal(again.owner_residuals[0], opt.owner_residuals[0]) and opt.owner_residuals[0].abs().sum() > 0
    sd["local"]["owner_residuals"]["0"] = torch.zeros(3)
    with pytest.raises(ValueError, match="owner residual of chunk 0 has 3 elements"):
        again.load_state_dict(sd)


@pytest.mark.parametrize("kw, match", [
    (dict(vote="onebit", aggregate="mean"), "needs error_feedback=True"),
    (dict(vote="onebit", aggregate="mean", bits=3, error_feedback=True), "bits must be one of"),
    (dict(vote="gather", aggregate="mean", error_feedback=True), "aggregate='mean' needs vote="),
])
def test_scatter_mean_refusals_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        LocalCub([torch.nn.Parameter(torch.zeros(4))], **kw)


def test_fingerprint_holds_the_width():
    a = LocalCub([torch.nn.Parameter(torch.zeros(4))], vote="onebit", aggregate="mean", bits=2, error_feedback=True)
    b = LocalCub([torch.nn.Parameter(torch.zeros(4))], vote="onebit", aggregate="mean", bits=4, error_feedback=True)
    assert a.bits == 2 and a.fingerprint()["bits"] == 2
    with pytest.raises(ValueError, match="bits=2"):
        b.load_state_dict(a.state_dict())


# ------------------------------------------------------------------ local_steps='auto'
def test_round_seconds_and_the_pick_follow_the_alpha_beta_model():
    from lioncub.optim.auto_steps import pick_local_steps, round_seconds
    from lioncub.votes.rounds import Fp32Mean, ScatterMean

    alpha, beta, P = 1e-4, 1e-9, 4
    # fp32 mean of 1000 elements in one chunk of 3 tensors: the agreement (8·4 bytes) and a 4000-byte all-reduce
    want = (2 * 3 * alpha + 2 * 3 / 4 * 32 * 8 * beta) + (2 * 3 * alpha + 2 * 3 / 4 * 4000 * 8 * beta)
    assert round_seconds(Fp32Mean(P), [(1000, 3)], P, alpha, beta) == pytest.approx(want, rel=1e-12)
    # the 2-bit scatter mean: spans of 252 elements (63 bytes): all-to-all of 4 spans, all-gather of a span + 3 scales
    span = 63
    want = (2 * 3 * alpha + 2 * 3 / 4 * 32 * 8 * beta) + (3 * alpha + 3 / 4 * 4 * span * 8 * beta) \
        + (3 * alpha + 3 * (span + 12) * 8 * beta)
    assert round_seconds(ScatterMean(P, None, 2), [(1000, 3)], P, alpha, beta) == pytest.approx(want, rel=1e-12)
    assert pick_local_steps(1.0, 0.05, 0.1, 500) == 200  # 1 s of wire is a tenth of 200 steps of 50 ms
    assert pick_local_steps(1.0, 0.05, 0.1, 100) == 100  # capped
    assert pick_local_steps(1e-6, 0.05, 0.1, 500) == 10 and pick_local_steps(1e-6, 0.05, 0.1, 500, least=1) == 1


SLOW = 0.05
"""Seconds rank 2 sleeps before each step of the timed first round; the other ranks do not sleep."""
ALPHA = 0.25
"""The given link's latency: 8 messages a round (4 of the agreement's all-reduce, 2 each of the all-to-all and the
all-gather on 3 ranks), ~2 s, so that H = round_s / (ROUND_SHARE·step_s) ≈ 80 at step_s = SLOW; H reaches
``min_local_steps`` (10) only at step_s ≈ 8·SLOW, and ``max_local_steps`` (100) is above the pick at any
step_s ≥ SLOW."""


def _auto_steps(rank, world):
    import time

    from lioncub.optim.auto_steps import FIRST_ROUND, ROUND_SHARE, pick_local_steps, round_seconds

    kw = dict(lr=1e-2, vote="onebit", aggregate="mean", bits=2, error_feedback=True)
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    opt = LocalCub(ps, local_steps="auto", alpha=ALPHA, beta=1e-6, max_local_steps=100, **kw)
    synced_at, step = [], 0
    while opt.rounds < 3:  # the timed first round, then two of H (H agreed: every rank stops at one step)
        if rank == 2 and step < FIRST_ROUND:
            time.sleep(SLOW)  # the slowest rank: its iterations decide
        for p, g in zip(ps, _grads(rank, step)):
            p.grad = g.clone()
        opt.step()
        step += 1
        if opt.synced:
            synced_at.append(step)
    pick = dict(opt.steps_pick)
    chunks = [(sum(SIZES), len(SIZES))]
    expected = pick_local_steps(round_seconds(opt.exchange, chunks, world, ALPHA, 1e-6), pick["step_s"],
                                ROUND_SHARE, 100)
    sd = opt.state_dict()
    again = LocalCub([torch.nn.Parameter(p.detach().clone()) for p in ps], local_steps="auto", alpha=ALPHA,
                     beta=1e-6, max_local_steps=100, **kw)
    again.load_state_dict(sd)
    fixed = LocalCub([torch.nn.Parameter(p.detach().clone()) for p in ps], local_steps=pick["H"], **kw)
    try:
        fixed.load_state_dict(sd)
        refused = False
    except ValueError:
        refused = True
    return pick, expected, synced_at, again.H, refused


def test_auto_local_steps_are_picked_from_the_slowest_rank_and_agreed():
    world = 3
    res = run_workers(_auto_steps, world)
    picks = [r[0] for r in res]
    assert all(p == picks[0] for p in picks)  # one pick on every rank
    pick = picks[0]
    assert pick["step_s"] >= SLOW  # the slowest rank's median iteration (each includes its sleep)
    H = pick["H"]
    # the pick from the measured numbers exactly; within the clamps for any step_s from SLOW to ~8·SLOW
    assert H == res[0][1] and 10 < H < 100, pick
    assert res[0][2] == [10, 10 + H, 10 + 2 * H]  # the first round of 10, then rounds of H
    assert res[0][3] == H  # resumed with the saved pick
    assert res[0][4]  # a fixed-H run refuses an 'auto' checkpoint


# ------------------------------------------------------------------ a vote that leaves a rank out (torchft)
def _partial_vote(rank, world, vote):
    from lioncub import votes
    from lioncub.comm import CommStats
    from lioncub.votes.rounds import SignVote

    g = torch.Generator().manual_seed(7 + rank)
    v = torch.randn(45, generator=g)
    v[:5] = 0.0  # zeros: the tie rule's parity, from the voters only
    method = votes.make(vote, world)
    agg = SignVote(world, method)
    out = {}
    for step in (0, 1):
        abstain = rank == 2  # e.g. a replica that rejoins: it sends what adds nothing
        agreement, _ = agg.launch(torch.zeros_like(v) if abstain else v.clone(), [45], head=[], count=2, step=step,
                                  generator=None, group=None, stats=CommStats(), abstain=abstain)
        out[step] = agreement.result()[0]
    everyone = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(everyone, v)
    return out, everyone


@pytest.mark.parametrize("vote", ["pbit", "sign_allreduce"])
def test_an_abstaining_rank_is_left_out_of_the_vote(vote):
    """3 ranks, rank 2 abstaining (count = 2): every rank gets the 2 voters' own vote (the 2-rank method's
    reference: binary lanes decided among 2, ties 0; the sign of the summed signs), zeros by the step's parity."""
    from lioncub import votes

    res = run_workers(_partial_vote, 3, vote)
    voters = res[0][1][:2]
    two = votes.make(vote, 2)
    for step in (0, 1):
        want = two.reference([x.clone() for x in voters], step).float()
        for rank in range(3):
            assert torch.equal(res[rank][0][step], want), (vote, step, rank)
    assert votes.lookup("pbit").partial_vote(None) and not votes.lookup("pbit").partial_vote("l1")
    assert not votes.lookup("onebit").partial_vote(None)


def test_an_empty_chunk_exchanges_nothing():
    from lioncub.comm import CommStats
    from lioncub.votes.rounds import ScatterMean

    stats = CommStats()
    agreement, sent = ScatterMean(1, None, 2).launch(torch.zeros(0), [0], head=[0.0], count=1, step=0, generator=None,
                                                     group=None, stats=stats)
    assert agreement.result()[0].numel() == 0 and sent.numel() == 0 and stats.n_collectives == 0
