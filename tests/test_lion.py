"""Tests for single-process Lion (src/lioncub/lion.py, docs/design.md §1)."""
from __future__ import annotations

import copy

import pytest
import torch

from lioncub.lion import Lion, apply_update_, interpolate, lion
from tests.conftest import require_module

SHAPES = [(5, 3), (7,), (0,), (), (2, 2, 2)]  # includes an empty tensor and a scalar
GROUP_HPARAMS = [  # different lr / betas / wd per group
    dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0),
    dict(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.5),
    dict(lr=5e-2, betas=(0.0, 0.5), weight_decay=0.1),
]


def _make_params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
             for s in SHAPES] for _ in GROUP_HPARAMS]


def _grads(groups, step, dtype):
    """Deterministic gradients for one step, same for every optimizer under test."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [[torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype) for p in g]
            for g in groups]


def _set_grads(groups, grads):
    for g, gs in zip(groups, grads):
        for p, grad in zip(g, gs):
            p.grad = grad.clone()


def _run(groups, opt, steps, dtype):
    for step in range(steps):
        _set_grads(groups, _grads(groups, step, dtype))
        opt.step()


def _assert_same(opt_a, groups_a, opt_b, groups_b):
    for ga, gb in zip(groups_a, groups_b):
        for pa, pb in zip(ga, gb):
            assert torch.equal(pa, pb)
            assert torch.equal(opt_a.state[pa]["exp_avg"], opt_b.state[pb]["exp_avg"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_foreach_matches_forloop(dtype):
    # On CPU the foreach ops run the same kernels per tensor: bit-identical is the tolerance.
    groups = {f: _make_params(dtype) for f in (False, True)}
    opts = {f: Lion([dict(params=g, **h) for g, h in zip(groups[f], GROUP_HPARAMS)], foreach=f)
            for f in (False, True)}
    for f in (False, True):
        _run(groups[f], opts[f], 20, dtype)
    _assert_same(opts[False], groups[False], opts[True], groups[True])
    for g in groups[True]:
        for p in g:
            assert opts[True].state[p]["exp_avg"].dtype == dtype
    initial = _make_params(dtype)[0]
    for p, p0 in zip(groups[True][0], initial):  # not vacuous: every non-empty param moved
        assert p.numel() == 0 or not torch.equal(p, p0)


def test_foreach_none_picks_vectorised_path(monkeypatch):
    calls = []
    real = torch._foreach_sign_
    monkeypatch.setattr(torch, "_foreach_sign_", lambda ts: calls.append(len(ts)) or real(ts))
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    Lion([p], lr=0.1).step()
    assert calls == [1]
    Lion([p], lr=0.1, foreach=False).step()
    assert calls == [1]


def _hand_lion(p, m, g, lr, beta1, beta2, wd):
    """The update rule of docs/design.md §1 written out with plain tensor arithmetic."""
    c = beta1 * m + (1 - beta1) * g
    u = (c > 0).double() - (c < 0).double()
    p = p * (1 - lr * wd)
    p = p - lr * u
    m = beta2 * m + (1 - beta2) * g
    return p, m


@pytest.mark.parametrize("foreach", [False, True])
def test_float64_matches_hand_formula(foreach):
    gen = torch.Generator().manual_seed(7)
    ps = [torch.randn(s, generator=gen, dtype=torch.float64) for s in [(64,), (8, 8), ()]]
    ms = [torch.zeros_like(p) for p in ps]
    ref_p, ref_m = [p.clone() for p in ps], [m.clone() for m in ms]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)
    for _ in range(300):
        gs = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in ps]
        lion(ps, gs, ms, **hp, foreach=foreach)
        for i, g in enumerate(gs):
            ref_p[i], ref_m[i] = _hand_lion(ref_p[i], ref_m[i], g, hp["lr"], hp["beta1"],
                                            hp["beta2"], hp["weight_decay"])
    for p, m, rp, rm in zip(ps, ms, ref_p, ref_m):
        # p - lr*u is one rounding either way (u is exactly -1/0/1): params are exact.
        assert torch.equal(p, rp)
        # torch's add(alpha=) may fuse the multiply-add: momentum (|m| < 0.2) agrees to
        # 1e-15 absolute (measured max 8e-17 after 300 steps).
        torch.testing.assert_close(m, rm, rtol=0, atol=1e-15)


def test_matches_lion_pytorch():
    lion_pytorch = require_module("lion_pytorch", why="lion-pytorch not installed (pip install lion-pytorch)")
    dtype = torch.float64
    hps = GROUP_HPARAMS[:2] + [dict(lr=2e-2, betas=(0.95, 0.98), weight_decay=1.0)]
    ours, theirs = _make_params(dtype), _make_params(dtype)
    opt_a = Lion([dict(params=g, **h) for g, h in zip(ours, hps)])
    opt_b = lion_pytorch.Lion([dict(params=g, **h) for g, h in zip(theirs, hps)], lr=1.0)
    _run(ours, opt_a, 50, dtype)
    _run(theirs, opt_b, 50, dtype)
    # Same operations in the same order: measured bit-identical; tolerance 1e-12 absolute.
    for ga, gb in zip(ours, theirs):
        for pa, pb in zip(ga, gb):
            torch.testing.assert_close(pa, pb, rtol=0, atol=1e-12)
            torch.testing.assert_close(opt_a.state[pa]["exp_avg"], opt_b.state[pb]["exp_avg"],
                                       rtol=0, atol=1e-12)


def test_weight_decay_uses_group_lr_and_sign_of_zero_is_zero():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    opt = Lion([dict(params=[a]), dict(params=[b], lr=0.25)], lr=0.5, weight_decay=0.5)
    a.grad, b.grad = torch.zeros(3), torch.zeros(3)  # m = 0, g = 0 -> c = 0 -> no sign step
    opt.step()
    assert torch.equal(a.detach(), torch.full((3,), 0.75))   # 1 - 0.5*0.5
    assert torch.equal(b.detach(), torch.full((3,), 0.875))  # 1 - 0.25*0.5


def test_state_dict_round_trip_continues_identically():
    dtype = torch.float32
    groups = _make_params(dtype)
    opt = Lion([dict(params=g, **h) for g, h in zip(groups, GROUP_HPARAMS)])
    _run(groups, opt, 5, dtype)
    saved_params, saved_state = copy.deepcopy(groups), copy.deepcopy(opt.state_dict())
    assert set(saved_state["state"][0]) == {"exp_avg"}

    resumed = [[p.detach().clone().requires_grad_() for p in g] for g in saved_params]
    opt2 = Lion([dict(params=g) for g in resumed], lr=123.0)  # hparams come from the state dict
    opt2.load_state_dict(saved_state)
    for step in range(5, 10):
        grads = _grads(groups, step, dtype)
        _set_grads(groups, grads)
        _set_grads(resumed, grads)
        opt.step()
        opt2.step()
    _assert_same(opt, groups, opt2, resumed)


def test_lr_scheduler_changes_step():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = Lion([p], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    grad = torch.tensor([1.0, -2.0, 0.0, 3.0])
    expected = torch.zeros(4)
    for lr in (0.5, 0.25, 0.125):  # dyadic: every value below is exact
        assert opt.param_groups[0]["lr"] == lr
        p.grad = grad.clone()
        opt.step()
        sched.step()
        expected -= lr * grad.sign()
        assert torch.equal(p.detach(), expected)


def test_closure_runs_with_grad_and_returns_loss():
    model = torch.nn.Linear(3, 1)
    opt = Lion(model.parameters(), lr=1e-2)
    x = torch.randn(5, 3)
    seen = []

    def closure():
        seen.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with torch.no_grad():
        expected_loss = model(x).pow(2).mean()
    before = model.weight.detach().clone()
    loss = opt.step(closure)
    assert seen == [True]
    assert torch.equal(loss.detach(), expected_loss)  # the closure's loss, at the old params
    assert not torch.equal(before, model.weight.detach())


@pytest.mark.parametrize("foreach", [False, True])
def test_maximize_equals_minimizing_negated_gradient(foreach):
    dtype = torch.float32
    up, down = _make_params(dtype), _make_params(dtype)
    opt_up = Lion([dict(params=g, **h) for g, h in zip(up, GROUP_HPARAMS)],
                  maximize=True, foreach=foreach)
    opt_down = Lion([dict(params=g, **h) for g, h in zip(down, GROUP_HPARAMS)], foreach=foreach)
    for step in range(10):
        grads = _grads(up, step, dtype)
        _set_grads(up, grads)
        _set_grads(down, [[-g for g in gs] for gs in grads])
        opt_up.step()
        opt_down.step()
    _assert_same(opt_up, up, opt_down, down)


def test_functional_pieces():
    m = [torch.tensor([1.0, -1.0, 0.0])]
    g = [torch.tensor([2.0, 2.0, 0.0])]
    m0, g0 = m[0].clone(), g[0].clone()
    c = interpolate(m, g, 0.5)
    assert torch.equal(c[0], torch.tensor([1.5, 0.5, 0.0]))
    assert torch.equal(interpolate(m, g, 0.5, maximize=True)[0], torch.tensor([-0.5, -1.5, 0.0]))
    assert torch.equal(m[0], m0) and torch.equal(g[0], g0)  # inputs untouched
    # an integer vote is applied like its float twin
    for vote in (torch.tensor([3, -1, 0], dtype=torch.int8), torch.tensor([3.0, -1.0, 0.0])):
        p, mm = [torch.ones(3)], [m0.clone()]
        apply_update_(p, [vote], mm, g, lr=0.25, beta2=0.5, weight_decay=0.0)
        assert torch.equal(p[0], torch.tensor([0.25, 1.25, 1.0]))
        assert torch.equal(mm[0], torch.tensor([1.5, 0.5, 0.0]))
    with pytest.raises(ValueError, match="equal lengths"):
        lion([torch.ones(1)], [], [torch.ones(1)], lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0)


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(lr=-1e-3), ValueError, "lr"),
    (dict(lr="0.1"), TypeError, "lr"),
    (dict(betas=(1.0, 0.99)), ValueError, "beta1"),
    (dict(betas=(0.9, -0.1)), ValueError, "beta2"),
    (dict(betas=(0.9,)), ValueError, "betas"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(weight_decay=float("nan")), ValueError, "weight_decay"),
])
def test_bad_hyperparameters_raise(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        Lion([torch.nn.Parameter(torch.ones(1))], **kwargs)


def test_bad_group_hyperparameter_raises_and_leaves_optimizer_unchanged():
    opt = Lion([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.ones(1))], lr=-1.0))
    assert len(opt.param_groups) == 1


def test_sparse_grad_and_complex_param_raise():
    emb = torch.nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([0, 1])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        Lion(emb.parameters()).step()
    with pytest.raises(TypeError, match="complex|real"):
        Lion([torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_interpolate_into_out_equals_new_tensors(dtype):
    """out= views of one flat fp32 buffer (what LionCub votes on) hold exactly the values
    interpolate returns as new tensors cast to fp32, also for channels_last momenta."""
    g = torch.Generator().manual_seed(3)
    ms = [torch.randn(2, 3, 4, 5, generator=g).to(dtype).to(memory_format=torch.channels_last),
          torch.randn(7, generator=g).to(dtype), torch.zeros(0, dtype=dtype)]
    gs = [torch.randn(m.shape, generator=g).to(dtype) for m in ms]
    for maximize in (False, True):
        want = interpolate(ms, gs, 0.9, maximize=maximize, foreach=True)
        flat = torch.full((sum(m.numel() for m in ms),), float("nan"))
        outs = list(flat.split([m.numel() for m in ms]))
        got = interpolate(ms, gs, 0.9, maximize=maximize, out=outs)
        assert got is outs
        assert torch.equal(flat, torch.cat([w.reshape(-1).float() for w in want]))
    with pytest.raises(ValueError, match="out tensors must be contiguous"):
        interpolate(ms[1:2], gs[1:2], 0.9, out=[torch.zeros(6)])
