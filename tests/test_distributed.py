"""LionCub on real gloo groups: agreement with the reference vote, bit-identical replicas,
the gradient baseline, missing gradients, accounting, state_dict; and world size 1 == Lion."""
import copy

import pytest
import torch
import torch.distributed as dist

from lioncub import Lion, reference_vote
from tests.flat import LionCub
from lioncub.engine.cost import predicted_bytes
from tests.dist import run_workers

VOTES = [
    dict(vote="sign_allreduce"),
    dict(vote="gather"),
    dict(vote="onebit"),
    dict(vote="pbit"),
    dict(vote="pbit", quantizer="l1"),
    dict(vote="pbit", bits=8, quantizer="linf"),
]


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(11, 5), torch.nn.Flatten(), torch.nn.Linear(15, 7),
                               torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _grads_for(model, rank, step):
    """Deterministic, rank-specific gradients from a rank-specific batch."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 11, (4, 3), generator=g)
    y = torch.randn(4, 3, generator=g)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def _all(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _votes_and_replicas(rank, world):
    report = {}
    for cfg in VOTES:
        model = _model(seed=rank)  # different init per rank: LionCub must broadcast rank 0's
        opt = LionCub(
            [{"params": model[0].parameters(), "lr": 0.02, "betas": (0.8, 0.95)},
             {"params": list(model[2].parameters()) + list(model[4].parameters()), "weight_decay": 0.1}],
            lr=0.01, bucket_mb=60 * 4 / 2**20, **cfg)  # tiny buckets: several per step
        assert len(opt.buckets) > 1
        params = [p for g in opt.param_groups for p in g["params"]]
        for step in range(6):
            _grads_for(model, rank, step)
            before = [p.detach().clone() for p in params]
            # every rank's c for every param, to check u against the reference vote
            all_c = []
            for g in opt.param_groups:
                b1 = g["betas"][0]
                for p in g["params"]:
                    m = opt.state[p]["exp_avg"] if "exp_avg" in opt.state[p] else torch.zeros_like(p)
                    all_c.append(_all(b1 * m + (1 - b1) * p.grad))
            opt.step()
            stats = opt.last_step_stats
            # the applied update is -lr*u after decay; recover u per param and compare
            k = 0
            for g in opt.param_groups:
                for p in g["params"]:
                    u = (before[k] * (1 - g["lr"] * g["weight_decay"]) - p.detach()) / g["lr"]
                    if cfg.get("quantizer") is None:  # sign votes are per element: exact per param
                        # (quantized votes normalise per bucket: checked bucket by bucket, exactly,
                        # in test_update_is_the_reference_for_every_vote_and_quantizer)
                        ref = reference_vote(all_c[k], method=cfg["vote"], step=step)
                        assert torch.allclose(u, ref, atol=1e-4), (cfg, step, k)
                        assert set(ref.unique().tolist()) <= {-1.0, 0.0, 1.0}
                    k += 1
            for p in params:  # bit-identical replicas
                for other in _all(p.detach()):
                    assert torch.equal(other, p.detach()), cfg
        n = sum(p.numel() for p in params)
        assert len(opt.messages()) == 1  # several buckets, one exchange
        expect = sum(predicted_bytes(cfg["vote"], n, world, bits=cfg.get("bits"),
                                     quantizer=cfg.get("quantizer"))["bytes_sent"] for n in opt.message_elements())
        mask_bytes = 2 * (world - 1) / world * (len(params) + 1)  # has-grad mask + nonfinite flag
        assert stats.bytes_sent == pytest.approx(expect + mask_bytes), cfg
        report[cfg["vote"] + str(cfg.get("quantizer"))] = (n, stats.bytes_sent, stats.n_collectives)
    return report


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_votes_match_reference_and_replicas_stay_identical(world):
    reports = run_workers(_votes_and_replicas, world)
    assert all(r == reports[0] for r in reports)


SIGN_VOTES = [dict(vote="sign_allreduce"), dict(vote="gather"), dict(vote="onebit"), dict(vote="pbit")]
QUANTIZED = [dict(vote="pbit", quantizer=q, bits=b) for q, b in (
    ("sign", None), ("l1", None), ("l1", 4), ("lp", 8), ("l0", None), ("l0", 4),
    ("linf", 8), ("linf", 4), ("log", None), ("log", 4))]


def _lion_c(m, g, beta1, maximize):
    """Lion's c = β1·m + (1-β1)·g (g negated when maximizing), in the op order both backends
    round it: fma(1-β1, g, m·β1), i.e. torch's mul(m, β1).add_(g, alpha=1-β1) on CPU."""
    return torch.mul(m, beta1).add_(-g if maximize else g, alpha=1 - beta1)


def _update_is_the_reference(rank, world):
    """Every vote and every quantizer through LionCub.step, against reference_vote on the
    ranks' c, bucket by bucket: a quantizer scales each bucket's flat c once, so the reference
    gets the bucket's c concatenated in the bucket's order (several small buckets, then one
    bucket holding every parameter). Then θ ← θ(1-ηλ) - η·u and m ← β2·m + (1-β2)·g, exactly,
    on both backends. The constructor's maximize=True holds for group 1, group 0 overrides it
    with False: maximize must negate g in c and in m (a bug in both backends alike is caught
    here, not by the fused == torch test). linf: the reference replays each rank's generator
    from its state just before the step (gathered), and the generator starts at seed + rank."""
    out = {}
    small = 60 * 4 / 2**20  # several buckets
    runs = [(cfg, small) for cfg in SIGN_VOTES] + [(cfg, mb) for cfg in QUANTIZED for mb in (small, 1.0)]
    for cfg, bucket_mb in runs:  # (per-element sign votes: the bucket plan changes nothing)
        for use in (None, False):
            model = _model(seed=rank)
            opt = LionCub([{"params": model[0].parameters(), "lr": 0.02, "betas": (0.8, 0.95), "maximize": False},
                           {"params": list(model[2].parameters()) + list(model[4].parameters()),
                            "weight_decay": 0.1}],
                          lr=0.01, maximize=True, bucket_mb=bucket_mb, fused=use, seed=5, **cfg)
            assert (len(opt.buckets) > 1) == (bucket_mb < 1), len(opt.buckets)
            linf = cfg.get("quantizer") == "linf"
            if linf:
                assert torch.equal(opt.generator.get_state(), torch.Generator().manual_seed(5 + rank).get_state()), \
                    "linf's generator must start seeded seed + rank"
            entries, moved = opt.param_entries, 0
            for step in range(3):
                _grads_for(model, rank, step)
                gens = None
                if linf:  # drawn from bucket after bucket, as the step encodes them
                    gens = [torch.Generator().set_state(s) for s in _all(opt.generator.get_state())]
                before, moms, cs = [], [], []
                for g, p in entries:
                    m = opt.state[p]["exp_avg"].clone() if "exp_avg" in opt.state[p] else torch.zeros_like(p)
                    before.append(p.detach().clone())
                    moms.append(m)
                    cs.append(_lion_c(m, p.grad, g["betas"][0], g["maximize"]))
                sizes = [c.numel() for c in cs]
                everyone = [x.split(sizes) for x in _all(torch.cat([c.reshape(-1) for c in cs]))]  # one gather
                u = [None] * len(entries)
                for bucket in opt.buckets:
                    flats = [torch.cat([x[i] for i in bucket.index]) for x in everyone]
                    ref = reference_vote(flats, method=cfg["vote"], bits=cfg.get("bits"),
                                         quantizer=cfg.get("quantizer"), step=opt.steps, generators=gens)
                    for i, piece in zip(bucket.index, ref.split(bucket.sizes)):
                        u[i] = piece.view_as(cs[i])
                assert all(x is not None for x in u)
                opt.step()
                for i, (g, p) in enumerate(entries):
                    lr, b2 = g["lr"], g["betas"][1]
                    where = (cfg, bucket_mb, use, step, i)
                    assert torch.equal(p.detach(), before[i] * (1 - lr * g["weight_decay"]) - lr * u[i]), ("θ", where)
                    grad = -p.grad if g["maximize"] else p.grad
                    assert torch.equal(opt.state[p]["exp_avg"], torch.mul(moms[i], b2).add_(grad, alpha=1 - b2)), \
                        ("m", where)
                    moved += int(u[i].ne(0).sum())
            assert moved > 0, cfg
            out[str(cfg), bucket_mb, use] = moved
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])  # 3 and 4 ranks: the slow pass
def test_update_is_the_reference_for_every_vote_and_quantizer(world):
    reports = run_workers(_update_is_the_reference, world)
    assert len(reports[0]) == (len(SIGN_VOTES) + 2 * len(QUANTIZED)) * 2
    assert all(r == reports[0] for r in reports)


def _message_sizes(rank, world):
    """The same run with every bucket in one message, one message per bucket, and a
    per-element vote without messages (overlap: each bucket voted alone)."""
    out = {}
    for cfg in VOTES:
        finals, counts = [], []
        for kw in (dict(message_mb=25.0), dict(message_mb=1e-6), dict(overlap=True)):
            model = _model(seed=0)
            opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, bucket_mb=60 * 4 / 2**20, **cfg, **kw)
            for step in range(4):
                _grads_for(model, rank, step)
                opt.step()
            finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            counts.append(opt.last_step_stats.n_collectives)
            if not kw.get("overlap"):
                assert len(opt.messages()) == (1 if kw["message_mb"] > 1 else len(opt.buckets))
            opt.remove_hooks()
        out[str(cfg)] = (finals, counts)
    return out


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_messages_of_several_buckets_change_nothing_but_collectives(world):
    for cfg, (finals, counts) in run_workers(_message_sizes, world)[0].items():
        # quantized pbit normalises per bucket (its part), wherever the part travels
        assert torch.equal(finals[0], finals[1]) and torch.equal(finals[0], finals[2]), cfg
        assert counts[0] < counts[1] == counts[2], (cfg, counts)


def _fused_vs_torch(rank, world):
    finals = {}
    for use in (True, False):
        for cfg in VOTES + [dict(vote="grad")]:
            model = _model(seed=0)
            opt = LionCub([{"params": model[0].parameters(), "lr": 0.02, "betas": (0.8, 0.95)},
                           {"params": list(model[2].parameters()) + list(model[4].parameters()),
                            "weight_decay": 0.1, "maximize": True}],
                          lr=0.01, bucket_mb=60 * 4 / 2**20, fused=use, **cfg)
            assert all(r.startswith("fused" if use else "torch") for r in opt.backends), opt.backends
            for step in range(5):
                _grads_for(model, rank, step)
                opt.step()
            finals.setdefault(str(cfg), []).append(
                torch.cat([t.reshape(-1) for p in model.parameters() for t in (p.detach(), opt.state[p]["exp_avg"])]))
    return {k: torch.equal(a, b) for k, (a, b) in finals.items()}


@pytest.mark.skipif(not __import__("lioncub").fused.available(), reason="no C compiler: no fused loops")
def test_fused_loops_and_torch_path_train_identically():
    """Parameters and momenta after 5 steps, param groups with other betas and maximize."""
    for report in run_workers(_fused_vs_torch, 2):
        assert all(report.values()), report


def _encode_first_vs_agree_first(rank, world):
    """On the fused path the first ``encode_ahead`` messages are encoded before the
    has-grad / finite agreement (the rest after it, checked apart); on the torch path all
    after it. Same bytes, collectives and results at every step, also when one rank's
    gradient is not finite (skipped) and when some param has no gradient on any rank
    (encoded again without it) or on some ranks only."""
    out = {}
    for cfg in (dict(vote="onebit"), dict(vote="sign_allreduce"), dict(vote="gather"), dict(vote="pbit"),
                dict(vote="pbit", quantizer="l1"), dict(vote="pbit", bits=8, quantizer="l0")):
        runs = []
        for use, ahead in ((True, 3), (True, 2), (False, 3)):  # all ahead, 2 of 3 ahead, torch path
            model = _model(seed=0)
            opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, bucket_mb=60 * 4 / 2**20,
                          message_mb=1e-6, nonfinite="skip_step", fused=use, **cfg)  # a message per bucket
            opt.encode_ahead = ahead
            log = [len(opt.messages()), opt.bucket_step.encodes_ahead(opt.buckets)]
            for step in range(6):
                _grads_for(model, rank, step)
                if step == 1 and rank == world - 1:
                    model[2].weight.grad[0, 0] = float("inf")  # message 1: encoded ahead
                if step == 2 and rank == 0:
                    model[0].weight.grad[3, 1] = float("nan")  # message 2: after, with ahead=2
                if step in (3, 4):
                    model[4].weight.grad = None  # no rank has it
                if step == 4 and rank != 0:
                    model[2].bias.grad = None  # rank 0 only
                opt.step()
                log.append((opt.last_step_stats.bytes_sent, opt.last_step_stats.n_collectives))
            log.append(opt.skipped_steps)
            runs.append((log, torch.cat([t.reshape(-1) for p in model.parameters()
                                         for t in (p.detach(), opt.state[p]["exp_avg"])])))
        out[str(cfg)] = runs
    return out


@pytest.mark.skipif(not __import__("lioncub").fused.available(), reason="no C compiler: no fused loops")
@pytest.mark.slow
def test_encoding_before_the_agreement_changes_no_byte_and_no_result():
    for cfg, runs in run_workers(_encode_first_vs_agree_first, 3)[0].items():
        (log_f, state_f), (log_h, state_h), (log_t, state_t) = runs
        assert log_f[0] == 3 and log_f[1] is True and log_t[1] is False, (cfg, log_f[:2], log_t[:2])
        assert log_f[2:] == log_h[2:] == log_t[2:], cfg  # bytes and collectives per step, skipped steps
        assert log_f[-1] == 2 and log_f[3][1] == log_f[4][1] == 1, cfg  # non-finite steps: the agreement only
        assert log_f[5][0] < log_f[7][0], cfg  # a param no rank has sends nothing
        assert torch.equal(state_f, state_t) and torch.equal(state_h, state_t), cfg


def _grad_baseline(rank, world):
    out = {}
    for dtype in ("fp32", "bf16"):
        model = _model(seed=0)
        ref_model = copy.deepcopy(model)
        opt = LionCub(model.parameters(), lr=0.01, weight_decay=0.1, vote="grad", grad_dtype=dtype)
        ref = Lion(ref_model.parameters(), lr=0.01, weight_decay=0.1)
        for step in range(5):
            grads = []
            for r in range(world):  # the mean gradient, computed locally for the reference
                _grads_for(ref_model, r, step)
                grads.append([p.grad.to(torch.bfloat16 if dtype == "bf16" else torch.float32).float()
                              for p in ref_model.parameters()])
            for p, *gs in zip(ref_model.parameters(), *grads):
                p.grad = sum(gs) / world
            ref.step()
            _grads_for(model, rank, step)
            opt.step()
        tol = 0 if dtype == "fp32" else 1e-6
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.allclose(p, q, atol=tol, rtol=0), dtype
            for other in _all(opt.state[p]["exp_avg"]):
                assert torch.equal(other, opt.state[p]["exp_avg"])  # identical momenta
        out[dtype] = opt.last_step_stats.bytes_sent
    return out


def test_grad_baseline_is_lion_on_mean_gradient():
    res = run_workers(_grad_baseline, 2)
    assert res[0]["bf16"] < res[0]["fp32"]


def _missing_and_resume(rank, world):
    model = _model(seed=0)
    opt = LionCub(model.parameters(), lr=0.01, vote="onebit")
    frozen_head = model[4].weight.detach().clone()
    for step in range(3):
        _grads_for(model, rank, step)
        model[4].weight.grad = None  # no rank has it: skipped like Lion skips it
        if rank != 0:
            model[2].bias.grad = None  # only rank 0 has it: zero gradient elsewhere, no deadlock
        opt.step()
    assert torch.equal(model[4].weight.detach(), frozen_head)
    # resume: a copy loaded from state_dict continues bit-identically
    sd = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    twin_opt = LionCub(twin.parameters(), lr=0.01, vote="onebit")
    twin_opt.load_state_dict(sd)
    for step in range(3, 6):
        for m, o in ((model, opt), (twin, twin_opt)):
            _grads_for(m, rank, step)
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match=r"^checkpoint was saved with vote='onebit' but this optimizer has vote='gather'$"):
        LionCub(twin.parameters(), vote="gather").load_state_dict(sd)
    return True


def _bf16_ema(m, g, beta):
    """β·m + (1-β)·g for bf16 m and g as the optimizer rounds it: m·β in fp32 (β not rounded
    to bf16), rounded to bf16; then torch's bf16 add_(g, alpha=1-β), which rounds alpha to bf16
    (and, in its scalar tail loop, alpha·g to bf16 before the add) -- so that one op is torch's
    own rather than an fp32 imitation that would differ in the last bf16 bit."""
    return (m.float() * beta).bfloat16().add_(g, alpha=1 - beta)


def _bf16_and_empty(rank, world):
    """A bf16, an empty and an fp32 parameter, in one bucket (the torch path: a bf16 tensor is
    not fused) and in a bucket each (the empty one alone, the fp32 one fused): the expected
    update is computed in fp32 and rounded to bf16 where the optimizer rounds it: θ·(1-ηλ) in
    fp32 rounded, then - η·u in fp32 rounded (η = 2⁻³: η·u is exact); c and m by _bf16_ema. u is
    reference_vote on each bucket's flat fp32 c. 1-ηλ = 0.9875 and β2 = 0.99 are no bf16
    numbers (0.98828125 in bf16): the optimizer must multiply by them in fp32
    (lion._foreach_scale_). The empty parameter raises nothing and stays an empty fp32 tensor."""
    out = []
    lr, wd, b1, b2 = 0.125, 0.1, 0.9, 0.99
    for cfg in (dict(vote="pbit", quantizer="l1"), dict(vote="pbit", bits=8, quantizer="linf"), dict(vote="onebit")):
        for bucket_mb in (25.0, 4 / 2**20):
            torch.manual_seed(rank)
            params = [torch.nn.Parameter(torch.randn(37, dtype=torch.bfloat16)),
                      torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.randn(5, 3))]
            empty = params[1]
            opt = LionCub(params, lr=lr, betas=(b1, b2), weight_decay=wd, bucket_mb=bucket_mb, **cfg)
            assert len(opt.buckets) == (1 if bucket_mb > 1 else 3)
            start = [p.detach().clone() for p in params]  # rank 0's, broadcast
            moms = [torch.zeros_like(p) for p in params]
            for step in range(4):
                g = torch.Generator().manual_seed(10 * step + rank)
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
                gens = [torch.Generator().set_state(x) for x in _all(opt.generator.get_state())]
                cs = [_bf16_ema(moms[0], params[0].grad, b1).float(), torch.zeros(0),
                      torch.mul(moms[2], b1).add_(params[2].grad, alpha=1 - b1)]
                sizes = [c.numel() for c in cs]
                everyone = [x.split(sizes) for x in _all(torch.cat([c.reshape(-1) for c in cs]))]
                u = [None] * 3
                for bucket in opt.buckets:
                    ref = reference_vote([torch.cat([x[i].reshape(-1) for i in bucket.index]) for x in everyone],
                                         step=step, generators=gens, method=cfg["vote"], bits=cfg.get("bits"),
                                         quantizer=cfg.get("quantizer"))
                    for i, piece in zip(bucket.index, ref.split(bucket.sizes)):
                        u[i] = piece.view(params[i].shape)
                before = [p.detach().clone() for p in params]
                opt.step()
                decayed = (before[0].float() * (1 - lr * wd)).bfloat16().float()
                want = (decayed - lr * u[0]).bfloat16()
                where = (cfg, bucket_mb, step)
                assert params[0].dtype == torch.bfloat16 and torch.equal(params[0].detach(), want), ("bf16 θ", where)
                moms[0] = _bf16_ema(moms[0], params[0].grad, b2)
                assert torch.equal(opt.state[params[0]]["exp_avg"], moms[0]), ("bf16 m", where)
                assert opt.state[params[0]]["exp_avg"].dtype == torch.bfloat16
                assert torch.equal(params[2].detach(), before[2] * (1 - lr * wd) - lr * u[2]), ("fp32 θ", where)
                moms[2] = torch.mul(moms[2], b2).add_(params[2].grad, alpha=1 - b2)
                assert torch.equal(opt.state[params[2]]["exp_avg"], moms[2]), ("fp32 m", where)
                assert params[1] is empty and empty.shape == (0,) and empty.dtype == torch.float32, where
            assert not torch.equal(params[0].detach(), start[0]), ("bf16 params never moved", where)
            for p in params:
                for other in _all(p.detach()):
                    assert torch.equal(other, p.detach())
            out.append(params[0].detach().float().sum().item())
    return out


def test_missing_gradients_and_resume():
    assert all(run_workers(_missing_and_resume, 3))


def test_bf16_params_move_as_rounded_fp32_and_empty_params_are_untouched():
    sums = run_workers(_bf16_and_empty, 2)
    assert sums[0] == sums[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_world_size_one_is_lion(dtype):
    model = _model(seed=0).to(dtype)
    ref_model = copy.deepcopy(model)
    groups = lambda m: [{"params": m[0].parameters(), "lr": 0.03},  # noqa: E731
                        {"params": list(m[2].parameters()) + list(m[4].parameters()), "weight_decay": 0.2}]
    opt = LionCub(groups(model), lr=0.01, vote="pbit")
    ref = Lion(groups(ref_model), lr=0.01)
    for step in range(20):
        for m, o in ((model, opt), (ref_model, ref)):
            _grads_for(m, 0, step)
            o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
    assert opt.last_step_stats.n_collectives == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(vote="nope"), "SignVote.transport must be one of"),
    (dict(grad_dtype="fp8"), "grad_dtype must be one of"),
    (dict(vote="onebit", bits=4), "SignVote.bits is the lane width of transport='pbit'"),
    (dict(quantizer="l2"), "SignVote.quantizer must be one of"),
    (dict(bits=3), "bits must be None or one of"),
    (dict(bucket_mb=0), "bucket_mb must be a number > 0"),
    (dict(message_mb=-1.0), "message_mb must be a number > 0"),
    (dict(lr=-1.0), "lr must be >= 0"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LionCub(torch.nn.Linear(2, 2).parameters(), **kwargs)


def test_non_float_params_are_refused():
    with pytest.raises(TypeError, match="floating-point"):
        LionCub([torch.zeros(3, dtype=torch.long)])
