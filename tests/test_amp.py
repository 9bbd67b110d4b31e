"""fp16-style loss scaling with torch.amp.GradScaler (issue 30): every rank steps or skips
together and the scales stay equal, on real 2-rank gloo groups with GradScaler("cpu")."""
from __future__ import annotations
from tests import flat

import math

import pytest
import torch

from tests.dist import run_workers


def _run(rank, world, kind, inf_rank, inf_step, scaled):
    import lioncub

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    if kind == "lioncub":
        opt = flat.LionCub(model.parameters(), lr=1e-2, vote="pbit")
    elif kind == "nodecub":
        opt = flat.NodeCub(model.parameters(), lr=1e-2, layout=lioncub.node_groups(local_size=1), vote="pbit")
    else:
        opt = flat.LocalCub(model.parameters(), lr=1e-2, local_steps=2, vote="onebit")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000) if scaled else None
    gen = torch.Generator().manual_seed(100 + rank)
    scales, stepped = [], []
    for step in range(4):
        x = torch.randn(8, 6, generator=gen)
        loss = model(x).square().mean()
        (scaler.scale(loss) if scaled else loss).backward()
        if rank == inf_rank and step == inf_step:
            model[0].weight.grad[0, 0] = math.inf
        before = [p.detach().clone() for p in model.parameters()]
        if scaled:
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
        else:
            opt.step()
        stepped.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
        opt.zero_grad()
    return {"scales": scales, "stepped": stepped, "params": [p.detach().clone() for p in model.parameters()],
            "skipped": getattr(opt, "skipped_steps", None)}


@pytest.mark.slow
def test_lioncub_and_nodecub_skip_together_and_keep_equal_scales():
    for kind in ("lioncub", "nodecub"):
        out = run_workers(_run, 2, kind, 0, 1, True)
        a, b = out
        assert a["scales"] == b["scales"], (kind, a["scales"], b["scales"])
        assert a["scales"][0] == 2.0 ** 10 and a["scales"][1] == 2.0 ** 9, (kind, a["scales"])  # backed off once
        assert a["stepped"] == b["stepped"] == [True, False, True, True], (kind, a["stepped"], b["stepped"])
        assert a["skipped"] == b["skipped"] == 1
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q), kind  # replicas identical


@pytest.mark.slow
def test_localcub_overflow_on_one_rank_skips_only_its_inner_step():
    a, b = run_workers(_run, 2, "localcub", 0, 0, True)
    assert a["stepped"][0] is False and b["stepped"][0] is True  # rank 0's own inner step skipped
    for p, q in zip(a["params"], b["params"]):
        assert torch.equal(p, q)  # after the last round (steps 2, 4) the replicas agree


def _scaler_with_overlap(rank, world):

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = flat.LionCub(model.parameters(), lr=1e-2, vote="pbit", overlap=True)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 6)).square().mean()).backward()
    try:
        scaler.step(opt)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_scaler_under_overlap_is_refused_on_every_rank():
    """Overlap encodes the votes during backward, from the scaled gradients: refused, not wrong."""
    for msg in run_workers(_scaler_with_overlap, 2):
        assert msg is not None and "GradScaler" in msg and "overlap=True" in msg and "bf16" in msg


def _unscaled_state(rank, world, mode):
    """4 steps of LionCub on one rank-dependent batch stream, rank 0's gradient overflowing at step 2.
    ``mode``: 'scaler' (GradScaler, growth every good step, so the scale moves: 2^11, 2^12, back off to
    2^11, 2^12), 'contract' (torch's newer contract by hand: ``opt.grad_scale`` / ``opt.found_inf`` set
    before a plain ``step()``, scale 2^7), 'reference' (no scaling; step 2 not taken at all)."""

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = flat.LionCub(model.parameters(), lr=1e-2, vote="pbit")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1) if mode == "scaler" else None
    gen = torch.Generator().manual_seed(100 + rank)
    scales, verdicts = [], []
    for step in range(4):
        loss = model(torch.randn(8, 6, generator=gen)).square().mean()
        if mode == "scaler":
            scaler.scale(loss).backward()
        else:
            (loss * (2.0 ** 7 if mode == "contract" else 1.0)).backward()
        if step == 2 and mode == "reference":
            opt.zero_grad()
            continue
        if step == 2 and rank == 0:
            model[0].weight.grad[0, 0] = math.inf
        if mode == "scaler":
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
        elif mode == "contract":
            opt.grad_scale = torch.tensor(2.0 ** 7)  # 0-dim tensors, as GradScaler.step sets them
            opt.found_inf = torch.tensor(float(not all(torch.isfinite(p.grad).all() for p in model.parameters())))
            opt.step()
            verdicts.append(float(opt.found_inf))
        else:
            opt.step()
        opt.zero_grad()
    return dict(scales=scales, verdicts=verdicts, params=[p.detach().clone() for p in model.parameters()],
                exp_avg=[opt.state[p]["exp_avg"].clone() for p in model.parameters()])


def test_scaled_steps_unscale_before_the_momentum_and_skip_together():
    """Lion's momentum takes the gradient's magnitude, so it shows whether a step unscaled: under a
    GradScaler whose scale moves every step, and under torch's newer grad_scale/found_inf contract,
    the parameters and every exp_avg equal the unscaled run's bit for bit (power-of-two scales
    unscale exactly), the overflow of rank 0 at step 2 skips that step on both ranks (as the
    reference that never takes it), the scales stay equal across ranks, and found_inf is left as
    the agreed verdict on every rank."""
    reference = run_workers(_unscaled_state, 2, "reference")
    for mode in ("scaler", "contract"):
        out = run_workers(_unscaled_state, 2, mode)
        for r in range(2):
            for name in ("params", "exp_avg"):
                assert all(torch.equal(a, b) for a, b in zip(out[r][name], reference[r][name])), (mode, r, name)
        if mode == "scaler":
            assert out[0]["scales"] == out[1]["scales"] == [2.0 ** 11, 2.0 ** 12, 2.0 ** 11, 2.0 ** 12]
        else:
            assert out[0]["verdicts"] == out[1]["verdicts"] == [0.0, 0.0, 1.0, 0.0]  # rank 1 learns of rank 0's
