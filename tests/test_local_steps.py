"""LocalCub: local steps under the vote, on real gloo groups (2-3 workers)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lioncub import Lion
from tests.flat import LionCub, LocalCub
from lioncub.optim.localcub import MEAN_CLIP
from lioncub.votes.rounds import sent_value
from lioncub import votes
from lioncub.votes.api import pbit_levels
from tests.dist import run_workers

SHAPES = [(7, 5), (13,), (3, 3, 3)]  # odd sizes: bits do not fill whole bytes


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _set_grads(params, rank: int, step: int) -> None:
    """Each rank its own gradients; Gaussian, so no exact zeros."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


# ------------------------------------------------------------------ H = 1 is LionCub
VOTES_H1 = [("onebit", {}), ("gather", {}), ("sign_allreduce", {}), ("pbit", {})]


def _h1_equals_lioncub(rank, world):
    out = {}
    for vote, kw in VOTES_H1:
        for wd in (0.0, 0.5):
            a, b = _params(), _params()
            cub = LionCub(a, lr=1e-2, weight_decay=wd, vote=vote, **kw)
            loc = LocalCub(b, lr=1e-2, weight_decay=wd, local_steps=1, vote=vote, outer="sgd", outer_lr=1.0, **kw)
            for step in range(5):
                _set_grads(a, rank, step)
                _set_grads(b, rank, step)
                cub.step()
                loc.step()
                assert loc.synced
            same_p = all(torch.equal(x, y) for x, y in zip(a, b))
            same_m = all(torch.equal(cub.state[x]["exp_avg"], loc.inner.state[y]["exp_avg"]) for x, y in zip(a, b))
            moved = not all(torch.equal(x, y) for x, y in zip(a, _params()))
            out[(vote, wd)] = (same_p, same_m, moved)
    return out


def test_one_local_step_with_a_sign_outer_step_is_lioncub_bit_for_bit():
    # H=1: Δ_i = θ − (θ − η·sign(c_i)) has the sign of c_i (η·1 is far above half an ulp of θ
    # here), so every binary vote sees the same signs, zeros (none: Gaussian gradients) and
    # step parity as LionCub's; outer_lr=1 applies u with LionCub's own p.add_(u, alpha=-lr).
    for res in run_workers(_h1_equals_lioncub, 3):
        for key, (same_p, same_m, moved) in res.items():
            assert moved, key
            assert same_p, f"params differ from LionCub for {key}"
            assert same_m, f"momenta differ from LionCub for {key}"


# ------------------------------------------------------------------ vote='grad' averages Δ
def _grad_vote_is_the_mean(rank, world):
    H, lr = 3, 1e-2
    params = _params()
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    start = [p.detach().clone() for p in params]
    opt = LocalCub(params, lr=lr, local_steps=H, vote="grad", outer="sgd", outer_lr=0.7)
    inner_ref = Lion(ref, lr=lr)  # what each rank's inner loop does, run beside it
    for step in range(H):
        _set_grads(params, rank, step)
        _set_grads(ref, rank, step)
        opt.step()
        inner_ref.step()
    delta = torch.cat([(s.double() - r.detach().double()).reshape(-1) for s, r in zip(start, ref)])
    everyone = [torch.empty_like(delta) for _ in range(world)]
    dist.all_gather(everyone, delta)
    mean = torch.stack(everyone).mean(0)  # float64
    expected = torch.cat([s.double().reshape(-1) for s in start]) - 0.7 * mean
    got = torch.cat([p.detach().double().reshape(-1) for p in params])
    return float((got - expected).abs().max()), float(mean.abs().max())


def test_grad_vote_applies_the_float64_mean_of_the_pseudo_gradients():
    for err, scale in run_workers(_grad_vote_is_the_mean, 3):
        assert scale > 1e-3  # the round moved the parameters
        # fp32: Δ formed and summed in fp32 (3 ranks), θ ~ N(0,1): a few ulps of 1 at most
        assert err < 1e-6, err


# ------------------------------------------------------------------ error feedback
def _ef_hand_case(rank, world):
    # params start at 0 and the inner step is SGD with lr 1, so Δ = 0 − (0 − g) = g exactly
    p = torch.nn.Parameter(torch.zeros(4))
    opt = LocalCub([p], lr=1.0, local_steps=1, inner=lambda groups: torch.optim.SGD(groups), vote="onebit",
                   error_feedback=True, outer="sgd", outer_lr=1.0)
    p.grad = torch.tensor([0.25, -0.125, 0.5, -0.125]) if rank == 0 else torch.tensor([-0.5, 0.25, 0.25, 0.5])
    opt.step()
    first = opt.state[p]["residual"].clone()
    # second round: v = Δ + e, its residual again v − mean|v|·sign(v)
    p.grad = torch.tensor([0.5, 0.5, -0.25, 0.0]) if rank == 0 else torch.tensor([0.0, 0.0, 0.0, 0.0])
    start = opt.state[p]["start"].clone()
    opt.step()
    return first, start, opt.state[p]["residual"].clone()


def test_error_feedback_residual_is_what_was_meant_minus_what_was_sent():
    r0, r1 = run_workers(_ef_hand_case, 2)
    # rank 0: v = [.25, -.125, .5, -.125], mean|v| = 0.25, sent = [.25, -.25, .25, -.25]
    assert torch.equal(r0[0], torch.tensor([0.0, 0.125, 0.25, 0.125]))
    # rank 1: v = [-.5, .25, .25, .5], mean|v| = 0.375, sent = ±0.375
    assert torch.equal(r1[0], torch.tensor([-0.125, -0.125, -0.125, 0.125]))
    # round 2, rank 1: Δ = 0 exactly, v = e = [-.125, -.125, -.125, .125], mean|v| = .125 -> e = 0
    assert torch.equal(r1[2], torch.zeros(4))
    # round 2, rank 0: v = [.5, .625, .0, .125], mean|v| = 0.3125; sign(0) = 0 sends nothing
    assert torch.equal(r0[2], torch.tensor([0.1875, 0.3125, 0.0, -0.1875]))


def test_sent_value_of_a_quantized_vote_is_the_dequantized_message():
    # 3 workers in 8-bit lanes: s = floor(255 / 6) = 42 levels. L1: M = mean|v| = 3.9 / 5 = 0.78,
    # q = clamp(round(42·v / M), ±42) = [16, -5, 0, 42, -42]; sent = q·M/42 (the top two clipped at M)
    v = torch.tensor([0.3, -0.1, 0.0, 2.0, -1.5])
    sent = sent_value(v, [5], votes.make("pbit", 3, bits=8, quantizer="l1"))
    expected = torch.tensor([16.0, -5.0, 0.0, 42.0, -42.0]) * (0.78 / 42)
    assert torch.allclose(sent, expected, rtol=1e-6, atol=0)
    # binary votes: the sign scaled by mean|v| of each tensor (here two tensors of 2 and 3)
    sent = sent_value(v, [2, 3], votes.make("onebit", 3))
    assert torch.allclose(sent, torch.tensor([0.2, -0.2, 0.0, 3.5 / 3, -3.5 / 3]), rtol=1e-6, atol=0)


# ------------------------------------------------------------------ the outer rules by hand
# Two ranks, two rounds of H = 2 inner SGD steps (lr η, so Δ_i = η·(g_a + g_b) exactly). Every
# number is dyadic (θ0 in quarters, g in halves, η = 1/4, α = 2, λ = 1/2, μ = 1/2, β = (3/4, 1/2)),
# so each product and sum below is exact in fp32 and the expected θ is exact whatever the op
# order: the check is torch.equal. β1·(2 - β2) > 1, so the lion rule's momentum overturns a
# vote that reverses (c2 = β1(1-β2)·d1 + (1-β1)·d2 has the sign of d1 when d2 = -d1), which
# the default betas (0.9, 0.99) would not: non-default betas change θ.
OUTER_THETA0 = [1.0, -0.5, 0.25, 2.0, -1.0, 0.75, 1.5, -2.0]
OUTER_GRADS = {  # [rank][inner step]: round 1 is steps 0-1, round 2 steps 2-3
    0: [[1.0, 0.5, -1.0, 0.5, 0.0, 1.0, -0.5, 1.0], [0.5, 0.0, -0.5, 0.5, 0.5, 0.5, -0.5, 0.5],
        [-1.0, 0.5, 1.0, 0.0, 0.5, -1.0, 0.5, 1.0], [-0.5, 0.5, 0.5, 0.0, 0.0, -0.5, 1.0, 0.0]],
    1: [[0.5, -1.0, -0.5, 1.0, 0.5, 0.5, -1.0, 0.5], [0.5, -0.5, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0],
        [-0.5, 1.0, 0.5, -1.0, 1.0, -0.5, 1.0, -1.0], [-1.0, 0.0, 0.5, -0.5, 0.5, -1.0, 0.5, -0.5]],
}
OUTER_HP = dict(lr=0.25, weight_decay=0.5, outer_lr=2.0, outer_momentum=0.5, outer_betas=(0.75, 0.5))


def _outer_rounds(rank, world):
    out = {}
    for outer in ("nesterov", "lion"):
        for vote in ("sign_allreduce", "grad"):
            p = torch.nn.Parameter(torch.tensor(OUTER_THETA0))
            opt = LocalCub([p], local_steps=2, inner=lambda groups: torch.optim.SGD(groups), vote=vote,
                           outer=outer, **OUTER_HP)
            for step in range(4):
                p.grad = torch.tensor(OUTER_GRADS[rank][step])
                opt.step()
                assert opt.synced == (step % 2 == 1)
            out[outer, vote] = (p.detach().clone(), opt.state[p]["outer_m"].clone(), opt.rounds)
    return out


def _outer_by_hand(outer, vote):
    """θ and the outer momentum after two rounds, from the module docstring's rules."""
    eta, lam, alpha = OUTER_HP["lr"], OUTER_HP["weight_decay"], OUTER_HP["outer_lr"]
    mu, (b1, b2) = OUTER_HP["outer_momentum"], OUTER_HP["outer_betas"]
    theta, m = torch.tensor(OUTER_THETA0), torch.zeros(len(OUTER_THETA0))
    ds = []
    for r in range(2):
        deltas = [eta * (torch.tensor(OUTER_GRADS[i][2 * r]) + torch.tensor(OUTER_GRADS[i][2 * r + 1]))
                  for i in range(2)]  # Δ_i = θ_s − θ_i after two SGD steps of lr η
        if vote == "grad":
            d = (deltas[0] + deltas[1]) / 2  # the mean Δ
        else:
            d = eta * torch.sign(torch.sign(deltas[0]) + torch.sign(deltas[1]))  # η·u, 2 voters: a tie is 0
        ds.append(d)
        theta = theta * (1 - alpha * eta * lam)
        if outer == "nesterov":
            m = mu * m + d
            theta = theta - alpha * (d + mu * m)
        else:
            c = b1 * m + (1 - b1) * d
            theta = theta - alpha * eta * torch.sign(c)
            m = b2 * m + (1 - b2) * d
    return theta, m, ds


def test_nesterov_and_lion_outer_rules_by_hand_with_their_own_momentum_and_betas():
    res = run_workers(_outer_rounds, 2)
    for (outer, vote), (theta, m, rounds) in res[0].items():
        want_theta, want_m, (d1, d2) = _outer_by_hand(outer, vote)
        assert rounds == 2
        assert torch.equal(theta, want_theta), (outer, vote, theta, want_theta)
        assert torch.equal(m, want_m), (outer, vote, m, want_m)
        assert torch.equal(res[1][outer, vote][0], theta)  # replicas identical
        if vote == "sign_allreduce":  # the case covers a tie, a reversal and a kept direction
            assert (d1 == 0).any() and ((d1 * d2) < 0).any() and ((d1 * d2) > 0).any(), (d1, d2)


# ------------------------------------------------------------------ replicas and resume
CONFIGS = [
    dict(vote="onebit", outer="sgd", outer_lr=3.0),
    dict(vote="onebit", outer="nesterov", outer_lr=2.0, error_feedback=True),
    dict(vote="gather", outer="lion", outer_lr=4.0, error_feedback=True),
    dict(vote="sign_allreduce", outer="nesterov", outer_lr=2.0),
    dict(vote="pbit", outer="sgd", outer_lr=3.0, error_feedback=True),
    dict(vote="pbit", quantizer="l1", bits=8, outer="nesterov", outer_lr=2.0, error_feedback=True),
    dict(vote="grad", outer="nesterov", outer_lr=0.7, inner="adamw"),
    # stochastic rounding from the optimizer's own generator, saved with it: resumes bit for bit
    dict(vote="pbit", quantizer="linf", bits=4, outer="sgd", outer_lr=3.0, seed=7),
    dict(vote="onebit", outer="sgd", outer_lr=3.0, tie="plus"),
]


def _checksums(params):
    return torch.stack([p.detach().double().sum() for p in params] + [p.detach().double().abs().sum() for p in params])


def _replicas_and_resume(rank, world):
    out = []
    for cfg in CONFIGS:
        params = _params(seed=rank)  # different starts: the broadcast must align them
        opt = LocalCub(params, lr=1e-2, weight_decay=0.1, local_steps=3, check_every=1, **cfg)
        agree, saved = [], None
        for step in range(11):
            _set_grads(params, rank, step)
            opt.step()
            if step == 4:  # mid-round: local_step == 2
                saved = (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in params])  # as on disk
            if opt.synced:
                sums = _checksums(params)
                everyone = [torch.empty_like(sums) for _ in range(world)]
                dist.all_gather(everyone, sums)
                agree.append(all(torch.equal(e, everyone[0]) for e in everyone))
        final = [p.detach().clone() for p in params]
        # resume from the mid-round checkpoint in a fresh optimizer and continue
        sd, values = saved
        params2 = _params(seed=rank)
        opt2 = LocalCub(params2, lr=1e-2, weight_decay=0.1, local_steps=3, check_every=1, **cfg)
        opt2.load_state_dict(sd)  # restores this rank's own mid-round parameters too
        assert all(torch.equal(p, v) for p, v in zip(params2, values))
        for step in range(5, 11):
            _set_grads(params2, rank, step)
            opt2.step()
        resumed = all(torch.equal(a, b) for a, b in zip(final, params2))
        drifted = not all(torch.equal(a, b) for a, b in zip(final, saved[1]))
        out.append((cfg, agree, resumed, drifted, opt.rounds))
    return out


def test_replicas_identical_after_every_outer_step_and_resume_is_bit_exact():
    for res in run_workers(_replicas_and_resume, 3):
        for cfg, agree, resumed, drifted, rounds in res:
            assert rounds == 3 and agree == [True] * 3, cfg
            assert drifted, cfg
            assert resumed, f"resumed run differs for {cfg}"


def _nonfinite_round(rank, world):
    params = _params()
    opt = LocalCub(params, lr=1e-2, local_steps=2, vote="onebit", nonfinite="skip_round")
    _set_grads(params, rank, 0)
    opt.step()
    _set_grads(params, rank, 1)
    if rank == 1:
        params[0].grad[0, 0] = float("nan")
    opt.step()
    start_equal = all(torch.equal(p, opt.state[p]["start"]) for p in params)
    raised = None
    opt2 = LocalCub(_params(), lr=1e-2, local_steps=1, vote="onebit")
    for p in opt2.params:
        p.grad = torch.full_like(p, float("nan")) if rank == 0 else torch.ones_like(p)
    try:
        opt2.step()
    except FloatingPointError as e:
        raised = str(e)
    return opt.skipped_rounds, opt.rounds, start_equal, raised


def test_a_nonfinite_round_is_skipped_or_raised_on_every_rank():
    for skipped, rounds, start_equal, raised in run_workers(_nonfinite_round, 2):
        assert (skipped, rounds, start_equal) == (1, 0, True)
        assert raised is not None and "1 rank(s)" in raised


# ------------------------------------------------------------------ one process, bad input
def test_world_of_one_runs_without_a_process_group_and_matches_lion():
    a, b = _params(), _params()
    lion = Lion(a, lr=1e-2)
    loc = LocalCub(b, lr=1e-2, local_steps=1, vote="onebit", outer="sgd", outer_lr=1.0)
    for step in range(4):
        _set_grads(a, 0, step)
        _set_grads(b, 0, step)
        lion.step()
        loc.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kw, match", [
    (dict(local_steps=0), "local_steps must be an int >= 1"),
    (dict(local_steps=2.5), "local_steps must be an int >= 1"),
    (dict(outer="adam"), "Outer.rule must be one of"),
    (dict(outer_lr=0.0), "Outer.lr must be a number > 0"),
    (dict(outer_momentum=1.0), "Outer.momentum must be in"),
    (dict(vote="majority"), "SignVote.transport must be one of"),
    (dict(vote="onebit", alpha=1e-4, beta=1e-9), "apply to vote='auto' only"),
    (dict(vote="auto", alpha=1e-4), "give both alpha and beta"),
    (dict(vote="onebit", bits=4), "SignVote.bits is the lane width of transport='pbit'"),
    (dict(vote="grad", error_feedback=True), "error_feedback needs a compressed vote"),
    (dict(vote="pbit", quantizer="linf", error_feedback=True), "stochastic quantizer"),
    (dict(inner="sgd"), "inner must be one of"),
    (dict(aggregate="sum"), "aggregate must be one of"),
    (dict(vote="gather", aggregate="mean"), "aggregate='mean' needs vote='pbit' with quantizer='l1' or vote='onebit'"),
    (dict(vote="onebit", aggregate="mean"), "needs error_feedback=True"),
    (dict(nonfinite="ignore"), "nonfinite must be one of"),
    (dict(lr=-1.0), "lr"),
])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        LocalCub(_params(), **kw)


def test_a_checkpoint_of_another_configuration_is_refused():
    a = LocalCub(_params(), local_steps=2, vote="onebit")
    b = LocalCub(_params(), local_steps=3, vote="onebit")
    with pytest.raises(ValueError, match="local_steps=2"):
        b.load_state_dict(a.state_dict())


# ------------------------------------------------------------------ aggregate='mean': lanes as a quantized mean
def _lane_mean(rank, world, bits):
    # params at 0 and inner SGD with lr 1: Δ = g exactly; element 0 saturates every rank's lane at +s,
    # element 1 at -s (the lane sums reach their extremes 0 and P·2s without a carry); the second
    # tensor is 1000x smaller: its own scale keeps it from rounding to 0
    g = torch.Generator().manual_seed(50 + rank)
    grads = [torch.randn(37, generator=g), 1e-3 * torch.randn(11, generator=g)]
    grads[0][0], grads[0][1] = 100.0, -100.0
    ps = [torch.nn.Parameter(torch.zeros(37)), torch.nn.Parameter(torch.zeros(11))]
    opt = LocalCub(ps, lr=1.0, local_steps=1, inner=lambda groups: torch.optim.SGD(groups), vote="pbit", bits=bits,
                   quantizer="l1", aggregate="mean", error_feedback=True, outer="sgd", outer_lr=1.0)
    for p, grad in zip(ps, grads):
        p.grad = grad.clone()
    opt.step()
    out = []
    for p, grad in zip(ps, grads):
        everyone = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(everyone, grad)
        out.append((everyone, p.detach().clone(), opt.state[p]["residual"].clone()))
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_mean_aggregate_applies_the_exact_sum_of_quantized_lanes(bits):
    world = 3
    res = run_workers(_lane_mean, world, bits)
    _, levels = pbit_levels(world, bits, "l1")
    for t in range(2):
        vs = res[0][t][0]
        norm = sum(float(v.abs().mean()) for v in vs) / world  # the tensor's shared L1 scale
        unit = norm * min(levels, MEAN_CLIP) / levels  # levels cover ±min(s, 4) mean magnitudes
        qs = [torch.round(v.double() / unit).clamp(-levels, levels) for v in vs]  # float64 reference
        assert sum(q.abs().sum() for q in qs) > 0  # the small tensor is not rounded away
        if t == 0:
            assert qs[0][0] == levels and qs[0][1] == -levels  # the saturated elements
        mean = sum(qs) * unit / world
        for r in range(world):
            param, residual = res[r][t][1], res[r][t][2]
            # θ_s = 0 − 1·d: d = the mean of the dequantized q_i (fp32 arithmetic: a few ulps)
            assert torch.allclose(-param.double(), mean, rtol=0, atol=1e-6 * norm), (r, t)
            assert torch.allclose(residual.double(), vs[r].double() - qs[r] * unit, rtol=0, atol=1e-6 * norm), (r, t)
            assert torch.equal(param, res[0][t][1])


# ------------------------------------------------------------------ vote='auto'
def _auto(rank, world):
    from lioncub.engine.auto import choose_vote

    params = _params()
    n = sum(p.numel() for p in params)
    picks = []
    for alpha, beta in ((1e-4, 8e-9), (1e-4, 8e-11), (5e-2, 1e-12)):  # slow link, fast link, latency-bound
        opt = LocalCub(params, lr=1e-2, local_steps=4, vote="auto", alpha=alpha, beta=beta)
        expected = choose_vote([n], world, alpha, beta)
        costs = opt.round_costs[opt.vote_chosen]
        picks.append((opt.vote_chosen, expected, costs["per_step_s"] * 4 == costs["total_s"]))
        sd = copy.deepcopy(opt.state_dict())
        again = LocalCub(params, lr=1e-2, local_steps=4, vote="auto", alpha=1e-4, beta=8e-9)  # may pick otherwise
        again.load_state_dict(sd)  # resumes with the saved run's pick
        picks.append((again.vote_chosen, opt.vote_chosen, True))
    for step in range(4):  # the picked vote trains
        _set_grads(params, rank, step)
        opt.step()
    return picks, opt.synced


def test_auto_picks_the_cheapest_vote_of_a_round_and_resumes_with_it():
    for picks, synced in run_workers(_auto, 3):
        assert synced
        for got, expected, priced in picks:
            assert got == expected and priced


def test_a_fused_adamw_inner_decides_a_non_finite_step_on_the_device():
    """An inner torch AdamW built with ``fused=True`` (what ``inner='adamw'`` builds on CUDA) takes the skip as its
    ``found_inf``: the same parameters, moments, step counts and skipped round as the host-read path through the same
    kernel, and no host read in any inner step (the round's end reads once)."""
    from unittest import mock

    from lioncub import fused

    def run(device_path: bool):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (37, 5)]
        opt = LocalCub(ps, lr=1e-2, local_steps=3, nonfinite="skip",
                       inner=lambda groups: torch.optim.AdamW(groups, fused=True))
        reads = []
        for step in range(9):  # rounds 0-2; a NaN in step 4 (round 1): that round is dropped
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 4:
                ps[0].grad[3] = float("nan")
            real_bool, real_item = torch.Tensor.__bool__, torch.Tensor.item
            with mock.patch.object(torch.Tensor, "__bool__", lambda t: (reads.append(step), real_bool(t))[1]), \
                    mock.patch.object(torch.Tensor, "item", lambda t: (reads.append(step), real_item(t))[1]), \
                    mock.patch.object(fused, "STEP_UNLESS", fused.STEP_UNLESS if device_path else ()):
                opt.step()
        return ps, opt, reads

    host_ps, host, host_reads = run(False)
    dev_ps, dev, dev_reads = run(True)
    assert host.skipped_rounds == dev.skipped_rounds == 1 and host.rounds == dev.rounds == 2
    state = lambda opt, ps: [opt.inner.state[p][k] for p in ps for k in ("exp_avg", "exp_avg_sq", "step")]
    assert all(torch.equal(a, b) for a, b in zip(dev_ps + state(dev, dev_ps), host_ps + state(host, host_ps)))
    assert dev.inner.state[dev_ps[0]]["step"].item() == 8  # 9 steps, the NaN one not counted
    inner_steps = [s for s in range(9) if (s + 1) % 3]
    assert all(s in host_reads for s in inner_steps)  # the host path reads every inner step's verdict
    assert not any(s in dev_reads for s in inner_steps)  # the device path reads none of them
    assert not hasattr(dev.inner, "found_inf")  # (torch's newer scaler contract sees nothing left behind)
