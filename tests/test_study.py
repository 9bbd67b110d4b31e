"""bench/study.py: the study's own tie-rule vote against the library, and the study end to end.

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


def _tie_votes(rank, world):
    import torch.distributed as dist

    from lioncub.vote import majority_vote

    g = torch.Generator().manual_seed(rank)
    c = torch.randn(1001, generator=g)
    c[::7] = 0.0  # exact zeros on every rank at the same places
    c[3::11] = 0.0  # and on this rank only
    cs = [torch.empty_like(c) for _ in range(world)]
    dist.all_gather(cs, c)
    out = {}
    for step in (0, 1):
        alt = study.fixed_tie_vote(c, "alternate", step)
        lib = majority_vote(c.clone(), method="onebit", step=step)
        out[f"alt_eq_onebit_{step}"] = bool(torch.equal(alt, lib))
        for rule, pos in (("plus", True), ("minus", False)):
            # reference from all ranks' inputs: zeros and ties both follow the rule
            votes = sum(torch.where(x > 0, 1, torch.where(x < 0, -1, 1 if pos else -1)) for x in cs)
            want = torch.where(votes == 0, torch.tensor(1 if pos else -1), torch.sign(votes)).float()
            got = study.fixed_tie_vote(c, rule, step)
            out[f"{rule}_{step}"] = bool(torch.equal(got, want))
            out[f"{rule}_ties_{step}"] = int((votes == 0).sum())
    return out


def test_fixed_tie_vote_matches_references():
    for res in run_workers(_tie_votes, 2):
        assert all(v for k, v in res.items() if "ties" not in k), res
        assert res["plus_ties_0"] > 100  # two workers tie often: the rule is exercised


def test_plan_and_errors():
    specs = study.plan(study.PARTS, [0, 1], 5, 3)
    keys = [s.key() for s in specs]
    assert len(specs) > len(set(keys))  # shared runs (Lion at β2=0.99, 4-bit no sync) are planned twice
    assert {s.part for s in specs} == set(study.PARTS)
    assert all(s.steps == 3 for s in specs if s.model != "gpt")
    try:
        study.fixed_tie_vote(torch.ones(3), "random", 0)
    except ValueError as e:
        assert "rule" in str(e)
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
