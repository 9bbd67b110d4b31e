"""Race baselines (issue 9): every adapter trains a tiny GPT on a real 2-rank gloo group.

Checked per method: parameters move; replicas are bit-identical at every point the
method promises it (every step for DDP / Lion Cub, after each average for local SGD,
after each outer step for DiLoCo and SparseLoCo) and, for the local methods, *differ* between those
points (the ranks really train on different data, so the equality is not vacuous).
DiLoCo's outer step is checked against its definition by hand.
"""
from __future__ import annotations

import copy
import hashlib

import pytest
import torch

from lioncub import baselines
from tests.dist import run_workers

# one sync point each (the streaming ones: three, so two delayed outer steps land); others: 3 steps
STEPS = {"local-adamw-h10": 11, "diloco-h10": 11, "sparseloco-h10": 11, "lcub-grad-h2-nest0.7-adamw-stream": 7,
         "lcub-mean4-h2-nest0.7-ef-stream": 7, "lcub-smean4-h4-nest0.7-ef-stream-f2": 9}
PERIOD = {"local-adamw-h10": 10, "diloco-h10": 10, "diloco-h50": 50, "sparseloco-h10": 10, "sparseloco-h50": 50,
          "streaming-diloco-h50": 50, "streaming-diloco-h200": 200, "streaming-diloco-h50-f5": 50,
          "streaming-diloco-h50-f10": 50,
          "lcub-smean4-h4-nest0.7-ef-stream-f2": 4,
          "lcub-onebit-h2-nest2-ef": 2, "lcub-pbit8l1-h3-lion2-adamw": 3, "lcub-mean4-h2-nest0.7-ef": 2,
          "lcub-grad-h2-nest0.7-adamw-stream": 2, "lcub-mean4-h2-nest0.7-ef-stream": 2}
NAMES = [n for n in baselines.METHODS if n != "compute-adamw-h50"] + ["lcub-onebit-h2-nest2-ef", "lcub-pbit8l1-h3-lion2-adamw", "lcub-mean4-h2-nest0.7-ef",
                                   "lcub-grad-h2-nest0.7-adamw-stream", "lcub-mean4-h2-nest0.7-ef-stream",
                                   "lcub-smean4-h4-nest0.7-ef-stream-f2"]  # LocalCub (the no-communication row: below)


def _digest(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _tiny_gpt(seed: int):
    from lioncub.harness.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)  # a different init per rank: the method must make them agree
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=8))


def _train_all(rank, world):
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    out, families = {}, {}
    for name in NAMES:
        model = _tiny_gpt(seed=rank)
        lr = 1e-3 if baselines.family(name) == "adamw" else 1e-4
        init = _digest(model)
        method = baselines.build(name, model, lr=lr)
        families[name] = method.family
        start = _digest(model)
        log = []
        for _ in range(STEPS.get(name, 3)):
            x = torch.randint(0, 64, (2, 8), generator=gen)
            loss = method.backward(x, x.roll(1, dims=1))
            synced = method.step(lr)
            if synced:  # the model the ranks agree on (a streaming method's start, not its round in flight)
                with method.evaluation():
                    log.append((synced, _digest(model), loss))
            else:
                log.append((synced, _digest(model), loss))
        out[name] = (init, start, log)
    return out, _outer_step_by_hand(rank, world), families


def _outer_step_by_hand(rank, world):
    """DiLoCo with outer lr 1 and no momentum: θ_g ← θ_g - mean(θ_g - θ_i) = mean_i θ_i."""
    import torch.distributed as dist

    model = _tiny_gpt(seed=0)
    method = baselines.local.DiLoCo(model, lr=1e-2, H=2, outer_lr=1.0, outer_momentum=0.0)
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randint(0, 64, (2, 8), generator=gen)
    method.backward(x, x)
    assert not method.step(1e-2)
    seen = []  # this rank's model after its inner step, before the round's outer step
    method.opt.inner.register_step_post_hook(
        lambda *_: seen.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])))
    method.backward(x, x)
    assert method.step(1e-2)  # the inner half of step 2, then the outer step
    local = seen[-1]
    mean = local.clone()
    dist.all_reduce(mean)
    mean /= world
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return float((after - mean).abs().max()), float((local - mean).abs().max())


def _compute_only(rank, world):
    """The no-communication row (H = 3) for 7 steps against torch's AdamW alone on the same data, from rank 0's
    start: (synced per step, equal to the reference bit for bit, this rank's digest)."""
    gen = torch.Generator().manual_seed(100 + rank)
    model, alone = _tiny_gpt(seed=rank), _tiny_gpt(seed=rank)
    method = baselines.local.ComputeOnly(model, lr=1e-3, H=3)
    alone.load_state_dict(model.state_dict())  # (rank 0's start: the row's one broadcast, at construction)
    ref = torch.optim.AdamW(alone.parameters(), lr=1e-3, betas=baselines.ddp.BETAS, weight_decay=0.0)
    synced = []
    for _ in range(7):
        x = torch.randint(0, 64, (2, 8), generator=gen)
        method.backward(x, x.roll(1, dims=1))
        synced.append(method.step(1e-3))
        alone(x, x.roll(1, dims=1))[1].backward()
        ref.step()
        ref.zero_grad(set_to_none=True)
    return synced, _digest(model) == _digest(alone), _digest(model)


def test_the_no_communication_row_is_adamw_alone_and_only_marks_the_clock_every_h_steps():
    (synced0, same0, d0), (synced1, same1, d1) = run_workers(_compute_only, 2)
    assert synced0 == synced1 == [False, False, True, False, False, True, False]
    assert same0 and same1 and d0 != d1  # each rank's own AdamW: nothing averaged, the replicas apart


@pytest.fixture(scope="module")
def runs():
    return run_workers(_train_all, 2, timeout_s=60)  # one group for every check: spawning is slow


@pytest.mark.parametrize("name", NAMES)
def test_replicas_agree_where_promised(runs, name):
    (init0, start0, log0), (init1, start1, log1) = runs[0][0][name], runs[1][0][name]
    assert init0 != init1, "ranks were built from different seeds"
    assert start0 == start1, "the method did not start every replica from rank 0's parameters"
    synced = [s for s, _, _ in log0]
    assert synced == [s for s, _, _ in log1], "ranks disagree on when they synchronised"
    period = PERIOD.get(name, 1)
    assert synced == [(i + 1) % period == 0 for i in range(len(synced))], f"sync points {synced}"
    for i, (s, d0, _) in enumerate(log0):
        if s:
            assert d0 == log1[i][1], f"step {i + 1}: replicas differ right after a sync point"
    assert log0[-1][1] != start0, "parameters never moved"
    assert all(torch.isfinite(torch.tensor(loss)) for _, _, loss in log0 + log1)
    if not all(synced):  # local methods: between syncs the replicas must drift apart
        drift = [d0 != log1[i][1] for i, (s, d0, _) in enumerate(log0) if not s]
        assert all(drift), "replicas identical between sync points: ranks are not training locally"


def test_every_step_methods_sync_every_step(runs):
    for name in NAMES:
        every = all(s for s, _, _ in runs[0][0][name][2])
        assert every == (name not in PERIOD), name


def test_each_built_method_has_the_family_its_name_is_swept_by(runs):
    """family(name), known before building, is the built adapter's own; the same in one
    process that built every method in turn (building one never changed another's)."""
    want = {name: ("adamw" if name.startswith(("adamw-", "local-", "diloco-", "streaming-diloco-", "sparseloco-"))
                   or name.removesuffix("-stream").endswith("-adamw") else "lion") for name in NAMES}
    assert {name: baselines.family(name) for name in NAMES} == want
    assert runs[0][2] == runs[1][2] == want


def test_diloco_outer_step_matches_definition(runs):
    (err0, spread0), (err1, _) = runs[0][1], runs[1][1]
    assert spread0 > 1e-6, "the ranks' inner models should differ before the outer step"
    assert err0 < 1e-6 and err1 < 1e-6


def test_local_cub_names_build_the_configuration_they_spell():
    opt = baselines.build("lcub-pbit8l1-h3-lion2.5-ef-adamw", _tiny_gpt(0), lr=1e-3).opt
    assert (opt.H, opt.vote, opt.bits, opt.quantizer, opt.outer, opt.outer_lr, opt.error_feedback) == \
        (3, "pbit", 8, "l1", "lion", 2.5, True)
    assert isinstance(opt.inner, torch.optim.AdamW) and baselines.family("lcub-onebit-h3-sgd1-adamw") == "adamw"
    opt = baselines.build("lcub-onebit-h10-nest3", _tiny_gpt(0), lr=1e-4).opt
    assert (opt.H, opt.vote, opt.outer, opt.outer_lr, opt.error_feedback) == (10, "onebit", "nesterov", 3.0, False)
    assert type(opt.inner).__name__ == "Lion" and baselines.family("lcub-onebit-h10-nest3") == "lion"


def test_auto_names_spell_the_floor_of_h():
    cls, kw = baselines.options("lcub-mean8-hauto50-nest0.7-ef-adamw")
    assert cls is baselines.cub.LocalCubMethod and (kw["H"], kw["min_local_steps"]) == ("auto", 50)
    _, kw = baselines.options("lcub-smean4-hauto-nest0.7-ef-adamw")
    assert kw["H"] == "auto" and "min_local_steps" not in kw  # LocalCub's own floor


def test_family_is_per_instance_and_never_changes_the_class():
    adamw = baselines.build("lcub-onebit-h3-sgd1-adamw", _tiny_gpt(0), lr=1e-3)
    lion = baselines.build("lcub-onebit-h3-sgd1", _tiny_gpt(0), lr=1e-4)
    assert (adamw.family, lion.family) == ("adamw", "lion")
    assert "family" not in vars(baselines.cub.LocalCubMethod) and baselines.cub.LocalCubMethod.family == "?"
    assert baselines.cub.CubMethod.family == "lion" and baselines.local.DiLoCo.family == "adamw"


def test_lion_cub_passes_bits_only_to_a_vote_with_lanes():
    """The lane check is the vote method's own (``LANE_BITS``), not a test of its name."""
    lanes = baselines.cub.CubMethod(_tiny_gpt(0), lr=1e-4, vote="pbit", bits=8)
    signs = baselines.cub.CubMethod(_tiny_gpt(0), lr=1e-4, vote="onebit", bits=8)  # bits ignored
    assert (lanes.opt.bits, lanes.name) == (8, "lioncub-pbit8")
    assert (signs.opt.bits, signs.name) == (None, "lioncub-onebit")


def test_build_rejects_bad_input():
    model = _tiny_gpt(0)
    with pytest.raises(ValueError, match="method must be one of"):
        baselines.build("sgd", model, lr=1e-3)
    with pytest.raises(ValueError, match="method must be one of"):
        baselines.build("lcub-onebit-h10-adam3", model, lr=1e-3)
    with pytest.raises(ValueError, match="local_steps must be an int >= 1"):
        baselines.build("lcub-onebit-h0-sgd1", model, lr=1e-3)
    with pytest.raises(ValueError, match="lr must be > 0"):
        baselines.build("adamw-ddp", model, lr=0.0)
    with pytest.raises(ValueError, match="H .* must be an int >= 1"):
        baselines.local.DiLoCo(model, lr=1e-3, H=0)


def _diloco_by_torch(model, *, lr, H, outer_lr, outer_momentum, weight_decay, steps, batch):
    """DiLoCo as the paper writes it, on one rank, with PyTorch's own optimizers: inner AdamW,
    outer SGD(nesterov=True) on the pseudo-gradient θ_g − θ."""
    params = list(model.parameters())
    inner = torch.optim.AdamW(params, lr=lr, betas=baselines.ddp.BETAS, weight_decay=weight_decay)
    global_params = [p.detach().clone().requires_grad_(True) for p in params]
    outer = torch.optim.SGD(global_params, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    for step in range(steps):
        model.zero_grad()
        model(batch(step)).square().mean().backward()
        inner.step()
        if (step + 1) % H == 0:
            with torch.no_grad():
                for g, p in zip(global_params, params):
                    g.grad = (g - p).detach().clone()
                outer.step()
                for p, g in zip(params, global_params):
                    p.copy_(g)


@pytest.mark.parametrize("outer_momentum, weight_decay", [(0.9, 0.0), (0.5, 0.1), (0.0, 0.0)])
def test_diloco_on_localcub_rounds_is_torchs_adamw_and_nesterov_sgd_bit_for_bit(outer_momentum, weight_decay):
    """The DiLoCo baseline runs on LocalCub's round loop; the same numbers as PyTorch's optimizers."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ours = copy.deepcopy(ref)
    batch = lambda step: torch.randn(5, 8, generator=torch.Generator().manual_seed(step))  # noqa: E731
    kw = dict(lr=1e-2, H=3, outer_lr=0.7, outer_momentum=outer_momentum, weight_decay=weight_decay)
    _diloco_by_torch(ref, steps=12, batch=batch, **kw)
    method = baselines.local.DiLoCo(ours, **kw)
    synced = []
    for step in range(12):
        ours(batch(step)).square().mean().backward()
        synced.append(method.step(kw["lr"]))
    assert synced == [False, False, True] * 4
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), ours.parameters()))
