"""fp16-style loss scaling with torch.amp.GradScaler (issue 30): every rank steps or skips
together and the scales stay equal, on real 2-rank gloo groups with GradScaler("cpu")."""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist import run_workers


def _run(rank, world, kind, inf_rank, inf_step, scaled):
    import lioncub

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    if kind == "lioncub":
        opt = lioncub.LionCub(model.parameters(), lr=1e-2, vote="pbit")
    elif kind == "nodecub":
        opt = lioncub.NodeCub(model.parameters(), lr=1e-2, layout=lioncub.node_groups(local_size=1), vote="pbit")
    else:
        opt = lioncub.LocalCub(model.parameters(), lr=1e-2, local_steps=2, vote="onebit")
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
def test_scaled_run_equals_the_unscaled_run_bit_for_bit():
    """Scaling by a power of two and unscaling is exact: without an overflow the scaled
    run gives the very parameters of the run without a scaler."""
    scaled = run_workers(_run, 2, "lioncub", -1, -1, True)
    plain = run_workers(_run, 2, "lioncub", -1, -1, False)
    for r in range(2):
        for p, q in zip(scaled[r]["params"], plain[r]["params"]):
            assert torch.equal(p, q)


def test_localcub_overflow_on_one_rank_skips_only_its_inner_step():
    a, b = run_workers(_run, 2, "localcub", 0, 0, True)
    assert a["stepped"][0] is False and b["stepped"][0] is True  # rank 0's own inner step skipped
    for p, q in zip(a["params"], b["params"]):
        assert torch.equal(p, q)  # after the last round (steps 2, 4) the replicas agree


def _scaler_with_overlap(rank, world):
    import lioncub

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = lioncub.LionCub(model.parameters(), lr=1e-2, vote="pbit", overlap=True)
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
