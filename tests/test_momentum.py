"""Momentum synchronisation (lioncub.engine.momentum): selection of tensors, the sync itself on
real gloo groups (mean of the pre-sync momenta, identical on every rank, the rest
untouched), its bytes in the step's CommStats, and the adaptive policy's divergence."""
import pytest
import torch
import torch.distributed as dist

from lioncub import CommStats
from tests.flat import LionCub
from lioncub.harness.models.gpt import build_gpt
from lioncub.harness.models.resnet import resnet18
from lioncub.harness.models.vit import vit_tiny
from lioncub.engine.momentum import Adaptive, divergence_sketch, io_parameters, label_params, sync_bytes
from tests.dist import run_workers


def _gpt(tied, seed=0):
    torch.manual_seed(seed)
    return build_gpt("gpt-tiny", vocab_size=32, block_size=8, tied_embeddings=tied)


def _io_names(model):
    return label_params(io_parameters(model), model)


# ----------------------------------------------------------------------------- selection (one process)
def test_io_picks_embeddings_and_head():
    assert _io_names(_gpt(tied=False)) == ["wte.weight", "wpe.weight", "head.weight"]
    tied = _gpt(tied=True)
    assert _io_names(tied) == ["wte.weight", "wpe.weight"]  # head.weight *is* wte.weight: once
    assert tied.head.weight is io_parameters(tied)[0]
    net = resnet18(num_classes=10, in_channels=1)  # its param_roles: the whole stem is input
    assert _io_names(net) == ["stem.0.weight", "stem.1.weight", "stem.1.bias", "head.weight", "head.bias"]
    vit = vit_tiny(num_classes=10, image_size=8, in_channels=1)  # patches, classes and positions
    assert _io_names(vit) == ["cls_token", "pos_embed", "patch_embed.weight", "patch_embed.bias",
                              "head.weight", "head.bias"]
    plain = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    assert _io_names(plain) == ["0.weight", "2.weight", "2.bias"]  # no roles: first embedding, last Linear


def test_selection_by_names_tensors_and_errors():
    model = _gpt(tied=True)
    opt = LionCub(model.parameters(), model=model, momentum_sync=["blocks.0.mlp.fc.weight", model.ln_f.bias])
    assert opt.momentum_sync.selected_names() == ["blocks.0.mlp.fc.weight", "ln_f.bias"]
    # a tied head named by its second name resolves to the one tensor
    opt = LionCub(model.parameters(), model=model, momentum_sync=["head.weight", "wte.weight"])
    assert opt.momentum_sync.selected_names() == ["wte.weight"]
    opt = LionCub(model.parameters(), model=model, momentum_sync="all")
    assert len(opt.momentum_sync.selected) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="momentum_sync must be one of"):
        LionCub(model.parameters(), momentum_sync="embeddings")
    with pytest.raises(ValueError, match="needs model"):
        LionCub(model.parameters(), momentum_sync="io")
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        LionCub(model.parameters(), model=model, momentum_sync=["nope"])
    with pytest.raises(ValueError, match="does not hold"):
        LionCub(model.blocks.parameters(), model=model, momentum_sync="io")
    with pytest.raises(TypeError, match="names or tensors"):
        LionCub(model.parameters(), model=model, momentum_sync=[3])
    with pytest.raises(ValueError, match="sync_every must be an int >= 1"):
        LionCub(model.parameters(), sync_every=0)
    with pytest.raises(ValueError, match="sync_dtype must be one of"):
        LionCub(model.parameters(), sync_dtype="fp16")
    with pytest.raises(ValueError, match="threshold must be"):
        Adaptive(threshold=2.0)


def test_sketch_is_linear_and_small_tensors_exact():
    a, b = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    za = divergence_sketch(a, 16, torch.Generator().manual_seed(3))
    zb = divergence_sketch(b, 16, torch.Generator().manual_seed(3))
    zd = divergence_sketch(a - b, 16, torch.Generator().manual_seed(3))
    assert za.shape == (16,)
    torch.testing.assert_close(za - zb, zd, rtol=0, atol=1e-9)
    small = torch.randn(5)
    assert torch.equal(divergence_sketch(small, 16, torch.Generator()), small.double())
    # unbiased: mean of ||z||^2 over many sign draws approaches ||a||^2
    g = torch.Generator().manual_seed(0)
    est = torch.stack([divergence_sketch(a, 16, g).square().sum() for _ in range(400)]).mean()
    assert abs(float(est) / float(a.double().square().sum()) - 1) < 0.05


def test_sync_bytes_is_ring_allreduce():
    assert sync_bytes(1000, 4) == 2 * 3 / 4 * 4000
    assert sync_bytes(1000, 4, dtype="bf16", every=10) == 2 * 3 / 4 * 2000 / 10


# ----------------------------------------------------------------------------- sync on gloo
def _train_step(opt, model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, 32, (2, 8), generator=g)
    model.zero_grad()
    model(x, x)[1].backward()
    opt.step()


def _gathered(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def _check_sync(rank, world, tied, dtype):
    """Train 3 steps with sync_every=3 and 'io'; return what the checks need."""
    model = _gpt(tied, seed=rank)  # LionCub broadcasts rank 0's weights
    opt = LionCub(model.parameters(), lr=1e-3, betas=(0.9, 0.95), vote="sign_allreduce",
                  momentum_sync="io", sync_every=3, sync_dtype=dtype, model=model)
    sync, params = opt.momentum_sync, list(model.parameters())
    pre = {}
    real_average = sync.average

    def spy(state, idx, stats=None):  # record the momenta just before the all-reduce
        pre.update({i: state[params[i]]["exp_avg"].clone() for i in range(len(params))})
        real_average(state, idx, stats)

    sync.average = spy
    bytes_, colls = [], []
    for step in range(3):
        _train_step(opt, model, rank, step)
        bytes_.append(opt.last_step_stats.bytes_sent)
        colls.append(opt.last_step_stats.n_collectives)
    names = label_params(params, model)
    out = {"selected": sync.selected_names(), "bytes": bytes_, "colls": colls, "sync_bytes": sync.bytes_sent,
           "n_selected": sum(params[i].numel() for i in sync.selected), "synced": {}, "unsynced": {}}
    for i, p in enumerate(params):
        post = _gathered(opt.state[p]["exp_avg"])
        before = _gathered(pre[i])
        key = "synced" if i in sync.selected else "unsynced"
        mean = before.double().mean(0)  # the exact mean (float64: no rounding at these sizes)
        out[key][names[i]] = dict(
            identical=bool((post == post[0]).all()),
            err=float((post[rank].double() - mean).abs().max() / before.abs().max()),
            # per element, the error over the bound's scale Σ_j |m_j| (see _rounding_bound)
            err_elem=float(((post[rank].double() - mean).abs()
                            / before.double().abs().sum(0).clamp_min(1e-300)).max()),
            untouched=bool(torch.equal(post[rank], before[rank])),
            ranks_differ=bool((before != before[0]).any()),
        )
    return out


def _check_adaptive(rank, world):
    """Hand-set momenta: 'diverged' differs across ranks, 'agreed' is the same everywhere."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Linear(50, 3))
    opt = LionCub(model.parameters(), momentum_sync=Adaptive(threshold=0.3, buckets=64), sync_every=2,
                  model=model)
    (w0, b0, w1, b1) = list(model.parameters())
    g = torch.Generator().manual_seed(rank)
    shared = torch.randn(2000, generator=torch.Generator().manual_seed(9)).view(50, 40)
    opt.state[w0]["exp_avg"] = shared + 0.1 * torch.randn(50, 40, generator=g)  # r ≈ 0.01 · (P-1)/P
    opt.state[b0]["exp_avg"] = torch.randn(50, generator=g)  # r ≈ (P-1)/P, exact (50 <= buckets)
    opt.state[w1]["exp_avg"] = torch.randn(3, 50, generator=g)  # r ≈ (P-1)/P, sketched
    opt.state[b1]["exp_avg"] = torch.ones(3)  # identical: r = 0
    ms = [opt.state[p]["exp_avg"].clone() for p in (w0, b0, w1, b1)]
    exact = []
    for m in ms:
        allm = _gathered(m).double()
        exact.append(float((allm - allm.mean(0)).square().sum() / allm.square().sum()))
    opt.steps = 2  # as if two steps had completed: this is a check step
    stats = CommStats()
    opt.momentum_sync.after_step(opt.steps, opt.state, stats)
    r = opt.momentum_sync.last_divergence
    post = [opt.state[p]["exp_avg"] for p in (w0, b0, w1, b1)]
    return dict(exact=exact, est=[r[n] for n in ("0.weight", "0.bias", "1.weight", "1.bias")],
                synced=[bool(torch.allclose(q, _gathered(m).mean(0), atol=1e-6)) for q, m in zip(post, ms)],
                untouched=[bool(torch.equal(q, m)) for q, m in zip(post, ms)],
                stats=stats.as_dict(), counts=opt.momentum_sync.sync_counts)


ADAPTIVE_STEPS = 2


def _adaptive_grads(rank, step):
    """Per parameter of _check_adaptive_step's model, this rank's gradient at ``step``:
    '0.weight' and '1.bias' independent on every rank (r ≈ (P-1)/P; 10x larger each step, so
    they dominate the momenta averaged the step before), '0.bias' the same on every rank
    (identical momenta: r = 0), '1.weight' the same up to 5% noise (r ≈ 0.002)."""
    own = torch.Generator().manual_seed(100 * step + rank)
    common = torch.Generator().manual_seed(100 * step + 99)
    return [10.0 ** step * torch.randn(20, 30, generator=own),
            torch.randn(20, generator=common),
            torch.randn(5, 20, generator=common) + 0.05 * torch.randn(5, 20, generator=own),
            10.0 ** step * torch.randn(5, generator=own)]


def _check_adaptive_step(rank, world):
    """momentum_sync='adaptive' with sync_every=1, through LionCub.step(): which momenta each
    step's check averaged, the divergences it measured and the exact ones (gathered here)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 5))
    opt = LionCub(model.parameters(), lr=1e-3, vote="sign_allreduce", momentum_sync="adaptive", sync_every=1,
                  model=model)
    sync, params = opt.momentum_sync, list(model.parameters())
    steps = []
    for step in range(ADAPTIVE_STEPS):
        for p, g in zip(params, _adaptive_grads(rank, step)):
            p.grad = g
        # the momenta the check sees: exp_avg before the step, then Lion's β2 update (as step() does)
        b2 = opt.param_groups[0]["betas"][1]
        pre = [(b2 * opt.state[p]["exp_avg"] if opt.state[p] else 0) + (1 - b2) * p.grad for p in params]
        counts_before = dict(sync.sync_counts)
        opt.step()
        exact = []
        for m in pre:
            allm = _gathered(m).double()
            exact.append(float((allm - allm.mean(0)).square().sum() / allm.square().sum()))
        post = [opt.state[p]["exp_avg"] for p in params]
        steps.append(dict(
            exact=exact, est=dict(sync.last_divergence),
            averaged=sorted(n for n, c in sync.sync_counts.items() if c > counts_before.get(n, 0)),
            identical=[bool((_gathered(q) == q).all()) for q in post],
            is_mean=[bool(torch.allclose(q, _gathered(m).mean(0), rtol=0, atol=1e-6)) for q, m in zip(post, pre)],
            untouched=[bool(torch.allclose(q, m, rtol=0, atol=1e-7)) for q, m in zip(post, pre)],
            bytes_sent=opt.last_step_stats.bytes_sent))
    return dict(steps=steps, counts=dict(sync.sync_counts), n_checks=sync.n_checks, n_syncs=sync.n_syncs,
                sync_bytes=sync.bytes_sent)


def _workers(rank, world):
    return dict(
        untied=_check_sync(rank, world, tied=False, dtype="fp32"),
        tied=_check_sync(rank, world, tied=True, dtype="fp32"),
        bf16=_check_sync(rank, world, tied=False, dtype="bf16"),
        adaptive=_check_adaptive(rank, world),
        adaptive_step=_check_adaptive_step(rank, world),
    )


@pytest.fixture(scope="module")
def four_ranks():
    return run_workers(_workers, 4)


def _rounding_bound(dtype: torch.dtype, world: int) -> float:
    """|computed mean - exact mean| <= this · Σ_j |m_j|, per element, for the momentum sync.

    In ``dtype`` the sync rounds each of the P inputs once (the cast; exact for fp32) and
    each of the P-1 partial sums of the all-reduce once (whatever its order); dividing by
    P = 4 and the cast back to fp32 are exact. With u = eps/2 (round to nearest), each
    rounding errs by at most u times its value, and every partial sum is at most
    (1+u)^P · Σ_j |m_j|, so the sum errs by at most (u + (P-1)·u·(1+u)^P)·Σ_j |m_j|, the mean by
    a P-th of that: below u·(1+u)^P · Σ_j |m_j| = P·u·(1+u)^P · mean_j |m_j|.
    bf16: u = 2^-8, bound 0.00397, so at most 0.0159 of the largest |m| (measured: 0.002 of it,
    0.002 per element; the former tolerance 2e-2 of the largest |m| let through a sync with
    4x bf16's rounding error); fp32: u = 2^-24, bound 6.0e-8 (measured 3.3e-8)."""
    u = torch.finfo(dtype).eps / 2
    return u * (1 + u) ** world


@pytest.mark.parametrize("case", ["untied", "tied", "bf16"])
def test_sync_averages_selected_momenta_only(four_ranks, case):
    bound = _rounding_bound(torch.bfloat16 if case == "bf16" else torch.float32, 4)
    tol = 4 * bound  # relative to the largest |m|: Σ_j |m_j| <= P·max|m|
    for r in four_ranks:
        res = r[case]
        want = ["wte.weight", "wpe.weight"] + ([] if case == "tied" else ["head.weight"])
        assert res["selected"] == want
        assert set(res["synced"]) == set(want)
        for name, s in res["synced"].items():
            assert s["identical"], name
            assert s["ranks_differ"], name  # the momenta had drifted, so the sync did something
            assert s["err"] < tol, (name, s["err"], tol)
            assert s["err_elem"] <= bound, (name, s["err_elem"], bound)  # element for element
        for name, s in res["unsynced"].items():
            assert s["untouched"], name
        assert any(s["ranks_differ"] for s in res["unsynced"].values())


@pytest.mark.parametrize("case", ["untied", "tied", "bf16"])
def test_sync_bytes_in_step_stats(four_ranks, case):
    res = four_ranks[0][case]
    b, c = res["bytes"], res["colls"]
    assert b[0] == b[1] and c[0] == c[1]  # steps 1 and 2: no sync
    want = sync_bytes(res["n_selected"], 4, dtype="bf16" if case == "bf16" else "fp32")
    assert want == 2 * 3 / 4 * res["n_selected"] * (2 if case == "bf16" else 4)
    assert b[2] - b[1] == pytest.approx(want, rel=1e-12)
    assert c[2] - c[1] == 1  # one all-reduce: a tied head is not sent twice
    assert res["sync_bytes"] == pytest.approx(want, rel=1e-12)


def test_adaptive_finds_diverged_tensors(four_ranks):
    for r in four_ranks:
        res = r["adaptive"]
        exact, est = res["exact"], res["est"]
        assert exact[0] < 0.02 and exact[1] > 0.5 and exact[2] > 0.5 and exact[3] == 0.0
        assert est[1] == pytest.approx(exact[1], abs=1e-9)  # 50 elements <= 64 buckets: exact
        assert est[3] == pytest.approx(0.0, abs=1e-12)
        assert abs(est[0] - exact[0]) < 0.02 and abs(est[2] - exact[2]) < 0.25  # sketched
        assert res["synced"][:3] == [False, True, True]  # (the last is the same on every rank)
        assert res["untouched"] == [True, False, False, True]
        assert res["counts"] == {"0.bias": 1, "1.weight": 1}
        # one check all-reduce of (50+1) + (64+1) + ... float64s, then one fp32 sync of 50 + 150
        n_check = (64 + 1) + (50 + 1) + (64 + 1) + (3 + 1)
        assert res["stats"]["n_collectives"] == 2
        assert res["stats"]["bytes_sent"] == pytest.approx(1.5 * (8 * n_check + 4 * 200))
    assert len({tuple(r["adaptive"]["est"]) for r in four_ranks}) == 1  # every rank decides alike


def test_adaptive_policy_through_step_averages_only_diverged_momenta(four_ranks):
    """LionCub.step() on 4 gloo ranks with momentum_sync='adaptive' (threshold 0.25) and
    sync_every=1: after every step the check measures each momentum's divergence; the two that
    differ across ranks are averaged, the identical one and the nearly identical one are not."""
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    for r in four_ranks:
        res = r["adaptive_step"]
        for s, st in enumerate(res["steps"]):
            assert sorted(st["est"]) == sorted(names), (s, st["est"])  # every momentum was checked
            exact, est = st["exact"], [st["est"][n] for n in names]
            # far from the threshold 0.25 either way (r ≈ 0.75 for independent momenta; 5 elements: noisy)
            assert exact[0] > 0.6 and exact[3] > 0.4 and exact[1] == 0.0 and exact[2] < 0.01, (s, exact)
            assert est[1] == 0.0  # identical momenta: r = 0 exactly (20 elements <= 64 buckets: sent whole)
            assert est[3] == pytest.approx(exact[3], abs=1e-6)  # 5 elements: exact (up to fp32 momenta here)
            assert abs(est[0] - exact[0]) < 0.25 and abs(est[2] - exact[2]) < 0.05  # sketched
            assert st["averaged"] == ["0.weight", "1.bias"], (s, st["averaged"])
            assert st["is_mean"] == [True, True, False, True]  # (identical momenta are their mean)
            assert st["untouched"] == [False, True, True, False]
            assert all(st["identical"][k] for k in (0, 1, 3))
            assert not st["identical"][2]  # nearly identical momenta stay each rank's own
        assert res["counts"] == {"0.weight": ADAPTIVE_STEPS, "1.bias": ADAPTIVE_STEPS}
        assert res["n_checks"] == res["n_syncs"] == ADAPTIVE_STEPS
        # per step: one check all-reduce of (64+1) + (20+1) + (64+1) + (5+1) float64s, one fp32 sync of 600 + 5
        per_step = 1.5 * (8 * ((64 + 1) + (20 + 1) + (64 + 1) + (5 + 1)) + 4 * (600 + 5))
        assert res["sync_bytes"] == pytest.approx(ADAPTIVE_STEPS * per_step)
        assert len({st["bytes_sent"] for st in res["steps"]}) == 1  # the same work every step
    assert len({tuple(sorted(r["adaptive_step"]["steps"][-1]["est"].items())) for r in four_ranks}) == 1


def test_state_dict_round_trip_through_lioncub():
    model = _gpt(tied=False)
    opt = LionCub(model.parameters(), model=model, momentum_sync="adaptive")
    sync = opt.momentum_sync
    sync.n_syncs, sync.n_checks, sync.bytes_sent = 3, 7, 123.0
    sync.sync_counts, sync.last_divergence = {"wte.weight": 3}, {"wte.weight": 0.5}
    state = opt.state_dict()
    fresh = LionCub(model.parameters(), model=model, momentum_sync="adaptive")
    fresh.load_state_dict(state)
    assert fresh.momentum_sync.state_dict() == sync.state_dict()
    assert fresh.momentum_sync.n_checks == 7  # the sketch seed resumes where it stopped
