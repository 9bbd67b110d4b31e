"""LocalCub's scatter mean (``vote='onebit', aggregate='mean', bits=1|2|4|8``) on real gloo groups, against an
independent float64 reference of its math written here from the docstring (both residuals by hand)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from lioncub import LocalCub
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


def _quantize(x: torch.Tensor, unit: float, bits: int, parity: int) -> torch.Tensor:
    """Levels of ``x`` (float64): the sign at 1 bit, ±1/2 and ±3/2 at 2 bits (zeros: up on even rounds, down on
    odd), else round and clamp to ±(2^(b−1) − 1)."""
    if bits == 1:
        zero = -1.0 if parity else 1.0
        return torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, zero)).double()
    if bits == 2:
        scaled = x / unit if unit > 0 else torch.zeros_like(x)
        return torch.where(x == 0, -0.5 if parity else 0.5, scaled.floor() + 0.5).clamp(-1.5, 1.5)
    s = _levels(bits)
    return (x / unit).round().clamp(-s, s) if unit > 0 else torch.zeros_like(x)


def _unit(scale: float, bits: int) -> float:
    if bits <= 2:
        return scale * (1.0 if bits == 1 else 1.25)
    s = _levels(bits)
    return scale * min(s, CLIP) / s


def _reference(world: int, bits: int) -> list[dict]:
    """Every round's d, every rank's worker residual and every owner's residual, in float64."""
    n = sum(SIZES)
    per = 8 // bits
    span = math.ceil(math.ceil(n / world) / per) * per  # a whole byte of codes per owner
    bounds = [0, SIZES[0], n]
    tensor_of = [0] * SIZES[0] + [1] * SIZES[1]
    e = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    r = [torch.zeros(span, dtype=torch.float64) for _ in range(world)]
    out = []
    for rnd in range(ROUNDS):
        v = [torch.cat(_grads(i, rnd)).double() + e[i] for i in range(world)]
        units = [_unit(sum(float(x[a:b].abs().mean()) for x in v) / world, bits)
                 for a, b in zip(bounds, bounds[1:])]
        q = []
        for i in range(world):
            q.append(torch.cat([_quantize(v[i][a:b], u, bits, rnd % 2) for a, b, u in zip(bounds, bounds[1:], units)]))
            e[i] = v[i] - torch.cat([q[i][a:b] * u for a, b, u in zip(bounds, bounds[1:], units)])
        d = torch.zeros(n, dtype=torch.float64)
        for j in range(world):  # owner j: its span of the message
            lo, hi = j * span, min(n, (j + 1) * span)
            x = r[j].clone()
            for k in range(lo, hi):
                x[k - lo] += units[tensor_of[k]] * sum(float(qi[k]) for qi in q) / world
            for t in range(2):
                idx = [k - lo for k in range(lo, hi) if tensor_of[k] == t]
                if not idx:
                    continue
                part = x[idx]
                u2 = _unit(float(part.abs().mean()), bits)
                w = _quantize(part, u2, bits, rnd % 2)
                d[[lo + k for k in idx]] = u2 * w
                x[idx] = part - u2 * w
            r[j] = x
        out.append(dict(d=d, residual=[x.clone() for x in e], owner=[x.clone() for x in r], span=span))
    return out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_scatter_mean_equals_the_reference_with_both_residuals(bits):
    world = 3
    got = run_workers(_run, world, bits)
    ref = _reference(world, bits)
    for rnd, want in enumerate(ref):
        scale = float(want["d"].abs().max())
        for rank in range(world):
            mine = got[rank][rnd]
            assert torch.equal(mine["d"], got[0][rnd]["d"])  # one d on every rank
            # fp32 against float64: a few ulps of the largest value (no level differs: that would be a whole unit)
            assert torch.allclose(mine["d"].double(), want["d"], rtol=0, atol=1e-5 * scale), (bits, rnd, rank)
            assert torch.allclose(mine["residual"].double(), want["residual"][rank], rtol=0, atol=1e-5 * scale)
            assert torch.allclose(mine["owner"].double(), want["owner"][rank], rtol=0, atol=1e-5 * scale)
            assert mine["calls"] == 3  # the round's agreement, the all-to-all, the all-gather
    # bytes on the wire: (P-1)/P of the P spans' codes in the all-to-all, (P-1) spans and 2 fp32 scales in the
    # all-gather, beside the round's agreement (the same at every width)
    span_bytes = ref[0]["span"] * bits // 8
    payload = (world - 1) * span_bytes + (world - 1) * (span_bytes + 4 * len(SIZES))
    assert got[0][0]["sent"] - payload == pytest.approx(got[0][1]["sent"] - payload)


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
    (dict(vote="gather", aggregate="mean", error_feedback=True), "aggregate='mean' averages"),
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


def _auto_steps(rank, world):
    import time

    from lioncub.optim.auto_steps import FIRST_ROUND, ROUND_SHARE, pick_local_steps, round_seconds

    ps = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    opt = LocalCub(ps, lr=1e-2, local_steps="auto", vote="onebit", aggregate="mean", bits=2, error_feedback=True,
                   alpha=1e-2, beta=1e-6)  # a slow link, given: ~20 ms of latency per message
    synced_at = []
    for step in range(FIRST_ROUND + 150):
        time.sleep(0.004 * (rank + 1))  # rank 2 is the slowest: its iterations decide
        for p, g in zip(ps, _grads(rank, step)):
            p.grad = g.clone()
        opt.step()
        if opt.synced:
            synced_at.append(step + 1)
    pick = dict(opt.steps_pick)
    chunks = [(sum(SIZES), len(SIZES))]
    expected = pick_local_steps(round_seconds(opt.aggregation, chunks, world, 1e-2, 1e-6), pick["step_s"], ROUND_SHARE, 500)
    sd = opt.state_dict()
    again = LocalCub([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2, local_steps="auto", vote="onebit",
                     aggregate="mean", bits=2, error_feedback=True, alpha=1e-2, beta=1e-6)
    again.load_state_dict(sd)
    fixed = LocalCub([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2, local_steps=pick["H"],
                     vote="onebit", aggregate="mean", bits=2, error_feedback=True)
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
    assert pick["step_s"] >= 0.012  # the slowest rank's iteration (it sleeps 12 ms)
    H = pick["H"]
    assert H == res[0][1] and 10 < H < 150  # ~80 ms of wire against a tenth of ~13 ms steps
    assert res[0][2] == list(range(10, 10 + 150 + 1, H))  # the first round of 10, then rounds of H
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
