"""Server-side error feedback on onebit's chunk owners (error_feedback='server' / 'both'), on real
gloo groups: each owner's residual plus the sign it sent is a + r exactly (a hand-computed
two-step case, padding included), the replicas stay identical, a resume is bit-exact and sends
the plain vote's bytes, another world size is refused, and the default is the plain majority."""
from fractions import Fraction

import pytest
import torch

from tests.flat import LionCub
from lioncub.engine.cost import predicted_bytes
from lioncub.engine.resume import reshard_states
from tests.dist import run_workers
from tests.test_vote_quality import _all, _grad, _roundtrip, _sign, _small_model, _train

SHAPES = [(4, 4), (8,)]  # one bucket of 24 elements, last-registered first: (8,) then (4, 4)
ORDER = SHAPES[::-1]  # the bucket's flat order
N, PADDED = 24, 32  # 3 bytes, padded to whole chunks: 4 bytes for 2 and 4 ranks
LR, BETA1, BETA2 = 1.0, 0.5, 0.5  # dyadic: with P a power of two every value below is exact in fp32
MODES = ("none", "server", "both")


def _params():
    return [torch.nn.Parameter(torch.arange(s[0] * (s[1] if len(s) > 1 else 1), dtype=torch.float32).reshape(s) / 8)
            for s in SHAPES]


def _server_residuals(opt):
    """The chunk owner's residuals as saved in ``state_dict`` (copies)."""
    return [r.clone() for _, r in opt.state_dict()["lioncub"].get("server_residuals", [])]


# ----------------------------------------------------------------------------- the reference, by hand
def _reference(mode, world, steps):
    """Per step, in exact rational arithmetic over the bucket's flat order: θ, the owners' s and
    r (the message padded to P chunks), and whether the sign sent differs from the majority.

    Workers: σ_i = sign(v_i), v_i = c_i (+ e_i with the worker residual, e_i ← v_i − s_i·σ_i,
    s_i = mean|v_i| per tensor). Owners: a = (2k − P)/P, s = a + r, σ = sign(s), r ← s − σ;
    without a server residual σ is the majority (ties by the step parity). θ ← θ − η·σ."""
    theta = [Fraction(k, 8) for shape in ORDER for k in range(shape[0] * (shape[1] if len(shape) > 1 else 1))]
    m = [[Fraction(0)] * N for _ in range(world)]
    e = [[Fraction(0)] * N for _ in range(world)]
    r = [Fraction(0)] * PADDED
    log = []
    for step in range(steps):
        votes = []
        for rank in range(world):
            g = [Fraction(x) for shape in ORDER for x in _grad(rank, step, shape).reshape(-1).tolist()]
            v = [BETA1 * mi + (1 - BETA1) * gi for mi, gi in zip(m[rank], g)]
            if mode == "both":
                v = [x + ex for x, ex in zip(v, e[rank])]
            sigma = [_sign(x, step) for x in v]
            if mode == "both":
                start = 0
                for shape in ORDER:
                    size = shape[0] * (shape[1] if len(shape) > 1 else 1)
                    s_i = sum(abs(x) for x in v[start:start + size]) / size
                    e[rank][start:start + size] = [x - s_i * sg for x, sg in zip(v[start:start + size],
                                                                                sigma[start:start + size])]
                    start += size
            m[rank] = [BETA2 * mi + (1 - BETA2) * gi for mi, gi in zip(m[rank], g)]
            votes.append(sigma + [-1] * (PADDED - N))  # padding bits are 0: −1 from everyone
        k = [sum(vote[x] == 1 for vote in votes) for x in range(PADDED)]
        majority = [1 if 2 * kx > world or (2 * kx == world and step % 2 == 0) else -1 for kx in k]
        if mode == "none":
            s, sent = None, majority
        else:
            s = [Fraction(2 * kx - world, world) + rx for kx, rx in zip(k, r)]
            sent = [_sign(x, step) for x in s]
            r = [x - sg for x, sg in zip(s, sent)]
        theta = [th - LR * sg for th, sg in zip(theta, sent[:N])]
        log.append(dict(theta=list(theta), s=s, r=list(r), flipped=sent != majority))
    return log


# ----------------------------------------------------------------------------- the hand-computed steps
def _hand_run(rank, world, steps):
    params = {mode: _params() for mode in MODES}
    opts = {mode: LionCub(ps, lr=LR, betas=(BETA1, BETA2), vote="onebit", error_feedback=mode, check_every=1)
            for mode, ps in params.items()}
    out = {mode: [] for mode in MODES}
    for step in range(steps):
        for mode, opt in opts.items():
            order = opt.buckets[0].params
            for p, shape in zip(params[mode], SHAPES):
                p.grad = _grad(rank, step, shape)
            before = torch.cat([p.detach().reshape(-1) for p in order])
            opt.step()
            after = torch.cat([p.detach().reshape(-1) for p in order])
            same = all(torch.equal(o, after) for o in _all(after))  # bit-identical replicas, every step
            out[mode].append(dict(theta=after, sent=(before - after) / LR, same=same,
                                  server=_server_residuals(opt), keys=list(opt.state_dict()["lioncub"])))
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_each_owner_keeps_s_minus_what_it_sent(world):
    steps = 2
    runs = run_workers(_hand_run, world, steps)
    chunk = PADDED // world  # elements each rank owns
    for mode in MODES:
        log = _reference(mode, world, steps)
        for rank, per_mode in enumerate(runs):
            for step, got in enumerate(per_mode[mode]):
                want = log[step]
                assert got["same"], (mode, rank, step)
                assert got["theta"].tolist() == [float(x) for x in want["theta"]], (mode, rank, step)
                if mode == "none":  # the default: the plain majority, and no server state saved
                    assert got["server"] == [] and "server_residuals" not in got["keys"]
                    continue
                (r,) = got["server"]  # one message, one residual: this rank's chunk
                lo = rank * chunk
                assert r.tolist() == [float(x) for x in want["r"][lo:lo + chunk]], (mode, rank, step)
                real = max(0, min(chunk, N - lo))  # this chunk's elements that are not padding
                s = torch.tensor([float(x) for x in want["s"][lo:lo + real]])
                assert torch.equal(r[:real] + got["sent"][lo:lo + real], s), (mode, rank, step)  # r + σ == s, fp32
                assert not r[real:].any()  # the padding's residual stays 0
        if mode != "none":
            assert log[-1]["flipped"]  # the residual changed a sign the majority would have sent


# ----------------------------------------------------------------------------- resume, bytes, world size
def _resume_run(rank, world, mode):
    def make(ef):  # two buckets, one message each: two server residuals
        return _small_model(vote="onebit", error_feedback=ef, bucket_mb=1e-4, message_mb=1e-6)

    model, opt = make(mode)
    plain, plain_opt = make("none")
    _train(model, opt, rank, 4, 0)
    _train(plain, plain_opt, rank, 4, 0)
    stats, plain_stats = opt.last_step_stats, plain_opt.last_step_stats
    n_params = len(list(model.parameters()))
    want = sum(predicted_bytes("onebit", n, world)["bytes_sent"] for n in opt.message_elements())
    mask_bytes = 2 * (world - 1) / world * (n_params + 1)  # the agreement: has-grad mask + nonfinite flag
    wire = (stats.bytes_sent == pytest.approx(want + mask_bytes), stats.bytes_sent == plain_stats.bytes_sent,
            stats.n_collectives == plain_stats.n_collectives, len(opt.messages()), len(_server_residuals(opt)))

    a, opt_a = make(mode)
    _train(a, opt_a, rank, 2, 0)
    saved, model_saved = _roundtrip(opt_a.state_dict()), _roundtrip(a.state_dict())
    b, opt_b = make(mode)
    b.load_state_dict(model_saved)
    opt_b.load_state_dict(saved)
    _train(b, opt_b, rank, 2, 2)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), b.parameters()))
    keys = ("exp_avg", "ef_residual") if mode == "both" else ("exp_avg",)
    same_state = all(torch.equal(opt.state[p][k], opt_b.state[q][k])
                     for p, q in zip(model.parameters(), b.parameters()) for k in keys)
    same_server = [torch.equal(x, y) for x, y in zip(_server_residuals(opt), _server_residuals(opt_b))]
    return wire, same, same_state, same_server, opt.state_dict()


@pytest.mark.slow
def test_resume_is_bit_exact_the_bytes_are_the_plain_votes_and_another_world_is_refused():
    results = run_workers(_resume_run, 3, "both")
    for wire, same, same_state, same_server, _ in results:
        assert wire == (True, True, True, 2, 2)
        assert same and same_state and same_server == [True, True]
    states = [sd for *_, sd in results]
    assert reshard_states(states, 3)[1]["lioncub"]["server_residuals"][0][1].equal(
        states[1]["lioncub"]["server_residuals"][0][1])  # the same world: an unchanged copy
    with pytest.raises(ValueError, match=r"error_feedback='both' keeps the chunk owners' residuals .* saved 3-rank world"):
        reshard_states(states, 2)
    _, opt = _small_model(vote="onebit", error_feedback="both", bucket_mb=1e-4)  # a world of 1 loading rank 0 of 3
    with pytest.raises(ValueError, match=r"^error_feedback='both' keeps the chunk owners' residuals .* resume on 3 ranks$"):
        opt.load_state_dict(states[0])


# ----------------------------------------------------------------------------- the arguments
@pytest.mark.parametrize("kw, match", [
    (dict(vote="gather", error_feedback="server"), "error_feedback='server' needs chunk owners"),
    (dict(vote="pbit", error_feedback="both"), "error_feedback='both' needs chunk owners"),
    (dict(vote="sign_allreduce", error_feedback="server"), "error_feedback applies to the binary-sign votes"),
    (dict(vote="onebit", error_feedback="owner"), "error_feedback must be one of"),
])
def test_server_feedback_is_refused_without_chunk_owners(kw, match):
    with pytest.raises(ValueError, match=match):
        LionCub(_params(), **kw)


def test_overlap_is_refused_with_server_feedback():
    with pytest.raises(ValueError, match="exchanges each bucket alone: error_feedback='server'"):
        LionCub(_params(), vote="onebit", error_feedback="server", overlap=True)
