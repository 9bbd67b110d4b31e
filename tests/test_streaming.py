"""LocalCub's streaming rounds (``delay=1``), on real gloo groups (2-3 workers).

Round k's agreement is launched at its end and applied at the end of round k+1, then the
round in flight is rebased: θ_i ← θ_s − Δ_i (docs/local_steps.md, "Streaming rounds")."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lioncub import majority_vote
from tests.flat import LocalCub
from tests.dist import run_workers

SHAPES = [(7, 5), (13,), (3, 3, 3)]
LR, ALPHA = 2 ** -6, 1.0  # outer='sgd' with α = 1: θ_s_new = θ_s − α·d by one fp32 op, as the test does it

AGGREGATIONS = {  # each way a round agrees that delay=1 streams
    "grad": dict(vote="grad"),
    "vote": dict(vote="sign_allreduce", error_feedback=True),
    "pbit-vote": dict(vote="pbit", bits=8, quantizer="l1", error_feedback=True),
    "mean": dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True),
    # the scatter mean at 4 bits (the long rounds' code: lioncub.optim.regime.SETTINGS), both residuals by hand
    "scatter": dict(vote="onebit", aggregate="mean", bits=4, error_feedback=True),
}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _grads(params, rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(p.shape, generator=g) for p in params]


def _sgd(groups):
    return torch.optim.SGD(groups)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _lane_mean_by_hand(v: torch.Tensor, sizes: list[int], world: int, bits: int = 8) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """The 8-bit L1 lane mean (docs/local_steps.md) from the math, no lanes or packing: s = ⌊(2^w − 1) / 2P⌋
    levels, per tensor t the ranks' mean of mean|v_i| M_t (summed by one float64 all-reduce, as the head
    carries it), unit_t = min(s, 4)·M_t / s, q_i = clamp(round(v_i / unit_t), −s, s), d = unit_t·Σ_i q_i / P
    (the q_i gathered and summed here). Returns (d, this rank's C(v_i) = unit_t·q_i)."""
    s = (2 ** bits - 1) // (2 * world)
    norms = torch.stack([piece.abs().mean() for piece in v.split(sizes)]).double()
    dist.all_reduce(norms)
    units = [float(m) / world * (min(s, 4) / s) for m in norms]
    q = torch.cat([torch.round(piece * (1.0 / u)).clamp(-s, s) if u > 0 else torch.zeros_like(piece)
                   for piece, u in zip(v.split(sizes), units)])
    everyone = [torch.empty_like(q) for _ in range(world)]
    dist.all_gather(everyone, q)
    total = torch.stack(everyone).sum(0)
    return (torch.cat([piece * (u / world) for piece, u in zip(total.split(sizes), units)]),
            torch.cat([piece * u for piece, u in zip(q.split(sizes), units)]))


def _scatter_levels(v: torch.Tensor, sizes: list[int], world: int, bits: int) -> tuple[list[float], torch.Tensor]:
    """The scatter mean's first half (lioncub.votes.rounds.ScatterMean's docstring, b >= 4 bits): s = 2^(b−1) − 1
    levels a side, per tensor t the ranks' mean of mean|v_i| M_t (summed by one float64 all-reduce, as the
    round's head carries it), unit_t = M_t·min(s, 4)/s, q_i = clamp(round(v_i / unit_t), −s, s). Returns
    (the units, q_i); C(v_i) = unit_t·q_i."""
    assert bits >= 4  # (the 1- and 2-bit codes, sign and half levels, are tests/test_round_scatter.py's)
    s = 2 ** (bits - 1) - 1
    norms = torch.stack([piece.abs().mean() for piece in v.split(sizes)]).double()
    dist.all_reduce(norms)
    units = [float(m) / world * (min(s, 4) / s) for m in norms]
    q = torch.cat([torch.round(piece * (1.0 / u)).clamp(-s, s) if u > 0 else torch.zeros_like(piece)
                   for piece, u in zip(v.split(sizes), units)])
    return units, q


def _scatter_mean_by_hand(v: torch.Tensor, sizes: list[int], world: int, bits: int,
                          owner: torch.Tensor) -> torch.Tensor:
    """The scatter mean's d from the ranks' v (collective), written from ScatterMean's docstring with gathers in
    place of its codes: rank j owns the j-th span of E = ⌈⌈n/P⌉ / (8/b)⌉·(8/b) elements; there a = unit_t·Σ_i q_i
    / P, x = a + r (``owner``: this rank's r, updated in place to x − unit'_t·w), unit'_t = mean|x| over tensor t's
    part of the span·min(s, 4)/s, w = clamp(round(x / unit'_t), −s, s), d = unit'_t·w on every rank."""
    s = 2 ** (bits - 1) - 1
    units, q = _scatter_levels(v, sizes, world, bits)
    everyone = [torch.empty_like(q) for _ in range(world)]
    dist.all_gather(everyone, q)
    total = torch.stack(everyone).sum(0)  # sums of levels: exact in any order
    n, per = v.numel(), 8 // bits
    E = -(-(-(-n // world)) // per) * per
    lo, hi = dist.get_rank() * E, min(n, (dist.get_rank() + 1) * E)
    mine = torch.zeros(E)
    x = owner[:E].clone()
    start = 0
    for size, unit in zip(sizes, units):  # each tensor's part of this rank's span
        a, b = max(start, lo), min(start + size, hi)
        start += size
        if a >= b:
            continue
        part = total[a:b] * (unit / world) + x[a - lo:b - lo]
        unit2 = part.abs().mean() * (min(s, 4) / s)
        w = (part / unit2.clamp_min(torch.finfo(torch.float32).tiny)).round().clamp(-s, s)
        mine[a - lo:b - lo] = w * unit2
        x[a - lo:b - lo] = part - w * unit2
    owner[:E] = x
    spans = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(spans, mine)
    return torch.cat(spans)[:n]


def _sent_by_hand(cfg: dict, v: torch.Tensor, sizes: list[int], world: int):
    """C(v_i), what this rank's v contributes (collective for the means), where the test writes it by hand:
    the lane mean's and the scatter mean's unit_t·q_i, sign_allreduce's mean|v_t|·sign(v_t) per tensor; None
    otherwise."""
    if cfg.get("aggregate") == "mean" and cfg["vote"] == "onebit":
        units, q = _scatter_levels(v, sizes, world, cfg["bits"])
        return torch.cat([piece * u for piece, u in zip(q.split(sizes), units)])
    if cfg.get("aggregate") == "mean":
        return _lane_mean_by_hand(v, sizes, world, cfg["bits"])[1]
    if cfg["vote"] == "sign_allreduce":
        return torch.cat([piece.sign() * piece.abs().mean() for piece in v.split(sizes)])
    return None


def _agreed_d(cfg: dict, v: torch.Tensor, sizes: list[int], rounds: int, world: int,
              owner: torch.Tensor = None) -> tuple[torch.Tensor, bool]:
    """The round's d from the ranks' v (collective): the fp32 mean, the lane mean or the scatter mean by hand
    (``owner``: the latter's owner residual, updated), or the exact reference vote (lioncub.majority_vote,
    checked against hand votes in tests/test_vote.py)."""
    if cfg["vote"] == "grad":
        total = v.clone()
        dist.all_reduce(total)
        return total / world, False
    if cfg.get("aggregate") == "mean" and cfg["vote"] == "onebit":
        return _scatter_mean_by_hand(v, sizes, world, cfg["bits"], owner), False
    if cfg.get("aggregate") == "mean":
        return _lane_mean_by_hand(v, sizes, world, cfg["bits"])[0], False
    return majority_vote(v.clone(), method=cfg["vote"], bits=cfg.get("bits"), quantizer=cfg.get("quantizer"),
                         step=rounds), True


def _outer_by_hand(outer: str, start: torch.Tensor, d: torch.Tensor, signed: bool, m: torch.Tensor) -> torch.Tensor:
    """θ_s's next value under the outer rule (docs/local_steps.md), on flat tensors; ``m`` (the rule's
    momentum) is updated in place. α and the rule's constants are OUTER's."""
    alpha, mu, (b1, b2) = OUTER[outer]["outer_lr"], 0.9, (0.9, 0.99)
    if outer == "sgd":
        return start.add(d, alpha=-alpha * LR if signed else -alpha)
    d = d * LR if signed else d
    if outer == "nesterov":  # b ← μ·b + d; θ_s ← θ_s − α·(d + μ·b)
        m.mul_(mu).add_(d)
        return start.add(d.add(m, alpha=mu), alpha=-alpha)
    c = m.mul(b1).add_(d, alpha=1 - b1)  # lion: c = β1·m + (1−β1)·d; θ_s ← θ_s − α·η·sign(c); m ← β2·m + (1−β2)·d
    m.mul_(b2).add_(d, alpha=1 - b2)
    return start.add(c.sign(), alpha=-alpha * LR)


OUTER = {"sgd": dict(outer_lr=ALPHA), "nesterov": dict(outer_lr=0.7, outer_momentum=0.9),
         "lion": dict(outer_lr=4.0, outer_betas=(0.9, 0.99))}


def _rounds_by_hand(rank, world, delay: int, outer: str, names, nan_step: int = -1, eager: bool = False):
    """Per aggregation of ``names``, at each round's end: (θ_s equals the outer rule by hand applied to
    the agreed d of this round's v (delay=0) or of the previous round's (delay=1); θ_i equals θ_s
    (delay=0), θ_s − Δ_i (delay=1, rebased) or, after a skipped round, θ_s; θ_s identical on every
    rank; the residual e_i equals v_i − C(v_i) by hand (the means, sign_allreduce) or, after a skipped
    round, the one before it, and the scatter mean's owner residual its r by hand (None: not checked); max
    |d − float64 mean Δ| for 'grad'). ``nan_step``:
    rank 1's gradient is NaN there, which skips that inner step on rank 1 and the round on every rank
    (nonfinite='skip_round'). ``eager``: θ_i is the outer rule's step from θ_s by Δ_i instead of θ_s − Δ_i,
    on a copy of the rule's momentum."""
    H, out = 2, {}
    for name in names:
        cfg = AGGREGATIONS[name]
        params = _params()
        sizes = [p.numel() for p in params]
        opt = LocalCub(params, lr=LR, local_steps=H, inner=_sgd, outer=outer, delay=delay, nonfinite="skip_round",
                       eager=eager, **OUTER[outer], **cfg)
        m = torch.zeros(sum(sizes))  # the outer rule's momentum, by hand
        owner = torch.zeros(sum(sizes))  # the scatter mean's owner residual, by hand (its span: the first E)
        flight, checks = None, []  # flight: (v, Δ, rounds) of the round in flight (delay=1)
        began = _flat(params)  # where this worker's round began
        for step in range(4 * H):
            grads = _grads(params, rank, step)
            if step == nan_step and rank == 1:
                grads[0][0, 0] = float("nan")
            for p, g in zip(params, grads):
                p.grad = g
            ends = (step + 1) % H == 0
            if ends:  # this round's v, from the inner SGD step the optimizer is about to take (or skips)
                after = _flat(params) if step == nan_step and rank == 1 else \
                    _flat([p.detach().add(g, alpha=-LR) for p, g in zip(params, grads)])
                delta = began - after
                e = _flat(opt.state[p]["residual"] for p in params) if opt.error_feedback else None
                v = delta + e if e is not None else delta.clone()
                start = _flat(opt.state[p]["start"] for p in params)
            opt.step()
            if not ends:
                continue
            skipped = step // H == nan_step // H
            new_start = _flat(opt.state[p]["start"] for p in params)
            applied = v if delay == 0 else (flight[0] if flight is not None else None)
            if applied is not None and not (delay == 0 and skipped):
                d, signed = _agreed_d(cfg, applied, sizes, opt.rounds - 1, world, owner)
                expected = _outer_by_hand(outer, start, d, signed, m)
            else:
                d, expected = None, start
            if skipped or delay == 0:
                want = expected  # every replica at θ_s
            elif eager:  # the rule's step by this worker's own Δ_i stands in (θ_s and m stay)
                want = _outer_by_hand(outer, expected, delta, False, m.clone())
            else:
                want = expected - delta if flight is not None else after  # rebased; or its own progress
            # e_i ← v_i − C(v_i) when the round launched its agreement; a skipped round leaves e_i as it was
            sent = None if e is None or skipped else _sent_by_hand(cfg, v, sizes, world)
            want_e = e if skipped else None if sent is None else v - sent
            kept = None if want_e is None else torch.equal(_flat(opt.state[p]["residual"] for p in params), want_e)
            if name == "scatter":  # the owner's residual r of its span: every round applied so far, by hand
                r = opt.owner_residuals[0]
                kept = kept is not False and torch.equal(r, owner[:r.numel()])
            err64 = None
            if name == "grad" and d is not None:
                mine = (v if delay == 0 else flight[1]).double()
                everyone = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(everyone, mine)
                err64 = float((d.double() - torch.stack(everyone).mean(0)).abs().max())
            sums = new_start.double().sum().reshape(1)
            all_sums = [torch.empty_like(sums) for _ in range(world)]
            dist.all_gather(all_sums, sums)
            checks.append((torch.equal(new_start, expected), torch.equal(_flat(params), want),
                           all(torch.equal(x, all_sums[0]) for x in all_sums), kept, err64))
            flight = (v, delta, opt.rounds) if delay == 1 and not skipped else None
            began = _flat(params)
        out[name] = (checks, opt.rounds, opt.skipped_rounds)
    return out


def _check(res, rounds: int, skipped: int = 0) -> None:
    for name, (checks, n, skips) in res.items():
        assert (n, skips, len(checks)) == (rounds, skipped, 4), name
        for k, (same_d, placed, identical, kept, err64) in enumerate(checks):
            assert same_d, f"{name}, round {k}: θ_s is not the outer rule by hand on the agreed d"
            assert placed, f"{name}, round {k}: θ_i is not where the rule puts it"
            assert identical, f"{name}, round {k}: θ_s differs between ranks"
            # the residual by hand: every round of the mean and sign_allreduce, a skipped round of any
            assert kept if name in ("mean", "vote", "scatter") else kept is not False, \
                f"{name}, round {k}: the residual is not v − C(v) by hand (or not kept on a skip)"
            if err64 is not None:  # fp32 mean of 3 ranks' Δ (|Δ| ~ 2·2^-6) against float64: a few ulps
                assert err64 < 1e-6, err64


def test_each_round_applies_the_blocking_agreement_one_round_late_and_rebases_the_round_in_flight():
    for res in run_workers(_rounds_by_hand, 3, 1, "sgd", list(AGGREGATIONS)):
        _check(res, rounds=3)  # 4 rounds: 3 applied, 1 in flight


def test_delay_zero_applies_each_rounds_own_agreement_by_hand():
    for res in run_workers(_rounds_by_hand, 3, 0, "sgd", list(AGGREGATIONS)):
        _check(res, rounds=4)


@pytest.mark.parametrize("delay", [0, 1])
def test_nesterov_and_lion_outer_rules_by_hand_under_each_delay(delay):
    for outer, names in (("nesterov", ["grad", "mean", "scatter"]), ("lion", ["mean", "vote"])):
        for res in run_workers(_rounds_by_hand, 3, delay, outer, names):
            _check(res, rounds=4 - delay)


@pytest.mark.parametrize("outer", ["nesterov", "lion"])  # (sgd with α = 1: the stand-in is the rebase itself)
def test_eager_stand_ins_put_the_rules_step_by_the_own_delta_in_flight_by_hand(outer):
    """``eager=True``: at each round's end θ_i ← outer(θ_s, Δ_i) on a copy of the rule's state; θ_s and the
    rule's momentum follow the agreed d exactly as without it (a skipped round too)."""
    for res in run_workers(_rounds_by_hand, 3, 1, outer, ["grad", "mean", "scatter"], -1, True):
        _check(res, rounds=3)
    for res in run_workers(_rounds_by_hand, 3, 1, outer, ["mean", "scatter"], 2, True):
        _check(res, rounds=2, skipped=1)


@pytest.mark.parametrize("delay", [0, 1])
def test_a_nonfinite_round_is_skipped_on_every_rank_by_hand(delay):
    """Rank 1's NaN at the first inner step of round 1: that inner step is skipped on rank 1, the round on
    every rank (θ_i ← θ_s; with delay=1 the agreement in flight is applied first and nothing is launched,
    so round 2 applies nothing and round 3 applies round 2's)."""
    for res in run_workers(_rounds_by_hand, 3, delay, "sgd", ["grad", "mean", "scatter"], 2):
        _check(res, rounds=3 if delay == 0 else 2, skipped=1)


# ------------------------------------------------------------------ error feedback by hand
def _ef_streaming(rank, world):
    # params at 0, inner SGD with lr 1, H = 1: Δ = g exactly (round 0 from 0, round 1 from o_i = −g0)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = LocalCub([p], lr=1.0, local_steps=1, inner=_sgd, vote="sign_allreduce", error_feedback=True,
                   outer="sgd", outer_lr=1.0, delay=1)
    p.grad = torch.tensor([0.25, -0.125, 0.5, -0.125]) if rank == 0 else torch.tensor([-0.5, 0.25, 0.25, 0.5])
    opt.step()
    first = (opt.state[p]["residual"].clone(), opt.state[p]["start"].clone(), p.detach().clone())
    p.grad = torch.tensor([0.5, 0.5, -0.25, 0.0]) if rank == 0 else torch.zeros(4)
    opt.step()
    return first, (opt.state[p]["residual"].clone(), opt.state[p]["start"].clone(), p.detach().clone())


def test_error_feedback_residuals_of_two_streaming_rounds_by_hand():
    (rank0_round0, rank0_round1), (rank1_round0, rank1_round1) = run_workers(_ef_streaming, 2)
    (e00, s00, p00), (e01, s01, p01) = rank0_round0, rank0_round1
    (e10, s10, p10), (e11, s11, p11) = rank1_round0, rank1_round1
    # round 0: v = Δ = g; e = v − mean|v|·sign(v), mean|v| = 0.25 (rank 0), 0.375 (rank 1); nothing applied yet
    assert torch.equal(e00, torch.tensor([0.0, 0.125, 0.25, 0.125]))
    assert torch.equal(e10, torch.tensor([-0.125, -0.125, -0.125, 0.125]))
    assert torch.equal(s00, torch.zeros(4)) and torch.equal(s10, torch.zeros(4))
    assert torch.equal(p00, -torch.tensor([0.25, -0.125, 0.5, -0.125]))  # θ_i = −g_i, its own progress
    assert torch.equal(p10, -torch.tensor([-0.5, 0.25, 0.25, 0.5]))
    # round 1: v = g1 + e. Rank 0: [.5, .625, 0, .125], mean|v| = .3125 -> e = [.1875, .3125, 0, −.1875];
    # rank 1: v = e, mean|v| = .125 -> e = 0
    assert torch.equal(e01, torch.tensor([0.1875, 0.3125, 0.0, -0.1875]))
    assert torch.equal(e11, torch.zeros(4))
    # round 0's vote applied at round 1's end: u = sign(sign v_0 + sign v_1) = [0, 0, 1, 0]; θ_s = −1·1·u
    want_start = torch.tensor([0.0, 0.0, -1.0, 0.0])
    assert torch.equal(s01, want_start) and torch.equal(s11, want_start)
    # the rebase: θ_i = θ_s − Δ_i of round 1 (Δ_i = g1)
    assert torch.equal(p01, want_start - torch.tensor([0.5, 0.5, -0.25, 0.0]))
    assert torch.equal(p11, want_start)


# ------------------------------------------------------------------ resume mid-round and mid-flight
RESUME_CONFIGS = [
    dict(vote="grad", outer="nesterov", outer_lr=0.7, inner="adamw"),
    dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True, outer="nesterov", outer_lr=0.7),
    dict(vote="pbit", outer="sgd", outer_lr=3.0, error_feedback=True),
    dict(vote="sign_allreduce", outer="lion", outer_lr=4.0),
    dict(vote="onebit", aggregate="mean", bits=4, error_feedback=True, outer="nesterov", outer_lr=0.7, eager=True),
]


def in_flight(opt) -> str | None:
    """What of a streaming round ``opt`` holds unapplied: ``'verdict'`` (a fragment's finite check and head in
    flight, its exchange not launched yet), ``'exchange'`` (an exchange launched, a collective of it not yet read),
    ``'agreed'`` (the exchange read between steps, its outer step not yet taken: :meth:`Agreement.advance`), or
    None (nothing)."""
    if opt._agreeing is not None:
        return "verdict"
    if opt._pending is None:
        return None
    return "exchange" if any(a.d is None for a in opt._pending) else "agreed"


def _resume(rank, world, configs=RESUME_CONFIGS, H: int = 3, steps: int = 11, saves=(4, 5)):
    """Per configuration: a run of ``steps`` streaming steps (H = ``H``) saved after each step of ``saves``, each
    checkpoint resumed to the end; (cfg, {step: (what was in flight when saved: :func:`in_flight`, the resumed
    run's parameters equal the uninterrupted run's)}, rounds, θ_s identical on every rank after every step, owner
    residuals kept)."""
    out = []
    for cfg in configs:
        params = _params(seed=rank)  # different starts: the broadcast aligns them
        opt = LocalCub(params, lr=1e-2, weight_decay=0.1, local_steps=H, check_every=1, delay=1, **cfg)
        saved, identical = {}, True
        for step in range(steps):
            for p, g in zip(params, _grads(params, rank, step)):
                p.grad = g
            opt.step()
            starts = _flat(opt.state[p]["start"] for p in params)
            everyone = [torch.empty_like(starts) for _ in range(world)]
            dist.all_gather(everyone, starts)
            identical &= all(torch.equal(x, everyone[0]) for x in everyone)
            if step in saves:
                flying = in_flight(opt)  # (before state_dict, which reads a verdict and waits for the exchange)
                saved[step] = (copy.deepcopy(opt.state_dict()), flying)
        opt.flush()
        final = [p.detach().clone() for p in params]
        resumed = {}
        for at, (sd, flying) in saved.items():
            params2 = _params(seed=rank)
            opt2 = LocalCub(params2, lr=1e-2, weight_decay=0.1, local_steps=H, check_every=1, delay=1, **cfg)
            opt2.load_state_dict(sd)
            for step in range(at + 1, steps):
                for p, g in zip(params2, _grads(params2, rank, step)):
                    p.grad = g
                opt2.step()
            opt2.flush()
            resumed[at] = (flying, all(torch.equal(a, b) for a, b in zip(final, params2)))
        out.append((cfg, resumed, opt.rounds, identical, bool(opt.owner_residuals)))
    return out


def test_resume_mid_round_and_mid_flight_is_bit_exact():
    # step 4: mid-round; 5: a round's end, its agreement just launched; step 11 ends no round (flush: each replica
    # keeps its 2 steps of progress on the new θ_s)
    for res in run_workers(_resume, 3):
        for cfg, resumed, rounds, identical, _ in res:
            assert rounds == 3 and identical, cfg  # 3 round ends, each applied (the last by flush)
            for at, (_, same) in resumed.items():
                assert same, f"resumed from step {at} differs for {cfg}"
            # step 5: the round's exchange just launched (read only from the next step on); step 4: round 1's
            # exchange launched at step 2, read or not by now, its outer step not yet taken
            assert resumed[5][0] == "exchange", f"the save at a round's end had no exchange in flight: {resumed[5]}"
            assert resumed[4][0] in ("exchange", "agreed"), f"the save mid-round had no round in flight: {resumed[4]}"


def _flush_syncs(rank, world):
    params = _params()
    opt = LocalCub(params, lr=1e-2, local_steps=2, vote="grad", outer="nesterov", delay=1)
    for step in range(4):
        for p, g in zip(params, _grads(params, rank, step)):
            p.grad = g
        opt.step()
    differ = not all(torch.equal(p, opt.state[p]["start"]) for p in params)
    opt.flush()
    return differ, _flat(params), all(torch.equal(p, opt.state[p]["start"]) for p in params), opt.rounds


def test_flush_at_a_rounds_end_leaves_every_replica_at_the_agreed_start():
    (d0, p0, at0, r0), (d1, p1, at1, r1) = run_workers(_flush_syncs, 2)
    assert d0 and d1  # before: each replica is θ_s plus its own round in flight
    assert at0 and at1 and torch.equal(p0, p1) and r0 == r1 == 2


# ------------------------------------------------------------------ one process, bad input
def test_one_process_streams_without_a_process_group():
    params = _params()
    opt = LocalCub(params, lr=1e-2, local_steps=2, vote="pbit", bits=8, quantizer="l1", aggregate="mean", delay=1)
    for step in range(6):
        for p, g in zip(params, _grads(params, 0, step)):
            p.grad = g
        opt.step()
    assert opt.rounds == 2 and opt._pending is not None


@pytest.mark.parametrize("kw, match", [
    (dict(delay=2), r"delay \(rounds an outer step is applied late\) must be an int in \[0, 1\], got 2"),
    (dict(delay=True, vote="grad"), "delay .* must be an int in"),
    (dict(delay=1, vote="onebit"), r"delay=1 keeps the round's exchange in flight: vote must be 'grad', one of"),
    (dict(delay=1, vote="gather"), "got vote='gather'"),
    (dict(delay=1, vote="auto"), "delay=1 needs a fixed vote"),
    (dict(vote="grad", eager=True), "eager=True stands in for an agreement in flight: it needs delay=1"),
    (dict(delay=1, vote="sign_allreduce", eager=True), r"eager=True .* needs a mean .*got SignVote\(transport='sign_allreduce'"),
])
def test_bad_streaming_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        LocalCub(_params(), **kw)


def test_eager_must_be_a_bool():
    with pytest.raises(TypeError, match="eager must be"):
        LocalCub(_params(), delay=1, vote="grad", eager=1)


def test_a_checkpoint_of_the_other_delay_is_refused():
    a = LocalCub(_params(), local_steps=2, vote="grad", delay=1)
    b = LocalCub(_params(), local_steps=2, vote="grad")
    with pytest.raises(ValueError, match="delay=1"):
        b.load_state_dict(a.state_dict())


# ------------------------------------------------------------------ lioncub train --delay 1
@pytest.mark.slow  # ~20 s: two 2-worker runs of gpt-tiny
def test_lioncub_train_streams_rounds_and_resumes_mid_flight_bit_for_bit(tmp_path, corpus_cache):
    """--local-steps 2 --delay 1: the first round's end sends the first bytes, evaluations run on
    θ_s, and a run resumed from the checkpoint at step 4 (a round's end, its agreement in flight)
    reproduces the uninterrupted one's losses."""
    from tests.test_harness_train import TINY, _losses, _resumed_from, lioncub, read_csv, read_jsonl

    common = [*TINY, "--vote", "pbit", "--bits", "8", "--quantizer", "l1", "--local-steps", "2", "--inner", "adamw",
              "--aggregate", "mean", "--error-feedback", "--outer-lr", "0.7", "--delay", "1", "--steps", "8",
              "--eval-every", "2", "--check-every", "1", "--nproc", "2", "--cache-dir", str(corpus_cache)]
    full = tmp_path / "full"
    lioncub("train", *common, "--ckpt-every", "4", "--out", str(full))
    records = read_jsonl(full / "metrics.jsonl")
    assert [r["bytes_sent"] > 0 for r in records if r["kind"] == "step"] == [False, True] * 4
    assert read_csv(full / "summary.csv")[0]["label"] == "lioncub-pbit-8b-l1-h2-mean-streaming"
    assert _resumed_from(full, 4, tmp_path / "resumed", common) == _losses(records)
