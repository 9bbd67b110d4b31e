"""``aggregate='mean'`` on ``onebit`` (issue 34): the 1-bit compressed mean of the gradients'
innovation with error feedback on the workers and the chunk owners, then Lion on the decoded
mean with a momentum every rank shares. On real gloo groups: a hand-computed case over two
steps (every residual, the sent values, the momentum and the parameters exactly); a 4-rank run
against a reference that computes every rank's part from all ranks' gradients (bit for bit, two
buckets in one message, two param groups, one maximizing); replicas identical; resume bit-exact;
no resharding; the combinations it cannot run are refused."""
import io

import pytest
import torch

from tests.flat import LionCub
from lioncub.engine.resume import reshard_states
from lioncub.votes.mean import OneBitMean
from tests.dist import run_workers


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ----------------------------------------------------------------------------- by hand, 2 ranks
HAND_GRADS = {  # (rank, step) -> g; multiples of 1/4, so every sum below is exact in fp32
    (0, 0): [1.0, -1.0, 2.0, 4.0], (1, 0): [4.0, 4.0, 4.0, 4.0],
    (0, 1): [1.0, 1.0, -1.0, 0.0], (1, 1): [2.25, 0.25, 1.25, 1.25],
}
HAND = {  # worked out on paper from the module docstring's rules (betas 0.5, 0.5; lr 1; wd 0)
    # step 0: α = 2 and 4, a = [3, 1, 3, 3], β = 2.5, τ all +1 (a repeat of the initial +1: h stays 1)
    # step 1: v = [-1.25, .75, -2.25, .75] and [1, -1, 0, 0] (the zeros vote -1 on an odd step), α = 1.25
    # and 0.5, s = [.125, -1.125, -.375, .875], β = 0.625
    "e": {(0, 0): [-1.0, 1.0, 0.0, 2.0], (1, 0): [0.0, 0.0, 0.0, 0.0],
          (0, 1): [0.0, -0.5, -1.0, -0.5], (1, 1): [0.5, -0.5, 0.5, 0.5]},
    "r": {0: [0.5, -1.5, 0.5, 0.5], 1: [-0.5, -0.5, 0.25, 0.25]},  # rank 0 owns the 4 elements
    "m": {0: [1.25] * 4, 1: [1.5625, 0.9375, 0.9375, 1.5625]},
    "theta": {0: [-1.0] * 4, 1: [-2.0] * 4},
    # h·τ: after step 1 the repeated signs grew by γ and the flips shrank by 1/γ; their geometric mean is
    # already 1 (mean_norm='geometric'); the arithmetic mean (γ + 1/γ)/2 divides them (the default)
    "shape": {0: [1.0] * 4, 1: [OneBitMean.ADAPT, -1.0 / OneBitMean.ADAPT, -1.0 / OneBitMean.ADAPT, OneBitMean.ADAPT]},
}


def _hand_run(rank, world, norm):
    p = torch.nn.Parameter(torch.zeros(4))
    opt = LionCub([p], lr=1.0, betas=(0.5, 0.5), vote="onebit", aggregate="mean", mean_norm=norm)
    out = []
    for step in range(2):
        p.grad = torch.tensor(HAND_GRADS[rank, step])
        opt.step()
        (layout, r), = opt.bucket_step.owners.items()  # one message
        out.append(dict(e=opt.state[p]["ef_residual"].clone(), r=r.clone(), m=opt.state[p]["exp_avg"].clone(),
                        theta=p.detach().clone(), shape=opt.state[p]["mean_shape"].clone()))
    return out


@pytest.mark.parametrize("norm", ["geometric", "arithmetic"])
def test_by_hand_two_steps(norm):
    out = run_workers(_hand_run, 2, norm)
    for step in range(2):
        for rank in range(2):
            got = out[rank][step]
            assert torch.equal(got["e"], torch.tensor(HAND["e"][rank, step])), (rank, step, got["e"])
            assert torch.equal(got["m"], torch.tensor(HAND["m"][step]))
            assert torch.equal(got["theta"], torch.tensor(HAND["theta"][step]))
            want = torch.tensor(HAND["shape"][step])  # geometric mean 1; the arithmetic mean divides it
            if norm == "arithmetic":
                want = want / want.abs().mean()
            assert torch.allclose(got["shape"], want, rtol=1e-6, atol=0), (norm, got["shape"])
        # the owner's chunk: 8 elements, the 4 of the tensor then padding (residual 0); rank 1 owns padding
        assert torch.equal(out[0][step]["r"], torch.tensor(HAND["r"][step] + [0.0] * 4))
        assert torch.equal(out[1][step]["r"], torch.zeros(8))


# ----------------------------------------------------------------------------- the reference, 4 ranks
WORLD = 4
SHAPES = [(3, 4), (8,)]  # two buckets (bucket_mb below) in one message: elements 0-7 (8,), 8-19 (3, 4)
BETAS = (0.9, 0.99)
GAMMA, RANGE = OneBitMean.ADAPT, OneBitMean.SHAPE_RANGE
GROUPS = [dict(lr=0.01, weight_decay=0.5), dict(lr=0.02, weight_decay=0.0, maximize=True)]


def _params():
    g = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grad(rank, step, shape):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + len(shape))
    return torch.randn(shape, generator=g)


RESTART = 4  # the momentum and the residuals restart after 4 steps (of 6): after the resume's save at 3


def _make(params, norm="arithmetic", restart=RESTART):
    return LionCub([dict(params=[params[0]], **GROUPS[0]), dict(params=[params[1]], **GROUPS[1])], betas=BETAS,
                   vote="onebit", aggregate="mean", mean_norm=norm, mean_restart=restart, bucket_mb=12 * 4 / 2**20,
                   check_every=1)


def _signs(x, step):
    """±1 of x, zeros +1 on even steps and −1 on odd (the alternating tie rule)."""
    return torch.where((x > 0) | ((x == 0) & (step % 2 == 0)), 1.0, -1.0)


class Reference:
    """Every rank's part of the compressed mean, from all ranks' gradients, in plain torch."""

    def __init__(self, params, order, norm, restart):
        self.order = order  # the message's tensors, in message order: (param index, start element)
        self.norm, self.restart = norm, restart
        self.theta = [p.detach().clone() for p in params]
        self.m = [torch.zeros_like(p) for p in params]
        self.shape = [torch.ones(p.numel()) for p in params]  # h·τ_prev, shared
        self.e = [[torch.zeros(p.numel()) for p in params] for _ in range(WORLD)]
        total = 8 * -(-sum(-(-p.numel() // 8) for p in params) // WORLD) * WORLD  # padded message elements
        self.chunk = total // WORLD
        self.r = torch.zeros(total)

    def step(self, grads, step):
        """``grads[rank][k]``: rank's gradient of parameter k."""
        total = self.r.numel()
        if step == self.restart:  # the momentum and both residuals restart from zero; h is kept
            self.m = [torch.zeros_like(m) for m in self.m]
            self.e = [[torch.zeros_like(e) for e in es] for es in self.e]
            self.r = torch.zeros(total)
        a, h = torch.zeros(total), torch.zeros(total)
        for k, start in self.order:
            h[start:start + self.m[k].numel()] = self.shape[k].abs()
        for rank in range(WORLD):
            for k, start in self.order:
                g = grads[rank][k].reshape(-1)
                hk = self.shape[k].abs()
                delta = (-g if GROUPS[k].get("maximize") else g) - self.m[k].reshape(-1)
                v = delta + self.e[rank][k]
                alpha = torch.dot(v.abs(), hk) / torch.dot(hk, hk)  # least squares: v ≈ α·h·σ
                sigma = _signs(v, step)
                self.e[rank][k] = v - sigma * hk * alpha
                a[start:start + v.numel()] += sigma * alpha
        s = a * h / WORLD + self.r
        tau = _signs(s, step)
        sent = torch.zeros(total)
        for k, start in self.order:  # one scale per piece: a tensor's elements in one chunk
            end = start + self.m[k].numel()
            for j in range(WORLD):
                lo, hi = max(start, j * self.chunk), min(end, (j + 1) * self.chunk)
                if lo < hi:
                    beta = torch.dot(s[lo:hi].abs(), h[lo:hi]) / torch.dot(h[lo:hi], h[lo:hi])
                    sent[lo:hi] = tau[lo:hi] * h[lo:hi] * beta
        self.r = s - sent
        for k, start in self.order:
            n = self.m[k].numel()
            piece = sent[start:start + n]
            old = self.shape[k]  # a repeated sign grows h by γ, a flip shrinks it; mean 1, clipped
            grown = old.abs() * torch.where((old >= 0) == (piece >= 0), GAMMA, 1 / GAMMA)
            centre = torch.exp(torch.mean(torch.log(grown))) if self.norm == "geometric" else grown.mean()
            grown = (grown / centre).clamp(1 / RANGE, RANGE)
            self.shape[k] = torch.where(piece >= 0, grown, -grown)
            ghat = (piece + self.m[k].reshape(-1)).view_as(self.m[k])
            u = torch.mul(self.m[k], BETAS[0]).add_(ghat, alpha=1 - BETAS[0]).sign_()
            self.theta[k].mul_(1 - GROUPS[k]["lr"] * GROUPS[k]["weight_decay"]).add_(u, alpha=-GROUPS[k]["lr"])
            self.m[k].mul_(BETAS[1]).add_(ghat, alpha=1 - BETAS[1])


def _reference_run(rank, world, steps, norm, restart):
    params = _params()
    opt = _make(params, norm, restart)
    assert len(opt.buckets) == 2 and len(opt.messages()) == 1
    index = {id(p): k for k, p in enumerate(params)}
    order, byte = [], 0
    for bucket in opt.buckets:  # each bucket starts on a byte of the message
        start = 8 * byte
        for p in bucket.params:
            order.append((index[id(p)], start))
            start += p.numel()
        byte += -(-bucket.numel // 8)
    ref = Reference(params, order, norm, restart)
    same, spread = [], 0.0
    for step in range(steps):
        for p, shape in zip(params, SHAPES):
            p.grad = _grad(rank, step, shape)
        everyone = [[_grad(r, step, shape) for shape in SHAPES] for r in range(world)]
        opt.step()
        if step == 0:  # the same step of the plain vote: the bytes differ by the scales alone
            plain_params = _params()
            plain = LionCub([dict(params=[plain_params[0]], **GROUPS[0]), dict(params=[plain_params[1]], **GROUPS[1])],
                            betas=BETAS, vote="onebit", bucket_mb=12 * 4 / 2**20, check_every=1)
            for p, q in zip(plain_params, params):
                p.grad = q.grad.clone()
            plain.step()
            extra = opt.last_step_stats.bytes_sent - plain.last_step_stats.bytes_sent
            collectives = opt.last_step_stats.n_collectives - plain.last_step_stats.n_collectives
        ref.step(everyone, step)
        same.append(all(torch.equal(p.detach(), t) for p, t in zip(params, ref.theta))
                    and all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(params, ref.m))
                    and all(torch.equal(opt.state[p]["ef_residual"].reshape(-1), e)
                            for p, e in zip(params, ref.e[rank]))
                    and all(torch.equal(opt.state[p]["mean_shape"].reshape(-1), h) for p, h in zip(params, ref.shape)))
        spread = max(spread, max(float(h.abs().max() / h.abs().min()) for h in ref.shape))
    (_, r), = opt.bucket_step.owners.items()
    mine = ref.r[rank * ref.chunk:(rank + 1) * ref.chunk]
    moved = [float((p.detach() - q).abs().max()) for p, q in zip(params, _params())]
    return same, torch.equal(r, mine), moved, [p.detach().clone() for p in params], spread, (extra, collectives)


@pytest.mark.parametrize("norm, restart", [("arithmetic", RESTART),
                                           pytest.param("geometric", 0, marks=pytest.mark.slow)])  # ~11 s each
def test_every_step_equals_the_reference_and_the_replicas_agree(norm, restart):
    out = run_workers(_reference_run, WORLD, 6, norm, restart)
    for same, owner_ok, moved, _, spread, (extra, collectives) in out:
        assert (extra, collectives) == (8 * (WORLD - 1) * len(SHAPES), 0)  # 4 bytes per tensor, each collective
        assert all(same), same
        assert owner_ok
        assert min(moved) > 0
        assert spread > GAMMA  # the shared magnitudes did adapt (not all equal)
    for *_, theta, _, _ in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(theta, out[0][3]))  # check_every=1 checked them too


# ----------------------------------------------------------------------------- state
def _train(params, opt, rank, start, steps):
    for step in range(start, start + steps):
        for p, shape in zip(params, SHAPES):
            p.grad = _grad(rank, step, shape)
        opt.step()


def _resume_run(rank, world):
    straight = _params()
    _train(straight, _make(straight), rank, 0, 6)
    first = _params()
    opt = _make(first)
    _train(first, opt, rank, 0, 3)
    sd = _roundtrip(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = _make(resumed)
    opt.load_state_dict(sd)
    _train(resumed, opt, rank, 3, 3)
    return [torch.equal(a, b) for a, b in zip(straight, resumed)], sd


def test_resume_is_bit_exact_and_the_residuals_do_not_reshard():
    out = run_workers(_resume_run, WORLD)
    for equal, sd in out:
        assert all(equal)
        assert sd["lioncub"]["config"]["aggregate"] == "mean"
    with pytest.raises(ValueError, match="aggregate='mean' keeps the chunk owners' residuals for the chunks of the saved"):
        reshard_states([sd for _, sd in out], 2)


def _mismatch_run(rank, world):
    params = _params()
    opt = _make(params)
    _train(params, opt, rank, 0, 1)
    sd = opt.state_dict()
    plain = LionCub(_params(), vote="onebit")
    with pytest.raises(ValueError, match="aggregate='mean'"):
        plain.load_state_dict(sd)
    with pytest.raises(ValueError, match="mean_norm='arithmetic' but this optimizer has mean_norm='geometric'"):
        _make(_params(), "geometric").load_state_dict(sd)
    with pytest.raises(ValueError, match=f"mean_restart={RESTART} but this optimizer has mean_restart=0"):
        _make(_params(), restart=0).load_state_dict(sd)
    # a checkpoint saved before mean_norm and mean_restart existed ran the arithmetic mean and no restart
    old = {**sd, "lioncub": {**sd["lioncub"], "config": {k: v for k, v in sd["lioncub"]["config"].items()
                                                           if k not in ("mean_norm", "mean_restart")}}}
    with pytest.raises(ValueError, match="mean_restart=0 but this optimizer has mean_restart=50"):
        LionCub(_params(), vote="onebit", aggregate="mean").load_state_dict(old)
    _make(_params(), "arithmetic", 0).load_state_dict(old)
    return True


def test_a_checkpoint_of_the_mean_does_not_load_into_the_vote():
    assert all(run_workers(_mismatch_run, 2))


@pytest.mark.parametrize("kw, match", [
    (dict(vote="gather", aggregate="mean"), "it needs vote='onebit'"),
    (dict(vote="onebit", aggregate="mean", error_feedback="worker"), "error_feedback must keep its default"),
    (dict(vote="onebit", aggregate="mean", stochastic_signs=1.0), "stochastic_signs must keep its default"),
    (dict(vote="onebit", aggregate="mean", tie="hold"), "aggregate='mean' votes none"),
    (dict(vote="onebit", aggregate="mean", overlap=True), "aggregate='mean' updates its residuals"),
    (dict(vote="onebit", aggregate="median"), "aggregate must be one of"),
    (dict(vote="onebit", aggregate="mean", mean_norm="median"), "OneBitMean.norm must be one of"),
    (dict(vote="onebit", mean_norm="geometric"), "mean_norm applies to aggregate='mean' only"),
    (dict(vote="onebit", aggregate="mean", mean_restart=-1), "OneBitMean.restart must be an int >= 0"),
    (dict(vote="onebit", aggregate="mean", mean_restart=2.5), "OneBitMean.restart must be an int >= 0"),
    (dict(vote="onebit", mean_restart=10), "mean_restart applies to aggregate='mean' only"),
    (dict(vote="pbit", mean_adapt=2.0), "mean_adapt applies to aggregate='mean' only"),
])
def test_what_the_mean_cannot_run_with_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        LionCub(_params(), **kw)
