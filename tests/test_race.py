"""bench/race.py's schedule and its report over seeds, bench/race_report.py (pure functions; the race needs root)."""
from __future__ import annotations

import math

import pytest

from bench import race, race_report


def _run(method, lr, seed, vals, every=10.0, mb_per_s=1e6):
    evals = [dict(t=i * every, step=10 * i, val=v, tx=i * every * mb_per_s, train=v) for i, v in enumerate(vals)]
    return dict(method=method, lr=lr, seed=seed, status="ok", n_params=1, steps=evals[-1]["step"], evals=evals)


def test_lr_factor_warms_up_then_follows_the_schedule():
    assert race.lr_factor(0, 0.0, 10, "constant", 0.1) == pytest.approx(0.1)
    assert race.lr_factor(50, 0.7, 10, "constant", 0.1) == 1.0
    assert race.lr_factor(50, 0.0, 10, "cosine", 0.1) == 1.0
    assert race.lr_factor(50, 0.5, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert race.lr_factor(50, 1.0, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert race.lr_factor(50, 3.0, 10, "cosine", 0.1) == pytest.approx(0.1)  # past the budget: the floor


def test_summary_picks_the_best_lr_by_mean_over_seeds_and_reports_mean_and_std():
    runs = [
        # reference: lr 1e-4 ends at 2.0 and 2.2 (mean 2.1); lr 3e-4 is better on one seed, worse on average
        _run("lion-ddp", 1e-4, 0, [3.0, 2.5, 2.0]), _run("lion-ddp", 1e-4, 1, [3.0, 2.6, 2.2]),
        _run("lion-ddp", 3e-4, 0, [3.0, 2.4, 1.9]), _run("lion-ddp", 3e-4, 1, [3.0, 2.9, 2.9]),
        # a method that reaches A = 2.1 on both seeds (at 15 s and at 20 s), and one that never does
        _run("fast", 1e-3, 0, [3.0, 1.9, 1.8]), _run("fast", 1e-3, 1, [3.0, 2.3, 2.1]),
        _run("slow", 1e-3, 0, [3.0, 2.8, 2.7]),
    ]
    s = race_report.summarize(runs, budget=20.0)
    assert s["target"] == pytest.approx(2.1) and s["target_half"] == pytest.approx((2.5 + 2.6) / 2)
    rows = {r["method"]: r for r in s["rows"]}
    ref = rows["lion-ddp"]
    assert ref["lr"] == 1e-4 and ref["seeds"] == 2
    assert ref["lrs_tried"] == {1e-4: pytest.approx(2.1), 3e-4: pytest.approx(2.4)}
    assert ref["final_val_std"] == pytest.approx(math.sqrt(0.02))
    fast = rows["fast"]
    # seed 0 crosses 2.1 a tenth of the way from 10 s (3.0 -> 1.9 over 10 s: 9/11 of it), seed 1 at 20 s
    t0, t1 = 9 / 11 * 10, 20.0
    assert fast["reached_target"] == 2 and fast["time_to_target"] == pytest.approx((t0 + t1) / 2)
    assert fast["time_to_target_std"] == pytest.approx(abs(t1 - t0) / math.sqrt(2))
    assert fast["bytes_to_target"] == pytest.approx((t0 + t1) / 2 * 1e6)
    assert rows["slow"]["reached_target"] == 0 and rows["slow"]["time_to_target"] is None
    table = race_report.table(s)
    assert "2.100 ± 0.141" in table and "(2/2)" in table and "not reached" in table


def test_best_lr_is_chosen_on_the_seeds_every_lr_ran():
    # the protocol: an lr grid on seed 0, then seeds 1 and 2 at seed 0's best only; the later seeds
    # (worse here) must not hand the win to an lr that ran one seed
    runs = [_run("m", 1e-3, 0, [3.0, 2.0]), _run("m", 1e-3, 1, [3.0, 2.5]), _run("m", 1e-3, 2, [3.0, 2.5]),
            _run("m", 2e-3, 0, [3.0, 2.1])]
    row = race_report.summarize(runs, budget=10.0)["rows"][0]
    assert row["lr"] == 1e-3 and row["seeds"] == 3
    assert row["final_val"] == pytest.approx(7.0 / 3)
    assert row["lrs_tried"] == {1e-3: pytest.approx(2.0), 2e-3: pytest.approx(2.1)}


def test_mean_curve_bands_the_seeds_on_a_common_grid():
    a, b = _run("m", 1e-3, 0, [3.0, 2.0, 1.0]), _run("m", 1e-3, 1, [3.0, 2.4, 1.4])
    grid, mean, std, mb = race_report.mean_curve([a, b], budget=20.0, every=10.0)
    assert list(grid) == [0.0, 5.0, 10.0, 15.0, 20.0]
    assert mean[2] == pytest.approx(2.2) and mean[3] == pytest.approx((1.5 + 1.9) / 2)
    assert std[0] == 0.0 and std[2] == pytest.approx(0.4 / math.sqrt(2))
    assert mb[4] == pytest.approx(20.0)


def test_the_link_setting_row_is_the_optimizers_auto_setting_at_its_raced_lr():
    from argparse import Namespace

    from bench.race import LINK, _runs, cub_config
    from lioncub.harness.config import library_arguments
    from lioncub.optim.regime import AUTO_LR

    args = Namespace(lr_adamw="1e-3", lr_lion="3e-4", seeds="0,1", methods=f"{LINK},diloco-h50@2e-3")
    assert _runs(args) == [(LINK, None, 0), ("diloco-h50", 2e-3, 0), (LINK, None, 1), ("diloco-h50", 2e-3, 1)]
    with pytest.raises(ValueError, match=f"{LINK} takes its lr"):
        _runs(Namespace(**{**vars(args), "methods": f"{LINK}@1e-3"}))
    config = cub_config(LINK, AUTO_LR, 0)
    kind, kwargs = library_arguments(config)
    assert (config.lr, config.inner, kind) == (AUTO_LR, "adamw", "localcub")
    assert (kwargs["local_steps"], kwargs["aggregation"]) == ("auto", "auto")  # picked in the run, by the optimizer


def test_the_no_communication_row_sets_each_rows_step_rate_seed_by_seed():
    runs = [_run("lion-ddp", 1e-4, 0, [3.0, 2.5, 2.0]), _run("lion-ddp", 1e-4, 1, [3.0, 2.6, 2.2])]
    for seed, steps in ((0, 40), (1, 50)):  # 20 s each: 2.0 and 2.5 steps a second
        runs.append(dict(_run(race_report.COMPUTE_ROW, 1e-3, seed, [3.0, 2.9, 2.8]), steps=steps))
        runs[-1]["evals"][-1]["step"] = steps
    rows = {r["method"]: r for r in race_report.summarize(runs, budget=20.0)["rows"]}
    # lion-ddp: 20 steps in 20 s on both seeds: 1.0 / 2.0 and 1.0 / 2.5
    assert rows["lion-ddp"]["of_compute_row"] == pytest.approx(0.45)
    assert rows["lion-ddp"]["of_compute_row_std"] == pytest.approx(0.05 * math.sqrt(2))
    assert rows[race_report.COMPUTE_ROW]["of_compute_row"] == 1.0
    assert "0.45 ± 0.07" in race_report.table(race_report.summarize(runs, budget=20.0))
    assert race_report.summarize(runs[:2], budget=20.0)["rows"][0]["of_compute_row"] is None  # not run: none


def test_the_loopback_reference_sets_the_headline_ratio_seed_by_seed():
    """``--reference-loopback``: its mean loss at half the budget is the target, its mean time to it the unit; each
    row's ratio is mean ± std over the seeds that reached it, computed here by hand from the evaluations."""
    # the reference (unshaped), 2 seeds, evaluations every 10 s over a 40 s budget: at 20 s (half) 2.4 and 2.6,
    # so the target is 2.5; seed 0 crosses it at 10 + 10*(2.8-2.5)/(2.8-2.4) = 17.5 s, seed 1 (2.6 at 20 s, 2.4 at
    # 30 s) at 20 + 10*(2.6-2.5)/(2.6-2.4) = 25 s; the unit is (17.5 + 25) / 2 = 21.25 s
    loop = dict(method="adamw-ddp@0.002", load_avg_before=[1.0, 1, 1], load_avg_after=[2.0, 2, 2],
                runs=[_run("adamw-ddp", 2e-3, 0, [3.0, 2.8, 2.4, 2.2, 2.1]),
                      _run("adamw-ddp", 2e-3, 1, [3.0, 2.9, 2.6, 2.4, 2.3])])
    runs = [_run("lion-ddp", 1e-4, 0, [3.0, 2.9, 2.8, 2.7, 2.6]),
            # crosses 2.5 at 10 + 10*(3.0-2.5)/(3.0-2.0) = 15 s (seed 0) and 30 + 10*(2.7-2.5)/(2.7-2.3) = 35 s
            _run("cub", 1e-3, 0, [3.0, 3.0, 2.0, 1.9, 1.8]), _run("cub", 1e-3, 1, [3.0, 2.9, 2.8, 2.7, 2.3])]
    s = race_report.summarize(runs, budget=40.0, target_method="lion-ddp", loopback=loop)
    assert s["loopback"]["loss"] == pytest.approx(2.5) and s["loopback"]["seconds"] == pytest.approx(21.25)
    rows = {r["method"]: r for r in s["rows"]}
    want = [15.0 / 21.25, 35.0 / 21.25]
    assert rows["cub"]["reached_loopback"] == 2
    assert rows["cub"]["x_loopback"] == pytest.approx(sum(want) / 2)
    assert rows["cub"]["x_loopback_std"] == pytest.approx(abs(want[1] - want[0]) / math.sqrt(2))
    assert rows["lion-ddp"]["x_loopback"] is None and rows["lion-ddp"]["reached_loopback"] == 0
    table = race_report.table(s)
    assert "x DDP-loopback" in table and f"{sum(want) / 2:.2f} ± " in table and "(2/2)" in table
    assert race_report.summarize(runs, budget=40.0, target_method="lion-ddp")["loopback"] is None
