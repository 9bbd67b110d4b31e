"""Resume (issue 7): bit-exact continuation on the same world size, refusal of checkpoints
that do not fit, and the world-size change rule of lioncub.engine.resume.reshard_states
(4 ranks -> 2 ranks, trained on, on real gloo groups)."""
import copy
import io

import pytest
import torch
import torch.distributed as dist

from tests.flat import LionCub
from lioncub.engine.resume import check_loadable, reshard_states
from tests.dist import run_workers

W_TRUE = torch.linspace(-1, 1, 8)


def _shard(rank, n=32):
    """Rank ``rank``'s regression data: y = x·w* + noise (deterministic)."""
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(n, 8, generator=g)
    return x, x @ W_TRUE + 0.1 * torch.randn(n, generator=g)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _loss(model, rank):
    x, y = _shard(rank)
    return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)


def _backward(model, rank, step):
    model.zero_grad()
    x, y = (t.to(model[0].weight.dtype) for t in _shard(rank))
    idx = torch.randperm(32, generator=torch.Generator().manual_seed(step))[:8]  # same minibatch rule everywhere
    torch.nn.functional.mse_loss(model(x[idx]).squeeze(-1), y[idx]).backward()


def _roundtrip(obj):
    """Through torch.save / torch.load(weights_only=True): a checkpoint holds plain data only."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ----------------------------------------------------------------------------- same world size: bit-exact
CONFIGS = [
    dict(vote="pbit", bits=8, quantizer="linf"),  # stochastic rounding: the generator must resume
    dict(vote="onebit"),                          # saved after an odd step: the tie parity must resume
    dict(vote="gather", nonfinite="skip_step"),   # a skipped step before the save
    dict(vote="grad", grad_dtype="bf16"),
]


def _same_world(rank, world):
    out = []
    for cfg in CONFIGS:
        model = _model()
        opt = LionCub(model.parameters(), lr=0.02, weight_decay=0.1, seed=5, **cfg)
        for step in range(5):
            _backward(model, rank, step)
            if step == 1 and cfg.get("nonfinite") == "skip_step" and rank == 0:
                model[0].weight.grad[0, 0] = float("nan")
            opt.step()
        ckpt = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
        # a restarted process: other init, other seed; everything must come from the checkpoint
        twin = _model(seed=99 + rank)
        twin_opt = LionCub(twin.parameters(), lr=0.5, weight_decay=0.1, seed=1234, **cfg)
        twin.load_state_dict(ckpt["model"])
        twin_opt.load_state_dict(ckpt["opt"])
        # a control that loses the generator: stochastic votes must then differ
        control = copy.deepcopy(twin)
        control_opt = LionCub(control.parameters(), lr=0.02, weight_decay=0.1, seed=1234, **cfg)
        control_opt.load_state_dict(copy.deepcopy(ckpt["opt"]))
        control_opt.generator.manual_seed(4321 + rank)
        for step in range(5, 11):
            for m, o in ((model, opt), (twin, twin_opt), (control, control_opt)):
                _backward(m, rank, step)
                o.step()
        same = all(torch.equal(p, q) and torch.equal(opt.state[p]["exp_avg"], twin_opt.state[q]["exp_avg"])
                   for p, q in zip(model.parameters(), twin.parameters()))
        control_same = all(torch.equal(p, q) for p, q in zip(model.parameters(), control.parameters()))
        out.append((same, torch.equal(opt.generator.get_state(), twin_opt.generator.get_state()),
                    (opt.steps, opt.skipped_steps) == (twin_opt.steps, twin_opt.skipped_steps),
                    opt.steps, opt.skipped_steps, control_same))
    return out


def test_resume_is_bit_exact_on_the_same_world_size():
    for rank_out in run_workers(_same_world, 2):
        for cfg, (same, gen_same, counters_same, steps, skipped, control_same) in zip(CONFIGS, rank_out):
            assert same and gen_same and counters_same, cfg
            assert (steps, skipped) == ((10, 1) if cfg.get("nonfinite") else (11, 0)), cfg
            if cfg.get("quantizer") == "linf":
                assert not control_same  # the RNG state matters, so restoring it is tested


# ----------------------------------------------------------------------------- 4 ranks -> 2 ranks
def _train_on_four(rank, world):
    model = _model()
    opt = LionCub(model.parameters(), lr=0.02, vote="pbit", quantizer="l1", model=model)
    for step in range(6):
        _backward(model, rank, step)
        opt.step()
    return model.state_dict(), copy.deepcopy(opt.state_dict())


def _resume_on_two(rank, world, model_state, new_states, old_rank0_state, expected_momenta):
    model = _model(seed=50 + rank)
    opt = LionCub(model.parameters(), lr=0.02, vote="pbit", quantizer="l1", model=model, check_every=5)
    model.load_state_dict(model_state)
    refused = None
    try:
        opt.load_state_dict(old_rank0_state)  # a 4-rank state loaded as is: refused, pointing at the fix
    except ValueError as exc:
        refused = str(exc)
    opt.load_state_dict(new_states[rank])
    momenta_ok = all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), expected_momenta))
    with torch.no_grad():
        start = sum(_loss(model, r) for r in range(4)).item() / 4  # the old world's objective
    for step in range(6, 46):
        _backward(model, rank, step)  # each new rank trains on its own shard
        opt.step()
    with torch.no_grad():
        end = sum(_loss(model, r) for r in range(4)).item() / 4
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    return refused, momenta_ok, opt.steps, start, end, all(torch.equal(e, flat) for e in everyone)


@pytest.mark.slow  # ~20 s (two spawned groups)
def test_resume_from_four_ranks_on_two_trains_on():
    old = run_workers(_train_on_four, 4)
    states = [sd for _, sd in old]
    new = reshard_states(states, 2)
    idx = [i for g in states[0]["param_groups"] for i in g["params"]]
    expected = [torch.stack([sd["state"][i]["exp_avg"].double() for sd in states]).mean(0).float() for i in idx]
    assert not all(torch.equal(states[0]["state"][i]["exp_avg"], states[1]["state"][i]["exp_avg"]) for i in idx)
    res = run_workers(_resume_on_two, 2, old[0][0], new, states[0], expected)
    for r, (refused, momenta_ok, steps, start, end, replicas_same) in enumerate(res):
        assert f"rank 0 of 4, but this is rank {r} of 2" in refused and "reshard_states" in refused
        assert momenta_ok and steps == 46 and replicas_same
        assert end < 0.5 * start, (start, end)


# ----------------------------------------------------------------------------- 2 ranks -> 4 ranks, pbit lanes widen
def _train_pbit_on_two(rank, world):
    model = _model()
    opt = LionCub(model.parameters(), lr=0.02, vote="pbit", model=model)  # bits=None: the narrowest lane
    for step in range(4):
        _backward(model, rank, step)
        opt.step()
    return model.state_dict(), copy.deepcopy(opt.state_dict()), opt.method.bits, opt.last_step_stats.bytes_sent


def _resume_pbit_on_four(rank, world, model_state, new_states):
    from lioncub.engine.cost import predicted_bytes

    model = _model(seed=9 + rank)
    opt = LionCub(model.parameters(), lr=0.02, vote="pbit", model=model)
    model.load_state_dict(model_state)
    opt.load_state_dict(new_states[rank])
    for step in range(4, 8):
        _backward(model, rank, step)
        opt.step()
    n_tensors = len(list(model.parameters()))
    want = sum(predicted_bytes("pbit", n, world)["bytes_sent"] for n in opt.message_elements())
    want += predicted_bytes("sign_allreduce", n_tensors + 1, world)["bytes_sent"]  # has-grad mask + flag
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    return (opt.method.bits, opt.steps, opt.last_step_stats.bytes_sent == pytest.approx(want),
            all(torch.equal(e, flat) for e in everyone))


@pytest.mark.slow  # ~19 s (two spawned groups)
def test_pbit_lanes_are_chosen_again_when_resuming_on_more_ranks():
    """2-bit lanes hold a 2-rank vote but overflow with 4 ranks: the resumed run picks 4-bit
    lanes (bits=None is what the checkpoint stores), sends their bytes, and stays in sync."""
    old = run_workers(_train_pbit_on_two, 2)
    assert [o[2] for o in old] == [2, 2]
    new = reshard_states([o[1] for o in old], 4)
    for bits, steps, bytes_ok, replicas_same in run_workers(_resume_pbit_on_four, 4, old[0][0], new):
        assert bits == 4 and steps == 8 and bytes_ok and replicas_same


# ----------------------------------------------------------------------------- the pure function
def _fake_world(n_ranks, vote="onebit", dtype=torch.float32):
    """Per-rank states as LionCub would save them on ``n_ranks`` ranks (distinct momenta)."""
    states = []
    for r in range(n_ranks):
        model = _model().to(dtype)
        opt = LionCub(model.parameters(), lr=0.02, vote=vote, seed=r)
        for step in range(3):
            _backward(model, r, step)
            opt.step()
        sd = copy.deepcopy(opt.state_dict())
        sd["lioncub"].update(rank=r, world_size=n_ranks)
        states.append(sd)
    return states


@pytest.mark.parametrize("old, new", [(4, 2), (2, 3), (3, 1)])
def test_reshard_averages_momenta_and_derives_distinct_generators(old, new):
    states = _fake_world(old)
    before = copy.deepcopy(states)
    out = reshard_states(states, new)
    assert len(out) == new
    for r, sd in enumerate(out):
        assert (sd["lioncub"]["rank"], sd["lioncub"]["world_size"]) == (r, new)
        assert sd["lioncub"]["counters"]["steps"] == 3 and sd["param_groups"] == states[0]["param_groups"]
        for i in sd["state"]:
            mean = sum(s["state"][i]["exp_avg"].double() for s in states) / old
            assert torch.equal(sd["state"][i]["exp_avg"], mean.float())
    gens = [sd["lioncub"]["generator"] for sd in out]
    assert all(not torch.equal(gens[a], gens[b]) for a in range(new) for b in range(a))
    assert all(torch.equal(a, b) for a, b in zip(gens, [sd["lioncub"]["generator"] for sd in reshard_states(states, new)]))
    for s, b in zip(states, before):  # pure: the inputs are untouched
        assert all(torch.equal(s["state"][i]["exp_avg"], b["state"][i]["exp_avg"]) for i in s["state"])


def test_reshard_same_size_is_an_unchanged_copy_and_bf16_stays_bf16():
    states = _fake_world(2, dtype=torch.bfloat16)
    out = reshard_states(states, 2)
    for a, b in zip(out, states):
        assert torch.equal(a["lioncub"]["generator"], b["lioncub"]["generator"])
        assert {k: v for k, v in a["lioncub"].items() if k != "generator"} == \
            {k: v for k, v in b["lioncub"].items() if k != "generator"}
        assert all(torch.equal(a["state"][i]["exp_avg"], b["state"][i]["exp_avg"]) for i in a["state"])
        assert all(a["state"][i]["exp_avg"] is not b["state"][i]["exp_avg"] for i in a["state"])
    assert reshard_states(states, 1)[0]["state"][0]["exp_avg"].dtype == torch.bfloat16


def test_reshard_counts_a_missing_momentum_as_zero():
    states = _fake_world(2)
    del states[1]["state"][0]
    out = reshard_states(states, 1)
    assert torch.equal(out[0]["state"][0]["exp_avg"], (states[0]["state"][0]["exp_avg"].double() / 2).float())


def _edit(states, r, *, part=None, **extra):
    """Change rank ``r``'s saved entry (``part``: its ``'config'`` or ``'counters'``)."""
    (states[r]["lioncub"] if part is None else states[r]["lioncub"][part]).update(extra)
    return states


@pytest.mark.parametrize("make, match", [
    (lambda: _fake_world(2)[::-1], r"states\[0\] was saved by rank 1 of 2"),
    (lambda: _fake_world(3)[:2], r"states\[0\] was saved by rank 0 of 3, but 2 states were given"),
    (lambda: _edit(_fake_world(2), 1, part="counters", steps=4), r"rank 1 has steps=4, rank 0 has 3"),
    (lambda: _edit(_fake_world(2), 1, part="config", vote="gather"), r"rank 1 has vote='gather', rank 0 has 'onebit'"),
    (lambda: [{"state": {}}], r"states\[0\] has no 'lioncub' entry"),
    (lambda: [], r"states must hold at least one"),
])
def test_reshard_refuses_inconsistent_worlds(make, match):
    with pytest.raises(ValueError, match=match):
        reshard_states(make(), 1)
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 0"):
        reshard_states(_fake_world(1), 0)


def test_loading_a_checkpoint_that_does_not_fit_is_a_clear_error():
    sd = _fake_world(1)[0]
    with pytest.raises(ValueError, match=r"saved with vote='onebit' but this optimizer has vote='pbit'"):
        LionCub(_model().parameters(), vote="pbit").load_state_dict(sd)
    with pytest.raises(ValueError, match=r"saved with bits=None but this optimizer has bits=8"):
        LionCub(_model().parameters(), vote="pbit", bits=8).load_state_dict(
            _fake_world(1, vote="pbit")[0])
    wide = torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    opt = LionCub(wide.parameters(), vote="onebit", model=wide)
    with pytest.raises(ValueError, match=r"another model: parameter 0 \('0.weight'\) has shape \(7, 8\), "
                                         r"its saved 'exp_avg' has shape \(6, 8\)"):
        opt.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"another model: it has 4 parameters in groups of \[4\], this optimizer "
                                         r"has 2"):
        LionCub(torch.nn.Linear(8, 6).parameters(), vote="onebit").load_state_dict(sd)
    bad = copy.deepcopy(sd)
    bad["state"][2]["exp_avg"][0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"non-finite 'exp_avg' for parameter 2"):
        LionCub(_model().parameters(), vote="onebit").load_state_dict(bad)
    moved = _edit([copy.deepcopy(sd)], 0, rank=1, world_size=4)[0]
    with pytest.raises(ValueError, match=r"state of rank 1 of 4, but this is rank 0 of 1"):
        check_loadable(LionCub(_model().parameters(), vote="onebit"), moved)


def test_a_checkpoint_saved_before_the_envelope_loads_and_refuses_as_before():
    """Flat fields (vote, bits, ..., steps at the top of the 'lioncub' entry) are moved into the
    envelope on load: same momenta, same step parity, same refusals."""
    sd = _fake_world(1)[0]
    env = sd["lioncub"]
    legacy = {**sd, "lioncub": {**{k: v for k, v in env.items() if k not in ("kind", "config", "counters")},
                                **{k: v for k, v in env["config"].items() if k != "tie"}, **env["counters"]}}
    assert "config" not in legacy["lioncub"] and legacy["lioncub"]["steps"] == 3
    opt = LionCub(_model().parameters(), vote="onebit")
    opt.load_state_dict(legacy)
    assert opt.steps == 3 and all(torch.equal(opt.state[p]["exp_avg"], sd["state"][i]["exp_avg"])
                                  for i, p in enumerate(opt.param_entries[k][1] for k in range(4)))
    with pytest.raises(ValueError, match=r"saved with vote='onebit' but this optimizer has vote='gather'"):
        LionCub(_model().parameters(), vote="gather").load_state_dict(legacy)
    assert reshard_states([legacy], 2)[1]["lioncub"]["counters"]["steps"] == 3


def test_loading_a_live_state_dict_does_not_share_momenta():
    """torch's Optimizer.load_state_dict keeps same-dtype tensors by reference; LionCub copies,
    so a twin loaded from a running optimizer's state_dict() does not step its momenta."""
    a = _model()
    opt = LionCub(a.parameters(), lr=0.02, vote="onebit")
    _backward(a, 0, 0)
    opt.step()
    b = copy.deepcopy(a)
    twin = LionCub(b.parameters(), lr=0.02, vote="onebit")
    twin.load_state_dict(opt.state_dict())  # live references, no deepcopy
    before = [opt.state[p]["exp_avg"].clone() for p in a.parameters()]
    _backward(b, 0, 1)
    twin.step()
    assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(a.parameters(), before))
    assert not all(torch.equal(twin.state[q]["exp_avg"], m) for q, m in zip(b.parameters(), before))


@pytest.mark.parametrize("delay", [0, 1])
def test_a_localcub_checkpoint_on_another_world_size_is_refused_in_one_line(delay):
    """LocalCub's per-worker state has no rule that would make it another world's: the harness's resume
    refuses it naming both sizes, instead of loading one worker's state everywhere or pointing at
    reshard_states (which reads LionCub's only)."""
    from tests.flat import LocalCub
    from lioncub.harness.checkpoint import reshard_optimizer

    params = [torch.nn.Parameter(torch.ones(3))]
    opt = LocalCub(params, lr=1e-2, local_steps=2, vote="grad", delay=delay)
    params[0].grad = torch.ones(3)
    opt.step()
    states = [opt.state_dict(), opt.state_dict()]
    with pytest.raises(ValueError, match=r"^--resume: this checkpoint was saved by LocalCub on 2 workers and this "
                                         r"run has 3: .* resume it on 2 workers$"):
        reshard_optimizer(states, opt, 0, 3)
