"""bench/vote_agreement.py: its rates on hand-worked c's, and the probe on a real gloo run
(probed at the right steps, leaving the training bit for bit as it was)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.dist import run_workers

from bench import study
from bench import vote_agreement as va

# 4 workers x 5 coordinates. Lion's sign(Σ c): -, +, -, +, 0 with |Σ c| = 7, 8, 2, 2, 0 (19 in all).
# Signs' counts: +2, +4, 0 (a tie), -2, 0 (a tie, and Σ c = 0).
_CS = [torch.tensor(v) for v in ([1.0, 2.0, 1.0, -1.0, 0.5], [1.0, 2.0, 1.0, -1.0, -0.5],
                                 [1.0, 2.0, -1.0, -1.0, 0.5], [-10.0, 2.0, -3.0, 5.0, -0.5])]


def test_agreement_by_hand():
    """Fails if a flip, zero, mass or tie is counted wrong."""
    got = va.agreement(_CS, step=0)
    assert got["ties"] == 2 / 5
    four = got["4-bit binary"]  # sign counts: coordinates 0 and 3 flip, the tie on 2 goes to 0
    assert four["flip"] == 2 / 5 and four["zero"] == 1 / 5
    assert math.isclose(four["flip_mass"], 9 / 19, rel_tol=1e-12)
    assert math.isclose(four["zero_mass"], 2 / 19, rel_tol=1e-12)
    # 1-bit: never 0; the tie on coordinate 2 goes to +1 on one step parity (a flip) and -1 on the other
    one = [va.agreement(_CS, step=s)["1-bit"] for s in (0, 1)]
    assert all(o["zero"] == 0 and o["zero_mass"] == 0 for o in one)
    assert sorted(o["flip"] for o in one) == [2 / 5, 3 / 5]
    assert sorted(round(o["flip_mass"] * 19, 9) for o in one) == [9, 11]
    # 8-bit L1 lanes scale each worker by its own norm and clip at 31 levels: workers 0-2 send 28 / 31 /
    # ±28 / -28 / ±14, worker 3 sends -31 / 15 / -23 / 31 / -4, so its -10 (clipped) and its 5 are
    # outvoted: coordinates 0, 2, 3 flip (7 + 2 + 2 of 19); coordinate 4 (Σ c = 0) is no flip
    l1 = got["8-bit L1"]
    assert l1["flip"] == 3 / 5 and l1["zero"] == 0 and math.isclose(l1["flip_mass"], 11 / 19, rel_tol=1e-12)
    with pytest.raises(ValueError, match="cs must be"):
        va.agreement(_CS[:1], step=0)


def test_applied_rates_by_hand():
    """The step read back from the parameters: θ·(1 − lr·wd) − lr·u with u = +1, −1, 0, +1, −1."""
    lr, wd = 0.5, 0.1
    before = torch.tensor([1.0, 2.0, -1.0, 0.0, 4.0])
    u = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0])
    after = before * (1 - lr * wd) - lr * u
    total = torch.tensor([3.0, -1.0, 2.0, -4.0, 0.0], dtype=torch.float64)  # Lion's sign: +, -, +, -, 0
    got = va.applied_rates(before, after, lr, wd, total)  # coordinate 3 flips (mass 4), 2 is dropped (mass 2)
    assert got == {"flip": 1 / 5, "zero": 1 / 5, "flip_mass": 4 / 10, "zero_mass": 2 / 10}


def test_window_means():
    probes = [{"step": s, "ties": t, **{n: {r: x for r in va.RATES} for n in va.PROBE_VOTES}}
              for s, t, x in ((0, 0.1, 0.2), (200, 0.3, 0.4), (400, 0.5, 0.6), (1975, 0.7, 0.8))]
    w = va.window_means(probes)
    assert list(w) == ["0-400", "400-end"]
    assert math.isclose(w["0-400"]["ties"], 0.2) and math.isclose(w["400-end"]["1-bit"]["flip_mass"], 0.7)


def _probed_and_plain(rank, world, cache_dir):
    spec = dataclasses.replace(va.agreement_spec(3), layers=2, embd=32, block=32, batch=2, steps=5, warmup=1)
    job = va.Job([spec], out="", cache_dir=cache_dir, every=2)
    probed = va.agreement_worker(job)[0]
    every_step = va.agreement_worker(dataclasses.replace(job, every=1))[0]
    plain = study.train_one(spec, job.cache_dir, eval_every=5)
    return probed, plain["final"]["val_loss"], every_step


def test_probe_on_a_gloo_run_leaves_training_unchanged(corpus_cache):
    """Fails if the probe is not called at every ``every``-th step, or if it changes the run."""
    for probed, plain, every_step in run_workers(_probed_and_plain, 2, str(corpus_cache)):
        # probing every step: each step but the last has what it applied (the next call reads it)
        assert [p["step"] for p in every_step["probes"] if "applied" in p] == [0, 1, 2, 3]
        assert [p["step"] for p in probed["probes"]] == [0, 2, 4]
        assert probed["final"]["val_loss"] == plain  # bit for bit
        for p in probed["probes"]:
            for name in va.PROBE_VOTES:
                assert all(0.0 <= p[name][r] <= 1.0 for r in va.RATES)
        # two workers cannot outvote each other: every disagreement is a tie, which 4-bit sends as 0 and
        # 1-bit as ±1 ("ties" counts Σ sign(c_i) = 0; the votes also turn exact zeros of c into ±1 votes)
        # the 1-bit run applies the 1-bit vote: what its parameters moved is that vote, rate for rate
        assert [p["step"] for p in probed["probes"] if "applied" in p] == [0, 2]
        assert all(p["applied"] == p["1-bit"] for p in probed["probes"] if "applied" in p)
        for p in probed["probes"]:
            four, one = p["4-bit binary"], p["1-bit"]
            assert four["flip"] == 0 and 0 < four["zero"] and abs(four["zero"] - p["ties"]) < 0.01
            assert one["zero"] == 0 and 0 < one["flip"] < p["ties"] + 0.01


def test_table_says_whether_the_probed_run_equals_the_study_record():
    rates = {n: {r: 0.01 for r in va.RATES} for n in va.PROBE_VOTES}
    rec = {"key": "k", "label": "B=12 1-bit lr=0.0001", "seed": 0, "final": {"val_loss": 2.0}, "wall_s": 3.0,
           "windows": {"0-400": {"ties": 0.1, **rates}}}
    lines = va.table([rec], [{"key": "k", "final": {"val_loss": 2.0}}])
    assert "| B=12 1-bit lr=0.0001 | 0-400 | 10.0 % | 8-bit L1 | 1.00 % | 1.00 % | 1.00 % | 1.00 % |" in lines
    assert "(equal)" in lines[-1]
    assert "(DIFFERS)" in va.table([rec], [{"key": "k", "final": {"val_loss": 2.5}}])[-1]
