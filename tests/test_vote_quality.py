"""Issue 34's mechanisms on the 1-bit votes: worker-side error feedback and stochastic signs
(lioncub.votes.feedback), exact on real gloo groups: the residual plus the scaled sign sent is
v, the update is the majority of what the workers' messages say, the draws are the reference's,
the replicas stay identical, a resume is bit-exact, the bytes are the cost model's."""
import io
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from tests.flat import LionCub
from lioncub.aggregations import step_aggregation
from lioncub.engine.config import VoteConfig
from lioncub.engine.cost import predicted_bytes
from lioncub.engine.resume import reshard_states
from lioncub.votes.feedback import stochastic_sign_values
from tests.dist import run_workers

WORLD = 3  # an odd count: no tied vote, so onebit, gather and binary pbit vote alike
SHAPES = [(2, 2), (4,)]  # two tensors in one bucket: one scale each
LR, BETA1, BETA2 = 1.0, 0.5, 0.5  # dyadic: every value below is exact in fp32


def _grad(rank, step, shape):
    """Rank ``rank``'s gradient at ``step``: multiples of 1/4 in [−2, 2] (dyadic)."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + len(shape))
    return torch.randint(-8, 9, shape, generator=g).float() / 4


def _params():
    return [torch.nn.Parameter(torch.arange(n, dtype=torch.float32).reshape(s) / 8)
            for s, n in zip(SHAPES, (4, 4))]


def _all(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ----------------------------------------------------------------------------- the reference, by hand
def _sign(x, step):
    """The 1-bit sign of the tie rule 'alternate': a zero is +1 on even steps, −1 on odd."""
    return 1 if x > 0 or (x == 0 and step % 2 == 0) else -1


def _feedback_reference(steps):
    """θ, and each rank's (v, σ, s, e) per step and tensor, by exact rational arithmetic of
    v = c + e, σ = sign(v), s = mean|v|, e ← v − s·σ, u = majority of σ, θ ← θ − η·u."""
    theta = [[Fraction(k, 8) for k in range(4)] for _ in SHAPES]
    m = [[[Fraction(0)] * 4 for _ in SHAPES] for _ in range(WORLD)]
    e = [[[Fraction(0)] * 4 for _ in SHAPES] for _ in range(WORLD)]
    log = []
    for step in range(steps):
        sigmas, rec = [], []
        for r in range(WORLD):
            per = []
            for t, shape in enumerate(SHAPES):
                g = [Fraction(x) for x in _grad(r, step, shape).reshape(-1).tolist()]
                v = [BETA1 * mi + (1 - BETA1) * gi + ei for mi, gi, ei in zip(m[r][t], g, e[r][t])]
                sigma = [_sign(x, step) for x in v]
                s = sum(abs(x) for x in v) / len(v)
                e[r][t] = [x - s * sg for x, sg in zip(v, sigma)]
                m[r][t] = [BETA2 * mi + (1 - BETA2) * gi for mi, gi in zip(m[r][t], g)]
                per.append((v, sigma, s, list(e[r][t])))
            sigmas.append([p[1] for p in per])
            rec.append(per)
        for t in range(len(SHAPES)):
            u = [1 if sum(sigmas[r][t][k] for r in range(WORLD)) > 0 else -1 for k in range(4)]
            theta[t] = [th - LR * uk for th, uk in zip(theta[t], u)]
        log.append(rec)
    return theta, log


# ----------------------------------------------------------------------------- error feedback
def _feedback_runs(rank, world, runs, steps):
    return [_feedback_run(rank, vote, fused, steps) for vote, fused in runs]


def _feedback_run(rank, vote, fused, steps):
    params = _params()
    kw = dict(bits=2) if vote == "pbit" else {}
    opt = LionCub(params, lr=LR, betas=(BETA1, BETA2), vote=vote, error_feedback="worker", fused=fused,
                  check_every=1, **kw)
    plain = LionCub([torch.nn.Parameter(p.detach().clone()) for p in params], lr=LR, betas=(BETA1, BETA2),
                    vote=vote, **kw)
    out = []
    for step in range(steps):
        for p, q, shape in zip(params, plain.param_groups[0]["params"], SHAPES):
            p.grad = _grad(rank, step, shape)
            q.grad = p.grad.clone()
        opt.step()
        plain.step()
        for p in params:  # bit-identical replicas after every step
            assert all(torch.equal(o, p.detach()) for o in _all(p.detach()))
        out.append(([p.detach().clone() for p in params], [opt.state[p]["ef_residual"].clone() for p in params],
                    [q.detach().clone() for q in plain.param_groups[0]["params"]]))
    return out


FEEDBACK_RUNS = [("onebit", None), ("gather", False), ("pbit", None)]  # fused=None: the C loops apply


def test_error_feedback_is_the_hand_computed_residual_and_vote():
    steps = 2
    theta, log = _feedback_reference(steps)
    runs = run_workers(_feedback_runs, WORLD, FEEDBACK_RUNS, steps)
    for k, _ in enumerate(FEEDBACK_RUNS):
        _check_feedback([per_rank[k] for per_rank in runs], theta, log)


def _check_feedback(results, theta, log):
    for r, per_step in enumerate(results):
        for step, (params, residuals, _) in enumerate(per_step):
            for t, e in enumerate(residuals):
                v, sigma, s, want = log[step][r][t]
                assert e.reshape(-1).tolist() == [float(x) for x in want], (r, step, t)
                # residual + what was sent == v, exactly
                sent = torch.tensor([float(s * sg) for sg in sigma])
                assert torch.equal(e.reshape(-1) + sent, torch.tensor([float(x) for x in v])), (r, step, t)
        for t, p in enumerate(per_step[-1][0]):
            assert p.reshape(-1).tolist() == [float(x) for x in theta[t]], (r, t)
    assert log[0][0][0][3][0] == Fraction(log[0][0][0][0][0]) - log[0][0][0][2] * log[0][0][0][1][0]
    plain_final, ef_final = results[0][-1][2], results[0][-1][0]
    assert any(not torch.equal(a, b) for a, b in zip(plain_final, ef_final))  # the residual changed a vote


# ----------------------------------------------------------------------------- stochastic signs
def _stochastic_runs(rank, world, votes, seed, steps, scale=True):
    return [_stochastic_run(rank, vote, seed, steps, scale) for vote in votes]


def _stochastic_run(rank, vote, seed, steps, scale=True):
    params = _params()
    opt = LionCub(params, lr=LR, betas=(BETA1, BETA2), vote=vote, stochastic_signs=scale, seed=seed, check_every=1)
    gen = torch.Generator().manual_seed(seed + rank)  # the reference's own copy of this rank's draws
    order = opt.buckets[0].params  # the bucket's flat order (last-registered first)
    out = []
    for step in range(steps):
        for p, shape in zip(params, SHAPES):
            p.grad = _grad(rank, step, shape)
        cs = [BETA1 * opt.state[p]["exp_avg"] + (1 - BETA1) * p.grad if "exp_avg" in opt.state[p]
              else (1 - BETA1) * p.grad for p in order]
        draws = torch.rand(sum(c.numel() for c in cs), generator=gen)
        sigma = []
        for c, r in zip(cs, draws.split([c.numel() for c in cs])):
            c = c.reshape(-1)
            x = c / c.abs().max() if scale is True else (c / (c.abs().mean() * scale)).clamp(-1, 1)
            sigma.append(torch.where(r < (x + 1) * 0.5, 1.0, -1.0))
        before = [p.detach().clone() for p in order]
        opt.step()
        total = sum(_all(torch.cat(sigma)))
        u = torch.sign(total) if vote == "gather" else torch.where(total > 0, 1.0, -1.0)  # P = 3: no ties
        got = torch.cat([(b - p.detach()).reshape(-1) / LR for b, p in zip(before, order)])
        out.append(torch.equal(got, u))
    return out


@pytest.mark.parametrize("scale", [True, pytest.param(1.5, marks=pytest.mark.slow)])  # 1.5: ~7 s, after the suite
def test_stochastic_signs_are_the_reference_draws(scale):
    for per_rank in run_workers(_stochastic_runs, WORLD, ["onebit", "gather"], 5, 3, scale):
        assert all(same for per_vote in per_rank for same in per_vote)


def test_scaled_stochastic_sign_mean_is_the_clipped_ratio():
    """``stochastic_signs=k``: M = k·mean|v|; over K draws the mean message is clip(v/M, −1, 1)
    within 5 standard errors; elements with |v| ≥ M send their sign every time."""
    v = torch.tensor([3.0, -1.5, 0.75, 0.0, -3.0, 2.0, -0.25, 1.0])  # mean|v| = 1.4375
    k, K = 1.25, 20000
    bits = stochastic_sign_values(v.repeat(K), 0, torch.Generator().manual_seed(0), [v.numel()] * K, scale=k)
    sigma = bits[:v.numel() * K].view(K, -1).float() * 2 - 1
    x = (v / (k * v.abs().mean())).clamp(-1, 1)
    assert x[0] == 1 and x[4] == -1 and x[5] == 1 and abs(x[2]) < 1  # some clipped, some not
    bound = 5 * ((1 - x ** 2) / K).sqrt().clamp_min(1e-12)
    assert ((sigma.mean(0) - x).abs() <= bound).all()
    for i in (0, 4, 5):  # |v| ≥ M: certain
        assert torch.equal(sigma[:, i], torch.full((K,), float(x[i])))
    max_scaled = stochastic_sign_values(v.repeat(K), 0, torch.Generator().manual_seed(0), [v.numel()] * K)
    assert not torch.equal(max_scaled, bits)  # the scale is used: M = max|v| draws differently


def test_stochastic_sign_mean_is_v_over_max():
    """Over K draws of each element the mean message is v/M within 5 standard errors,
    sqrt((1 − (v/M)²)/K); a tensor of zeros draws +1 with probability 1/2."""
    v = torch.tensor([3.0, -1.5, 0.75, 0.0, -3.0, 2.0, -0.25, 1.0])
    K = 20000
    bits = stochastic_sign_values(v.repeat(K), 0, torch.Generator().manual_seed(0), [v.numel()] * K)
    sigma = bits[:v.numel() * K].view(K, -1).float() * 2 - 1
    x = v / v.abs().max()
    bound = 5 * ((1 - x ** 2) / K).sqrt().clamp_min(1e-12)
    assert ((sigma.mean(0) - x).abs() <= bound).all()
    assert torch.equal(sigma[:, 0], torch.ones(K)) and torch.equal(sigma[:, 4], -torch.ones(K))  # |v| = M: certain
    zeros = stochastic_sign_values(torch.zeros(K), 0, torch.Generator().manual_seed(1))[:K].float()
    assert abs(zeros.mean().item() - 0.5) <= 5 * (0.25 / K) ** 0.5


# ----------------------------------------------------------------------------- resume, bytes, resharding
def _small_model(**kw):
    """A 41-parameter MLP (the same start on every call) and its LionCub (``kw``: the options)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    return model, LionCub(model.parameters(), lr=0.01, **kw)


def _train(model, opt, rank, steps, start):
    """Steps ``start .. start + steps - 1`` on this rank's own batches (seeded by rank and step)."""
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _resume_run(rank, world, vote):
    def make():  # several buckets, one message
        return _small_model(vote=vote, error_feedback="worker", stochastic_signs=True, seed=3, bucket_mb=1e-4)

    def train(model, opt, steps, start):
        _train(model, opt, rank, steps, start)

    model, opt = make()
    train(model, opt, 4, 0)
    stats = opt.last_step_stats
    n_params = len(list(model.parameters()))
    want = sum(predicted_bytes(vote, n, world)["bytes_sent"] for n in opt.message_elements())
    mask_bytes = 2 * (world - 1) / world * (n_params + 1)  # the agreement: has-grad mask + nonfinite flag
    bytes_ok = (stats.bytes_sent == pytest.approx(want + mask_bytes), len(opt.buckets) > 1)

    a, opt_a = make()
    train(a, opt_a, 2, 0)
    saved, model_saved = _roundtrip(opt_a.state_dict()), _roundtrip(a.state_dict())
    b, opt_b = make()
    b.load_state_dict(model_saved)
    opt_b.load_state_dict(saved)
    train(b, opt_b, 2, 2)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), b.parameters()))
    same_state = all(torch.equal(opt.state[p][k], opt_b.state[q][k])
                     for p, q in zip(model.parameters(), b.parameters()) for k in ("exp_avg", "ef_residual"))
    return bytes_ok, same, same_state, opt.state_dict()


def test_resume_is_bit_exact_and_the_bytes_are_the_cost_model():
    results = run_workers(_resume_run, WORLD, "onebit")
    for bytes_ok, same, same_state, _ in results:
        assert bytes_ok == (True, True) and same and same_state
    states = [sd for *_, sd in results]
    out = reshard_states(states, 2)  # residuals are averaged like the momenta
    for sd in out:
        for i in sd["state"]:
            mean = sum(s["state"][i]["ef_residual"].double() for s in states) / WORLD
            assert torch.equal(sd["state"][i]["ef_residual"], mean.float())
            assert sd["lioncub"]["config"]["error_feedback"] == "worker"


# ----------------------------------------------------------------------------- the arguments
@pytest.mark.parametrize("kw, exc, match", [
    (dict(error_feedback="owner"), ValueError, "error_feedback must be one of"),
    (dict(stochastic_signs="yes"), TypeError, "stochastic_signs must be a bool or a float > 0"),
    (dict(stochastic_signs=-1.0), ValueError, "stochastic_signs must be a bool or a finite float > 0"),
    (dict(stochastic_signs=float("inf")), ValueError, "stochastic_signs must be a bool or a finite float > 0"),
    (dict(vote="grad", error_feedback="worker"), ValueError, "error_feedback='worker' applies to the votes only"),
    (dict(vote="pbit", quantizer="l1", stochastic_signs=True), ValueError, "stochastic_signs applies to the bin"),
    (dict(vote="sign_allreduce", error_feedback="worker"), ValueError, "error_feedback applies"),
    (dict(vote="auto", stochastic_signs=True), ValueError, "stochastic_signs applies"),
])
def test_the_options_are_refused_where_the_message_is_not_binary_signs(kw, exc, match):
    """Refused by the aggregation object the settings describe (``SignVote`` / ``Mean``), once: the engine's
    ``VoteConfig`` checks nothing again."""
    with pytest.raises(exc, match=match):
        step_aggregation({"vote": "onebit", **kw}).for_step()


def test_overlap_is_refused_and_the_default_config_is_unchanged():
    with pytest.raises(ValueError, match="before the step's agreement"):
        LionCub(_params(), vote="onebit", error_feedback="worker", overlap=True)
    method = VoteConfig(vote="onebit").method(4)
    assert (method.feedback, method.stochastic, method.one_pass, method.repeatable) == (False, False, True, True)
    method = VoteConfig(vote="gather", stochastic_signs=True).method(4)
    assert (method.one_pass, method.repeatable) == (False, False)


# ----------------------------------------------------------------------------- the study's variants
def test_the_study_plans_each_mechanism_as_its_own_experiment():
    """bench/study's ablate part runs every VOTE_QUALITY variant with its options; each is a new
    experiment key (no record of another run is reused), and the others' keys are unchanged."""
    from bench import study, study_plan

    specs = {s.label: s for s in study_plan.ablate_plan([0])}
    keys = [s.key() for s in specs.values()]
    assert len(set(keys)) == len(keys)
    assert "error_feedback" not in specs["1-bit, ties plus"].key()  # the earlier records keep their keys
    model = torch.nn.Linear(4, 2)
    for label, vote, extra in study_plan.VOTE_QUALITY:
        opt = study.run_optimizer(specs[label], model.parameters(), model)
        assert (opt.vote, opt.error_feedback, opt.stochastic_signs) == (
            vote, extra.get("error_feedback", "none"), extra.get("stochastic_signs", False)), label
        lr, wd = study_plan.LION_GRID[0]
        assert (specs[label].lr, specs[label].weight_decay) == (extra.get("lr", lr), extra.get("weight_decay", wd))
