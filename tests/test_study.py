"""bench/study.py: its tie-rule runs apply their rule (element for element), and the study end to end.

The end-to-end run is tiny (2 workers, one seed, 2 steps per run) and goes through the same
code as the real study: spawned gloo group, records appended to JSONL, report tables and PNGs.
"""
from __future__ import annotations

import json
import math
import os
import sys

import torch

from tests.dist import run_workers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import study  # noqa: E402
import study_report  # noqa: E402


def _tie_steps(rank, world):
    """One step of every ``ties`` run's optimizer (as the study builds it) on a gradient with
    exact zeros and ties; u element for element against reference_vote with the run's rule."""
    import torch.distributed as dist

    from lioncub.vote import reference_vote

    specs = [s for s in study.plan(["ties"], [0], 2, 2) if s.tie_rule is not None]
    out = {}
    for spec in specs:
        for step in range(2):
            if step == 0:
                p = torch.nn.Parameter(torch.zeros(1001))
                opt = study.make_optimizer(spec, [p], lr=0.5, betas=(0.9, 0.99))
            g = torch.randn(1001, generator=torch.Generator().manual_seed(10 * step + rank))
            g[::7] = 0.0  # exact zeros on every rank at the same places
            g[3 + rank::11] = 0.0  # and on this rank only
            m = opt.state[p]["exp_avg"].clone() if opt.state[p] else torch.zeros(1001)
            c = 0.9 * m + 0.1 * g
            cs = [torch.empty_like(c) for _ in range(world)]
            dist.all_gather(cs, c)
            before = p.detach().clone()
            p.grad = g
            opt.step()
            u = (before - p.detach()) / 0.5
            out[(spec.tie_rule, step)] = (
                bool(torch.equal(u, reference_vote(cs, method="onebit", step=step, tie=spec.tie_rule))),
                int((sum(torch.sign(x) for x in cs) == 0).sum()))
    return out


def test_tie_runs_apply_their_rule():
    """Fails if the study's optimizer ignores the rule: with zeros and ties in every step,
    'plus' differs from the default on odd steps and 'minus' on even ones, and every run's u
    must match the reference of its own rule."""
    for res in run_workers(_tie_steps, 2):
        assert set(res) == {(r, s) for r in study.TIE_RULES for s in (0, 1)}, res
        assert all(ok for ok, _ in res.values()), res
        assert min(ties for _, ties in res.values()) > 100  # two workers tie often: the rule is exercised


def test_plan_and_errors():
    specs = study.plan(study.PARTS, [0, 1], 5, 3)
    keys = [s.key() for s in specs]
    assert len(specs) > len(set(keys))  # shared runs (Lion at β2=0.99, 4-bit no sync) are planned twice
    assert {s.part for s in specs} == set(study.PARTS)
    assert all(s.steps == 3 for s in specs if s.model != "gpt")
    ties = [s for s in specs if s.part == "ties" and s.tie_rule is not None]
    assert {s.tie_rule for s in ties} == set(study.TIE_RULES) and all(s.vote == "onebit" for s in ties)
    try:
        study.make_optimizer(study.Spec("ties", "bad", vote="onebit", tie_rule="random"),
                             [torch.nn.Parameter(torch.zeros(3))])
    except ValueError as e:
        assert "tie must be one of" in str(e)
    else:
        raise AssertionError("bad tie rule accepted")


def test_study_end_to_end(tmp_path):
    out = str(tmp_path / "study.jsonl")
    only = {"1-bit, ties minus", "Lion b2=0.95", "4-bit, sync none, b2=0.95"}
    records = study.run_study(["ties", "tied"], [0], gpt_steps=2, nproc=2, out=out, eval_every=1, only=only)
    assert len(records) == len(only)
    for r in records:
        assert r["world"] == 2 and r["steps"] == 2 and len(r["curve"]) == 2
        assert math.isfinite(r["final"]["val_loss"]) and 3.0 < r["final"]["val_loss"] < 7.0
    spread = [r["momentum_spread"] for r in records if r["sync"] == "none" and "momentum_spread" in r]
    assert spread and min(spread[0].values()) > 0  # own shards, own momenta: they differ
    assert "head.weight" in spread[0] and "wte.weight" in spread[0]  # the untied GPT
    again = study.run_study(["ties", "tied"], [0], gpt_steps=2, nproc=2, out=out, eval_every=1, only=only)
    assert len(again) == len(records)  # a rerun skips finished runs
    summary = study_report.summarize(again)
    assert {"ties", "tied"} <= set(summary)
    assert abs(summary["tied"][0]["gap_to_lion"]) < 1e-12  # the Lion row against itself
    paths = study_report.plot(summary, str(tmp_path / "fig"))
    assert all(os.path.getsize(p) > 1000 for p in paths)
    assert "| 1-bit, ties minus | 1 | 2 |" in study_report.markdown(summary)
    json.dumps(summary)


def _adamw_step(rank, world):
    """The recipe's AdamW reference: one step after the gradient all-reduce equals torch's AdamW
    on the mean gradient (two ranks: (a + b) / 2 is the same sum in either order, so exactly)."""
    spec = [s for s in study.recipe_plan([0], steps=4) if s.optimizer == "adamw"][0]
    p = torch.nn.Parameter(torch.ones(64))
    opt = study.make_optimizer(spec, [p], lr=spec.lr, betas=(0.9, 0.99))
    grads = [torch.randn(64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    p.grad = grads[rank].clone()
    opt.step()
    q = torch.nn.Parameter(torch.ones(64))
    q.grad = (grads[0] + grads[1]) / 2
    torch.optim.AdamW([q], lr=spec.lr, betas=(0.9, 0.99)).step()
    return torch.equal(p.detach(), q.detach()), type(opt).__name__


def test_recipe_part_applies_its_shape_schedule_and_optimizers():
    """Fails if the recipe's shape, weight decay, warm-up or AdamW reference are not applied."""
    specs = study.recipe_plan([0, 1])
    assert [s.label for s in specs][:7] == ["AdamW (nanoGPT)", "Lion lr=0.0001 wd=1", "Lion lr=3e-05 wd=3",
                                            "Lion lr=0.0003 wd=0.3", "1-bit (onebit)", "4-bit binary (pbit)",
                                            "8-bit L1 (pbit)"]
    assert len(specs) == 7 + 5  # the grid's edges on the first seed only
    assert all((s.layers, s.heads, s.embd, s.block, s.batch, s.steps, s.warmup) == (4, 4, 128, 64, 3, 2000, 100)
               for s in specs)
    from lioncub.harness.models import build_gpt

    model = study._model(specs[0], {"vocab_size": 65})
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in build_gpt("gpt-mini", vocab_size=65, block_size=64).parameters())
    assert study._lr_scale(49, 2000, warmup=100) == 0.5 and study._lr_scale(1999, 2000, warmup=100) < 0.11
    lion = specs[1]
    groups = study.param_groups(model, lr=lion.lr, weight_decay=lion.weight_decay)
    assert max(g["weight_decay"] for g in groups) == 1.0
    assert run_workers(_adamw_step, 2) == [(True, "AllReduceAdamW")] * 2
