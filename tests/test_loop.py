"""The one training loop (lioncub.harness.loop) behind the harness, the study and the race (issue 46).

The study's runs through the loop and the harness's optimizer factory are checked bit for bit against
an independent loop written out here (the study's loop before issue 46: its own optimizer, lr and
evaluation order); the loop's stop and evaluation rules on a fake method without any process group.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.dist import run_workers

from bench import study, study_plan
from lioncub.harness.loop import Loop

# the recipe's optimizers at a 2-layer GPT's size: Lion (the grad all-reduce), the 1-bit vote, the 1-bit mean
# with its restart (here at step 2), AdamW, and the vote with Lion's momentum restarted at step 3
_TINY = dict(layers=2, heads=2, embd=32, block=32, batch=2, steps=6, warmup=2, lr=1e-3, weight_decay=1.0)
SPECS = (study_plan.Spec("recipe", "Lion", **_TINY),
         study_plan.Spec("recipe", "1-bit", vote="onebit", **_TINY),
         study_plan.Spec("ablate", "1-bit mean", vote="onebit", aggregate="mean", mean_restart=2, **_TINY),
         study_plan.Spec("recipe", "AdamW", optimizer="adamw", **dict(_TINY, weight_decay=0.1)),
         study_plan.Spec("ablate", "1-bit rs", vote="onebit", momentum_restart=3, **_TINY))


def _reference_run(spec, cache_dir: str, eval_every: int) -> dict:
    """bench/study.py's run as it was before it used the harness's loop and factory: a plain loop, LionCub
    built by hand, AdamW after a hand-written gradient all-reduce."""
    import torch.distributed as dist

    from tests.flat import LionCub
    from lioncub.harness.models import param_groups
    from lioncub.harness.schedule import lr_at
    from lioncub.harness.train import batch_loss, evaluate

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.seed)
    loader, val, info = study._data(spec, rank, world, cache_dir)
    model = study._model(spec, info)
    groups = param_groups(model, lr=spec.lr, weight_decay=spec.weight_decay)
    base = [g["lr"] for g in groups]
    if spec.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2))
    else:
        mean = dict(aggregate="mean", mean_restart=spec.mean_restart) if spec.aggregate == "mean" else {}
        opt = LionCub(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), vote=spec.vote, seed=spec.seed, model=model,
                      momentum_sync=spec.sync, sync_every=10, nonfinite="skip_step", **mean)
    curve, losses = [], []
    for step in range(spec.steps):
        for g, b in zip(opt.param_groups, base):
            g["lr"] = b * lr_at(step, spec.steps, spec.warmup, floor=0.1)
        if spec.momentum_restart and step == spec.momentum_restart:
            for state in opt.state.values():
                state["exp_avg"].zero_()
        x, y = loader.next_batch()
        loss, _ = batch_loss(model, x, y, True)
        loss.backward()
        if spec.optimizer == "adamw":
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            dist.all_reduce(flat)
            flat /= world
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % eval_every == 0 or step + 1 == spec.steps:
            curve.append({"step": step + 1, **evaluate(model, val, True)})
    return {"curve": curve, "losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def _study_through_the_loop(rank, world, cache_dir, specs):
    out = []
    for spec in specs:
        seen = []
        rec = study.train_one(spec, cache_dir, eval_every=2, probe=lambda step, opt: seen.append(step))
        ref = _reference_run(spec, cache_dir, eval_every=2)
        out.append((spec.label, rec["curve"] == ref["curve"], rec["curve"], ref["curve"], seen))
    return out


@pytest.mark.parametrize("specs", [SPECS[:3], SPECS[3:]], ids=["lion-onebit-mean", "adamw-restart"])
def test_the_study_through_the_harness_loop_is_its_old_loop_bit_for_bit(corpus_cache, specs):
    """Fails if the study's runs through the harness's loop and factory differ by one bit from the plain
    loop it ran before (optimizer options, lr schedule, evaluation steps, the momentum restart, the probe's
    place), or if the runs do not train (the curves must move)."""
    for per_rank in run_workers(_study_through_the_loop, 2, str(corpus_cache), specs):
        for label, equal, got, want, seen in per_rank:
            assert [c["step"] for c in got] == [2, 4, 6], label
            assert equal, (label, got, want)
            assert got[0]["val_loss"] != got[-1]["val_loss"], label
            assert seen == list(range(6)), label


def test_a_changed_loop_is_caught(corpus_cache):
    """The comparison above can fail: the same run at another lr floor differs from the reference."""
    assert run_workers(_shifted_floor, 2, str(corpus_cache)) == [False, False]


def _shifted_floor(rank, world, cache_dir):
    from lioncub.harness import schedule

    spec = dataclasses.replace(SPECS[0], steps=4)
    study.lr_at = lambda step, steps, warmup, floor: schedule.lr_at(step, steps, warmup, 0.5)
    rec = study.train_one(spec, cache_dir, eval_every=2)
    study.lr_at = schedule.lr_at
    return rec["curve"] == _reference_run(spec, cache_dir, eval_every=2)["curve"]


# ----------------------------------------------------------------------------- the rules, on a fake method
class _Loader:
    def next_batch(self):
        return torch.zeros(1), torch.zeros(1)


class _Method:
    """Synced every ``H`` steps; each step takes ``dt`` seconds of a fake clock (no process group: the
    loop agrees the clock only with a budget or timed evaluations)."""

    def __init__(self, H=1):
        self.H, self.n, self.lrs = H, 0, []

    def backward(self, x, y):
        return 1.0

    def step(self, lr):
        self.lrs.append(lr)
        self.n += 1
        return self.n % self.H == 0

    def evaluation(self):
        import contextlib

        return contextlib.nullcontext()


def test_steps_rule_evaluates_at_sync_points_and_stops_at_the_first_sync_past_steps():
    m = _Method(H=4)
    evals = Loop(lr=lambda step, clock: 0.1 * step, steps=10, eval_every=8).run(m, _Loader(), lambda: {"v": m.n})
    assert [e["step"] for e in evals] == [8, 12]  # 12: the first sync point at or after 10 steps
    assert all(e["clock"] is None for e in evals) and m.lrs[:3] == [0.0, 0.1, 0.2]
    starts = Loop(lr=lambda s, c: 1.0, steps=3, eval_at_start=True).run(_Method(), _Loader(), lambda: {})
    assert [e["step"] for e in starts] == [0, 3]


def test_on_eval_can_stop_the_run_and_probe_sees_every_step():
    seen, m = [], _Method()
    loop = Loop(lr=lambda s, c: 1.0, steps=100, eval_every=5, probe=lambda step, method: seen.append(step),
                on_eval=lambda rec: rec["step"] >= 10)
    assert [e["step"] for e in loop.run(m, _Loader(), lambda: {})] == [5, 10]
    assert seen == list(range(10)) and m.n == 10
    with pytest.raises(ValueError, match="steps or a budget"):
        Loop(lr=lambda s, c: 1.0).run(m, _Loader(), lambda: {})


def test_budget_rule_on_a_one_rank_group():
    """The agreed clock (a MAX all-reduce at each sync point) decides the stop and the timed evaluations."""
    results = run_workers(_budget_run, 1)
    (evals, lrs, n), = results
    assert n % 3 == 0 and evals[-1]["clock"] >= 0.05  # stopped at a sync point past the budget
    assert all(b["clock"] > a["clock"] for a, b in zip(evals, evals[1:]))
    assert lrs[0] == 0.0 and lrs[-1] > 0.0  # the lr sees the clock of the last sync point


def _budget_run(rank, world):
    import time

    class Slow(_Method):
        def step(self, lr):
            time.sleep(0.002)
            return super().step(lr)

    m = Slow(H=3)
    evals = Loop(lr=lambda step, clock: clock, budget=0.05, eval_every_s=0.02).run(m, _Loader(), lambda: {})
    return evals, m.lrs, m.n


def test_a_tiny_spec_keeps_its_fields():
    """The recipe's specs map to harness configurations that keep every optimizer field the study sets."""
    for spec in SPECS:
        config = study.config_for(spec)
        assert (config.lr, config.betas, config.seed, config.steps, config.warmup_steps) == \
            (spec.lr, (spec.beta1, spec.beta2), spec.seed, spec.steps, spec.warmup)
    mean = study.config_for(SPECS[2])
    assert (mean.aggregate, mean.mean_restart, mean.tie, mean.nonfinite) == ("mean", 2, "alternate", "skip_step")
    assert study.config_for(dataclasses.replace(SPECS[1], tie_rule="plus")).tie == "plus"
    assert study.config_for(SPECS[3]).optimizer == "adamw"


# ----------------------------------------------------------------------------- the race through the loop
def _race_args(**kw):
    import argparse

    base = dict(layers=1, heads=2, embd=32, block=16, batch=2, eval_batches=1, steps=4, budget=float("inf"),
                eval_every=1e9, warmup=2, schedule="cosine", min_lr_ratio=0.1)
    return argparse.Namespace(**dict(base, **kw))


def _race_reference(args, name, lr, seed, data_dir):
    """The race's run as it was before issue 46: ``lioncub.baselines.build`` (Lion Cub rows included) in a
    plain loop to the first sync point at or after ``args.steps``."""
    from bench import race
    from lioncub import baselines

    model, loader, val = race.setup(args, seed, data_dir)
    method, step, synced = baselines.build(name, model, lr=lr), 0, False
    while not (synced and step >= args.steps):
        method.backward(*loader.next_batch())
        synced = method.step(lr * race.lr_factor(step, step / args.steps, args.warmup, args.schedule, args.min_lr_ratio))
        step += 1
    with method.evaluation():
        return step, race._evaluate(model, val)


def _race_runs(rank, world, data_dir, names):
    import os

    from bench import race

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # unshaped: the bytes are loopback's, only read here
    out = []
    for name in names:
        args = _race_args()
        run = race.train_one(args, name, 2e-3, 0, data_dir)
        out.append((name, run["status"], [(e["step"], e["val"]) for e in run["evals"]],
                    _race_reference(args, name, 2e-3, 0, data_dir), type(race.build_method(name, _tiny_gpt(), 1e-3, 0))
                    .__name__))
    return out


def _tiny_gpt():
    from lioncub.harness.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=256, block_size=16))


def test_the_race_through_the_harness_loop_is_its_old_loop(corpus_cache):
    """Fails if a race run through the harness's loop (a Lion Cub row from the harness's factory, LocalCub
    over rounds of 3 steps, a peer from lioncub.baselines) ends anywhere but the old loop's step and loss:
    the loop's stop at the first sync point past --steps, its lr, and the factory's optimizer."""
    names = ("lioncub-onebit", "lcub-mean8-h3-nest0.7-ef-adamw", "diloco-h10")
    data_dir = str(corpus_cache / "shakespeare-bytes")
    for per_rank in run_workers(_race_runs, 2, data_dir, names):
        for name, status, evals, (ref_step, ref_val), kind in per_rank:
            assert status == "ok" and evals[0][0] == 0, name
            assert evals[-1] == (ref_step, ref_val), (name, evals, ref_step, ref_val)
        kinds = {name: kind for name, *_, kind in per_rank}
        assert kinds == {"lioncub-onebit": "OptimizerMethod", "lcub-mean8-h3-nest0.7-ef-adamw": "OptimizerMethod",
                         "diloco-h10": "DiLoCo"}
