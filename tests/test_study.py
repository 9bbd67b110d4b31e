"""bench/study.py: its tie-rule runs apply their rule (element for element), and the study end to end.

The end-to-end run is tiny (2 workers, one seed, 2 steps per run) and goes through the same
code as the real study: spawned gloo group, records appended to JSONL, report tables and PNGs.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.dist import run_workers

from bench import study, study_plan, study_report
from lioncub.harness.method import make_optimizer


def _tie_steps(rank, world):
    """One step of every ``ties`` run's optimizer (as the study builds it) on a gradient with
    exact zeros and ties; u element for element against reference_vote with the run's rule."""
    import torch.distributed as dist

    from lioncub.votes.api import reference_vote

    specs = [s for s in study_plan.plan(["ties"], [0], 2, 2) if s.tie_rule is not None]
    out = {}
    for spec in specs:
        for step in range(2):
            if step == 0:
                p = torch.nn.Parameter(torch.zeros(1001))
                opt = make_optimizer(study.config_for(spec).replace(lr=0.5), [p])
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
        assert set(res) == {(r, s) for r in study_plan.TIE_RULES for s in (0, 1)}, res
        assert all(ok for ok, _ in res.values()), res
        assert min(ties for _, ties in res.values()) > 100  # two workers tie often: the rule is exercised


def test_plan_and_errors():
    specs = study_plan.plan(study_plan.PARTS, [0, 1], 5, 3)
    keys = [s.key() for s in specs]
    assert len(specs) > len(set(keys))  # shared runs (Lion at β2=0.99, 4-bit no sync) are planned twice
    assert {s.part for s in specs} == set(study_plan.PARTS)
    assert all(s.steps == 3 for s in specs if s.model != "gpt")
    ties = [s for s in specs if s.part == "ties" and s.tie_rule is not None]
    assert {s.tie_rule for s in ties} == set(study_plan.TIE_RULES) and all(s.vote == "onebit" for s in ties)
    with pytest.raises(ValueError, match="tie must be one of"):
        study.config_for(study_plan.Spec("ties", "bad", vote="onebit", tie_rule="random"))


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
    # Δ to Lion recomputed here from the raw records (not from summarize's rows): the 4-bit
    # row's reference is the Lion row of its part (same model, β2 = 0.95, untied), and the
    # ties row (β2 = 0.99, tied) has no Lion row with its β2 and tying among these records.
    final = {r["label"]: r["final"]["val_loss"] for r in records}
    tied = {row["label"]: row for row in summary["tied"]}
    assert set(tied) == {"Lion b2=0.95", "4-bit, sync none, b2=0.95"}
    assert tied["Lion b2=0.95"]["val_loss"] == (final["Lion b2=0.95"], None)  # one seed: no std
    four = tied["4-bit, sync none, b2=0.95"]
    assert four["val_loss"] == (final["4-bit, sync none, b2=0.95"], None)
    assert (four["vs_ref"]["ref"], four["vs_ref"]["ref_part"]) == ("Lion b2=0.95", "tied")
    want = final["4-bit, sync none, b2=0.95"] - final["Lion b2=0.95"]
    assert want != 0.0  # two different optimizers: a row compared with itself would give 0
    assert four["gap_to_lion"] == pytest.approx(want, rel=0, abs=1e-12)
    assert tied["Lion b2=0.95"]["gap_to_lion"] == 0.0  # the reference row itself
    ties = {row["label"]: row for row in summary["ties"]}
    assert ties["1-bit, ties minus"]["gap_to_lion"] is None and ties["1-bit, ties minus"]["vs_ref"] is None
    paths = study_report.plot(summary, str(tmp_path / "fig"))
    assert all(os.path.getsize(p) > 1000 for p in paths)
    assert "| 1-bit, ties minus | 1 | 2 |" in study_report.markdown(summary)
    json.dumps(summary)


def _adamw_step(rank, world):
    """The recipe's AdamW reference: one step of the harness's ``--optimizer adamw`` method (gradient
    all-reduce, then AdamW) equals torch's AdamW on the mean gradient (two ranks: (a + b) / 2 is the same
    sum in either order, so exactly)."""
    from lioncub.harness.method import make_method

    spec = [s for s in study_plan.recipe_plan([0], steps=4) if s.optimizer == "adamw"][0]
    p = torch.nn.Parameter(torch.ones(64))
    method = make_method(study.config_for(spec), torch.nn.Module(), [{"params": [p], "lr": spec.lr}])
    grads = [torch.randn(64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    p.grad = grads[rank].clone()
    method.step(spec.lr)
    q = torch.nn.Parameter(torch.ones(64))
    q.grad = (grads[0] + grads[1]) / 2
    torch.optim.AdamW([q], lr=spec.lr, betas=(0.9, 0.99)).step()
    return torch.equal(p.detach(), q.detach()), type(method.opt).__name__


def test_recipe_part_applies_its_shape_schedule_and_optimizers():
    """Fails if the recipe's shape, weight decay, warm-up or AdamW reference are not applied."""
    specs = study_plan.recipe_plan([0, 1])
    assert [s.label for s in specs][:10] == ["AdamW (nanoGPT)", "Lion lr=0.0001 wd=1", "Lion lr=3e-05 wd=3",
                                            "Lion lr=0.0003 wd=0.3", "Lion lr=0.0001 wd=0.3", "Lion lr=0.0001 wd=3",
                                            "Lion lr=0.0001 wd=0.1", "1-bit (onebit)", "4-bit binary (pbit)",
                                            "8-bit L1 (pbit)"]
    assert len(specs) == 10 + 5  # the grid's edges on the first seed only
    assert [(s.lr, s.weight_decay) for s in specs[1:7]] == [(1e-4, 1.0), (3e-5, 3.0), (3e-4, 0.3), (1e-4, 0.3),
                                                          (1e-4, 3.0), (1e-4, 0.1)]
    assert [s.label for s in specs[10:]][:2] == ["AdamW (nanoGPT)", "Lion lr=0.0001 wd=1"]
    assert all((s.layers, s.heads, s.embd, s.block, s.batch, s.steps, s.warmup) == (4, 4, 128, 64, 3, 2000, 100)
               for s in specs)
    from lioncub.harness.models import build_gpt

    model = study._model(specs[0], {"vocab_size": 65})
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in build_gpt("gpt-mini", vocab_size=65, block_size=64).parameters())
    assert study.lr_at(49, 2000, 100, floor=0.1) == 0.5 and study.lr_at(1999, 2000, 100, floor=0.1) < 0.11
    lion = specs[1]
    groups = study.param_groups(model, lr=lion.lr, weight_decay=lion.weight_decay)
    assert max(g["weight_decay"] for g in groups) == 1.0
    assert run_workers(_adamw_step, 2) == [(True, "AdamW")] * 2


# ----------------------------------------------------------------------------- the report, on synthetic records
# final val loss per (label, seed) of fake recipe runs; the curve ends at it (step 400), with step 200 at +1.
_RECIPE_FINAL = {
    "AdamW (nanoGPT)": {0: 1.80, 1: 1.90, 2: 2.00},  # mean 1.90, std 0.1
    "Lion lr=0.0001 wd=1": {0: 2.10, 1: 2.12, 2: 2.14},  # the reference: mean 2.12, std 0.02
    "Lion lr=3e-05 wd=3": {0: 2.50},  # the grid's edges: seed 0 only
    "Lion lr=0.0003 wd=0.3": {0: 2.30},
    "Lion lr=0.0001 wd=0.3": {0: 2.40},  # the decay alone at the best lr: seed 0 only
    "Lion lr=0.0001 wd=3": {0: 2.60},
    "Lion lr=0.0001 wd=0.1": {0: 2.70},
    "1-bit (onebit)": {0: 2.20, 1: 2.22, 2: 2.24},  # +0.10 vs Lion: beyond noise (2σ = 0.0327)
    "4-bit binary (pbit)": {0: 2.13, 1: 2.17},  # two seeds: +0.03, std 0.0283 -> 2σ = 0.0462: within
    "8-bit L1 (pbit)": {0: 2.11, 1: 2.13, 2: 2.15},  # +0.01: within noise
}


def _no_nan(text: str) -> bool:
    import re

    return re.search(r"\bnan\b", text, re.IGNORECASE) is None  # ("nanoGPT" is a word of its own)


def _fake_record(spec, final: float, wall: float = 10.0) -> dict:
    from dataclasses import asdict

    curve = [{"step": 200, "val_loss": final + 1.0}, {"step": spec.steps, "val_loss": final}]
    return {"key": spec.key(), **asdict(spec), "world": 4, "final": curve[-1], "train_loss_last20": final,
            "curve": curve, "skipped_steps": 0, "wall_s": wall + spec.seed, "params": 1000}


def _recipe_records(steps: int = 400) -> list[dict]:
    out = []
    for spec in study_plan.recipe_plan([0, 1, 2], steps=steps):
        final = _RECIPE_FINAL[spec.label].get(spec.seed)
        if final is not None:
            out.append(_fake_record(spec, final))
    return out


def _write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_report_recipe_rows_means_deltas_and_verdicts(tmp_path):
    """Fails if recipe records are not matched to the recipe plan (by key, with their own step
    count, next to tiny-study records of another step count), or if a mean, std, Δ or verdict is
    wrong, or if any table cell says nan."""
    import dataclasses

    records = _recipe_records()
    # a decoy: a recipe-labelled record of another experiment (other lr) must not join the Lion row
    decoy = dataclasses.replace(study_plan.recipe_plan([0], steps=400)[1], lr=5e-4)
    records.append(_fake_record(decoy, 9.0))
    # tiny-study records in the same file, first, so the first gpt record is not a recipe one
    lion = study_plan.Spec("quant", "Lion (grad all-reduce)", seed=0, steps=150)
    records.insert(0, _fake_record(lion, 3.3))
    path = _write_jsonl(tmp_path / "recipe.jsonl", records)
    summary = study_report.summarize(study_report.read_jsonl(path, partial=True))
    rows = {r["label"]: r for r in summary["recipe"]}
    assert list(rows) == list(_RECIPE_FINAL)  # every label, in plan order
    for label, finals in _RECIPE_FINAL.items():
        r = rows[label]
        assert r["seeds"] == sorted(finals) and r["steps"] == 400
        assert math.isclose(r["val_loss"][0], sum(finals.values()) / len(finals), abs_tol=1e-12)
        assert math.isclose(r["wall_s"], 10.0 + sum(finals) / len(finals), abs_tol=1e-12)
        assert r["curve"]["step"] == [200, 400]
        assert math.isclose(r["curve"]["val_loss"][0], r["val_loss"][0] + 1.0, abs_tol=1e-12)
    assert math.isclose(rows["AdamW (nanoGPT)"]["val_loss"][1], 0.1, rel_tol=1e-9)
    assert math.isclose(rows["Lion lr=0.0001 wd=1"]["val_loss"][1], 0.02, rel_tol=1e-9)
    assert math.isclose(rows["4-bit binary (pbit)"]["val_loss"][1], 0.04 / math.sqrt(2), rel_tol=1e-9)
    assert rows["Lion lr=3e-05 wd=3"]["val_loss"][1] is None  # one seed: no std
    assert summary["quant"][0]["seeds"] == [0] and summary["quant"][0]["steps"] == 150

    one = rows["1-bit (onebit)"]["vs_ref"]
    assert one["ref"] == "Lion lr=0.0001 wd=1" and math.isclose(one["delta"], 0.10, abs_tol=1e-12)
    assert math.isclose(one["noise"], 2 * math.sqrt(0.02 ** 2 / 3 + 0.02 ** 2 / 3), rel_tol=1e-9)
    assert one["verdict"] == "beyond noise"
    four = rows["4-bit binary (pbit)"]["vs_ref"]
    assert math.isclose(four["delta"], 0.03, abs_tol=1e-12) and four["verdict"] == "within noise"
    assert rows["8-bit L1 (pbit)"]["vs_ref"]["verdict"] == "within noise"
    assert rows["Lion lr=3e-05 wd=3"]["vs_ref"]["verdict"] == "n/a (one seed)"
    lion_vs_adamw = rows["Lion lr=0.0001 wd=1"]["vs_adamw"]
    assert math.isclose(lion_vs_adamw["delta"], 0.22, abs_tol=1e-12) and lion_vs_adamw["verdict"] == "beyond noise"
    assert rows["AdamW (nanoGPT)"]["vs_adamw"] is None

    text = study_report.markdown(summary)
    assert _no_nan(text)
    assert "### recipe" in text and "### quant" in text
    assert "| 1-bit (onebit) | 3 | 400 | 2.2200 ± 0.0200 | +0.1000 (2σ 0.0327) | beyond noise |" in text
    assert ("| Lion lr=0.0001 wd=1 | 3 | 400 | 2.1200 ± 0.0200 | 0 (reference) | — | +0.2200 (2σ 0.1178) "
            "| beyond noise |") in text
    assert "| Lion lr=3e-05 wd=3 | 1 | 400 | 2.5000 ± n/a | +0.3800 | n/a (one seed) |" in text
    assert "| Lion lr=0.0001 wd=0.3 | 1 | 400 | 2.4000 ± n/a | +0.2800 | n/a (one seed) |" in text
    assert "not the planned best" not in text
    # a grid point with a lower mean than the planned best is named under the table
    better = [dict(r, final={"val_loss": 2.0}) if r["label"] == "Lion lr=0.0001 wd=0.1" else r for r in records]
    note = study_report.markdown(study_report.summarize(better))
    assert "lowest mean is Lion lr=0.0001 wd=0.1 (2.0000 ± n/a, 1 seeds), not the planned best" in note
    assert "| 8-bit L1 (pbit) | 3 | 400 | 2.1300 ± 0.0200 | +0.0100 (2σ 0.0327) | within noise |" in text
    assert "2·sqrt(sd_a²/n_a + sd_b²/n_b)" in text
    paths = study_report.plot(summary, str(tmp_path / "fig"))
    assert str(tmp_path / "fig" / "recipe.png") in paths
    assert all(os.path.getsize(p) > 1000 for p in paths)
    json.dumps(summary, allow_nan=False)  # the summary has no nan either


def test_report_no_nan_without_lion_or_with_one_seed(tmp_path):
    """The old '+nan' Δ: a ties part without its own Lion row borrows the quant part's Lion
    (same shape); with no Lion at all, or one seed, the cells say n/a, never nan."""
    ties = [s for s in study_plan.plan(["ties"], [0, 1], 150, 60)]
    final = {"1-bit, ties plus": 3.30, "1-bit, ties minus": 3.29, "1-bit, ties alternate": 3.31,
             "ties -> 0 (4-bit pbit)": 3.28}
    records = [_fake_record(s, final[s.label] + 0.01 * s.seed) for s in ties]
    alone = study_report.summarize(records)
    text = study_report.markdown(alone)
    assert _no_nan(text) and "n/a (no Lion row)" in text
    assert all(r["gap_to_lion"] is None for r in alone["ties"])
    lion = [study_plan.Spec("quant", "Lion (grad all-reduce)", seed=0, steps=150)]  # one seed of Lion
    summary = study_report.summarize(records + [_fake_record(s, 3.25) for s in lion])
    text = study_report.markdown(summary)
    assert _no_nan(text)
    plus = next(r for r in summary["ties"] if r["label"] == "1-bit, ties plus")
    assert plus["vs_ref"]["ref_part"] == "quant" and math.isclose(plus["gap_to_lion"], 3.305 - 3.25, abs_tol=1e-12)
    assert "| 1-bit, ties plus | 2 | 150 | 3.3050 ± 0.0071 | +0.0550 | n/a (one seed) |" in text
    assert "| Lion (grad all-reduce) | 1 | 150 | 3.2500 ± n/a | 0 (reference) | — |" in text


def test_report_cli_writes_markdown_summary_and_png(tmp_path):
    """The command line on a JSONL a study is still appending to (torn last line)."""
    path = _write_jsonl(tmp_path / "study_recipe.jsonl", _recipe_records())
    with open(path, "a") as f:
        f.write('{"key": "half a rec')
    md, fig = tmp_path / "recipe.md", tmp_path / "fig"
    study_report.main([path, "--figures", str(fig), "--markdown", str(md)])
    text = md.read_text()
    assert text.startswith("### recipe") and _no_nan(text)
    assert "| 4-bit binary (pbit) | 2 | 400 | 2.1500 ± 0.0283 | +0.0300 (2σ 0.0462) | within noise |" in text
    summary = json.loads((tmp_path / "study_recipe_summary.json").read_text())
    assert [r["label"] for r in summary["recipe"]] == list(_RECIPE_FINAL)
    assert os.path.getsize(fig / "recipe.png") > 1000


# ----------------------------------------------------------------------------- the batch and ablate parts
def test_batch_plan_holds_the_token_budget_and_grows_the_lr():
    """Fails if a batch point's shape, token budget, warm-up, weight decay or lr grid is not applied,
    or if later seeds run anything but the first seed's best lr."""
    specs = study_plan.batch_plan([0])
    n_extra = sum(map(len, study_plan.BATCH_EXTEND.values()))
    assert len(specs) == 3 * 4 * 3 + n_extra  # batches x optimizers x lrs, plus the edge extensions
    tokens = {s.batch * 4 * s.steps * s.block for s in specs}
    assert tokens == {12 * 64 * 2000}  # the recipe's ~1.5M tokens at every batch
    assert {(s.batch, s.steps, s.warmup) for s in specs} == {(3, 2000, 100), (12, 500, 25), (48, 125, 6)}
    assert all((s.layers, s.heads, s.embd, s.block) == (4, 4, 128, 64) for s in specs)
    by = {(s.batch, s.label.split()[1]): [] for s in specs}
    for s in specs:
        by[(s.batch, s.label.split()[1])].append(s)
    assert [s.lr for s in by[(3, "AdamW")]] == [5e-4, 1e-3, 2e-3, 4e-3, 8e-3]  # extended above its edge
    assert [s.lr for s in by[(48, "Lion")]] == [2e-4, 4e-4, 8e-4, 1.6e-3, 3.2e-3]  # 4x the batch-12 centre, extended
    assert [s.lr for s in by[(48, "AdamW")]] == [1e-3, 2e-3, 4e-3, 8e-3]  # extended below its edge
    assert [s.lr for s in by[(48, "4-bit")]] == [2e-4, 4e-4, 8e-4, 1.6e-3]  # and above
    assert [s.lr for s in by[(12, "Lion")]] == [1e-4, 2e-4, 4e-4, 8e-4]
    assert all(s.optimizer == "adamw" and s.weight_decay == 0.1 for s in by[(12, "AdamW")])
    assert all(s.vote == "onebit" and s.weight_decay == 1.0 for s in by[(12, "1-bit")])
    assert all(s.vote == "pbit" and s.bits == 4 and s.quantizer is None for s in by[(12, "4-bit")])
    assert all(s.vote == "grad" and s.optimizer == "lion" for s in by[(12, "Lion")])
    # the batch-12 centres are the recipe's runs: the same experiments, so their records are reused
    recipe = {s.key() for s in study_plan.recipe_plan([0])}
    shared = [s.label for s in specs if s.key() in recipe]
    assert shared == ["B=12 AdamW lr=0.001", "B=12 Lion lr=0.0001", "B=12 1-bit lr=0.0001", "B=12 4-bit lr=0.0001"]
    # later seeds: only the best lr of the first seed, and nothing where it is not known yet
    # and 48 sequences for 2000 steps, on every seed, at that best lr only
    later = study_plan.batch_plan([0, 1], best={(12, "Lion"): 2e-4})
    assert [(s.seed, s.label) for s in later[len(specs):]] == [
        (0, "B=48@2000 Lion lr=0.0002"), (1, "B=48 Lion lr=0.0002"), (1, "B=48@2000 Lion lr=0.0002")]
    # with the 12-sequence best known too, the long point runs it as well (2000 steps, like it)
    both = study_plan.batch_plan([0], best={(12, "Lion"): 2e-4, (3, "Lion"): 1e-4, (3, "AdamW"): 1e-3})[len(specs):]
    assert [s.label for s in both] == ["B=48@2000 AdamW lr=0.001", "B=48@2000 Lion lr=0.0001",
                                       "B=48@2000 Lion lr=0.0002"]
    long = later[len(specs)]
    assert (long.batch, long.steps, long.warmup, long.lr, long.weight_decay) == (12, 2000, 100, 2e-4, 1.0)
    assert long.key() != later[len(specs) + 1].key()  # not the 500-step run
    n_long = sum(len(study_plan.batch_grid(o, 12)) for o in study_plan.BATCH_OPTS)
    assert len(study_plan.batch_plan([0, 1], full=True)) == 2 * (len(specs) + n_long)


def test_best_batch_lrs_reads_the_first_seeds_records():
    specs = study_plan.batch_plan([0])
    final = {s.label: 3.0 - (0.1 if s.lr == study_plan.batch_lrs(s.label.split()[1], s.batch)[2] else 0) for s in specs}
    final["B=48 AdamW lr=0.002"] = 1.0  # the AdamW centre wins at 48 sequences
    final["B=192 AdamW lr=0.001"] = 0.5  # an edge extension wins at 192: it must be read too
    records = [_fake_record(s, final[s.label]) for s in specs if not s.label.startswith("B=192 Lion")]
    best = study_plan.best_batch_lrs(records, 0)
    assert best[(12, "AdamW")] == 2e-3 and best[(3, "1-bit")] == 2e-4
    assert best[(48, "AdamW")] == 1e-3
    assert (48, "Lion") not in best  # no record of it: not known
    assert study_plan.best_batch_lrs(records, 1) == {}


def test_left_plateau_is_the_first_evaluation_below_the_exit_loss():
    curve = [{"step": 50, "val_loss": 3.3}, {"step": 100, "val_loss": 3.0}, {"step": 150, "val_loss": 2.99},
             {"step": 200, "val_loss": 3.1}]
    assert study_report.left_plateau(curve) == 150  # below 3.0, not at it; a later rise does not matter
    assert study_report.left_plateau(curve[:2]) is None


def test_momentum_restart_is_not_the_means():
    with pytest.raises(ValueError, match="the 1-bit mean restarts with mean_restart"):
        study_plan.Spec("ablate", "x", vote="onebit", aggregate="mean", momentum_restart=50)
    with pytest.raises(ValueError, match="momentum_restart zeroes the momenta of Lion"):
        study_plan.Spec("ablate", "x", optimizer="adamw", momentum_restart=50)
    assert study_plan.Spec("ablate", "x", vote="onebit", momentum_restart=50).momentum_restart == 50


def test_ablate_plan_applies_each_variant():
    """Fails if an ablation row's optimizer lacks its lanes, quantizer, tie rule, β2 or sync."""
    specs = study_plan.ablate_plan([0])
    want = {"8-bit L1": (8, "l1"), "8-bit L0": (8, "l0"), "8-bit Linf": (8, "linf"), "4-bit binary": (4, None),
            "4-bit Linf": (4, "linf"), "4-bit L1": (4, "l1")}
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    seen = set()
    own = {label: extra for label, _, extra in study_plan.VOTE_QUALITY}  # a variant may carry its own lr, wd
    for s in specs:
        extra = own.get(s.label, {})
        assert (s.lr, s.weight_decay, s.steps, s.batch) == (extra.get("lr", 1e-4), extra.get("weight_decay", 1.0),
                                                            2000, extra.get("batch", 3))
        assert s.sync == "none" or "sync" in s.label
        opt = study.run_optimizer(s, model.parameters(), model)
        assert opt.defaults["betas"][0] == s.beta1 == extra.get("beta1", 0.9), s.label
        if s.aggregate == "mean":  # issue 34's 1-bit mean variants carry their norm and restart to LionCub
            assert (opt.aggregate, opt.config.mean_norm, opt.config.mean_restart) == \
                ("mean", extra.get("mean_norm", "arithmetic"), extra.get("mean_restart", 0)), s.label
        if s.label in want:
            assert (opt.vote, opt.bits, opt.quantizer) == ("pbit", *want[s.label]), s.label
            seen.add(s.label)
        if "ties" in s.label:
            assert opt.vote == "onebit" and opt.tie == s.label.split()[2]
            seen.add(s.label)
        if "sync" in s.label:
            assert opt.vote == "pbit" and opt.bits == 4 and opt.momentum_sync.kind == s.label.split()[2].rstrip(",")
            assert opt.defaults["betas"] == (0.9, float(s.label.split("b2=")[1]))
            seen.add(s.label)
    assert len(seen) == 6 + 4 + 7  # lanes, tie rules (alternate, plus, minus, hold), syncs
    recipe = {s.key() for s in study_plan.recipe_plan([0])}
    assert sorted(s.label for s in specs if s.key() in recipe) == [
        "1-bit, ties alternate (default)", "4-bit binary", "8-bit L1", "Lion lr=0.0001 wd=1"]


def test_report_batch_and_ablate_parts(tmp_path):
    """Batch rows compare with the best AdamW and Lion of their own global batch; reused recipe
    records appear in the recipe, batch and ablate tables alike; no nan."""
    records = _recipe_records(steps=2000)
    grid = study_plan.batch_plan([0])
    for s in grid:
        if s.batch == 12:  # 48 sequences: the 1e-3-family centre is best for AdamW, 2e-4 for Lion
            final = {"AdamW": 2.0, "Lion": 2.2, "1-bit": 2.3, "4-bit": 2.4}[s.label.split()[1]]
            records.append(_fake_record(s, final + (0.0 if s.lr in (2e-3, 2e-4) else 0.1)))
    for seed in (1, 2):
        for s in study_plan.batch_plan([0, seed], best={(12, "AdamW"): 2e-3, (12, "Lion"): 2e-4})[len(grid):]:
            if "@" in s.label:  # the 2000-step runs come below
                continue
            records.append(_fake_record(s, {"AdamW": 2.0, "Lion": 2.2}[s.label.split()[1]] + 0.01 * seed))
    summary = study_report.summarize(records)
    rows = {r["label"]: r for r in summary["batch"]}
    lion48 = rows["B=48 Lion lr=0.0002"]
    assert lion48["seeds"] == [0, 1, 2] and lion48["vs_adamw"]["ref"] == "B=48 AdamW lr=0.002"
    assert math.isclose(lion48["vs_adamw"]["delta"], 0.2, abs_tol=1e-12)
    assert rows["B=48 1-bit lr=0.0002"]["vs_ref"]["ref"] == "B=48 Lion lr=0.0002"
    assert rows["B=12 Lion lr=0.0001"]["seeds"] == [0, 1, 2]  # the recipe's Lion records, reused
    assert lion48["left_plateau"] == [500, 500, 500]  # 3.2 at step 200, 2.2 at 500: below 3.0 only at 500
    assert rows["B=12 Lion lr=0.0001"]["vs_adamw"]["ref"] == "B=12 AdamW lr=0.001"
    text = study_report.markdown(summary)
    assert _no_nan(text) and "### batch" in text
    assert "| 48 (500) | 2.010 ± 0.010 (3) @ 0.002 | 2.210 ± 0.010 (3) @ 0.0002; +0.200 (beyond noise) |" in text
    assert "| 192 (125) | — | — | — | — |" in text
    assert "| B=48 Lion lr=0.0002 | 3 | 500 |" in text and "| 500 / 500 / 500 |" in text
    assert "| 48 (2000) | — | — | — | — |" in text  # no long record yet
    long = [s for s in study_plan.batch_plan([0], best={(12, "AdamW"): 2e-3, (12, "Lion"): 2e-4}) if s.steps == 2000
            and s.batch == 12]
    records += [_fake_record(s, {"AdamW": 1.8, "Lion": 1.85}[s.label.split()[1]]) for s in long]
    rows = {r["label"]: r for r in study_report.summarize(records)["batch"]}
    assert rows["B=48@2000 Lion lr=0.0002"]["vs_adamw"]["ref"] == "B=48@2000 AdamW lr=0.002"
    assert rows["B=48@2000 Lion lr=0.0002"]["vs_ref"]["ref"] == "B=48@2000 Lion lr=0.0002"
    assert rows["B=48 Lion lr=0.0002"]["vs_adamw"]["ref"] == "B=48 AdamW lr=0.002"  # not the long row
    text = study_report.markdown(study_report.summarize(records))
    assert "| 48 (2000) | 1.800 ± n/a (1) @ 0.002 | 1.850 ± n/a (1) @ 0.0002; +0.050 (n/a (one seed)) |" in text
    abl = {r["label"]: r for r in summary["ablate"]}
    assert abl["8-bit L1"]["seeds"] == [0, 1, 2] and abl["8-bit L1"]["vs_ref"]["ref"] == "Lion lr=0.0001 wd=1"
    paths = study_report.plot(summary, str(tmp_path / "fig"))
    assert str(tmp_path / "fig" / "batch_tokens.png") in paths
    json.dumps(summary, allow_nan=False)
