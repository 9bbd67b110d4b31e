"""LocalCub's setting from the link (lioncub.optim.regime, lioncub.harness.regime): the switch between short and
long rounds, exact at its boundary, and the measurement agreed by real gloo workers."""
import doctest
import inspect
import math
import time

import pytest
import torch

from tests.flat import LocalCub
from lioncub.engine.cost import collective_time
from lioncub.harness.config import TrainConfig
from lioncub.optim import regime
from lioncub.optim.regime import SETTINGS, SHORT_H, pick_setting
from tests.dist import run_workers

BETA = 2.0 ** -20  # s/bit: powers of two keep the boundary's arithmetic exact


def test_the_switch_is_the_short_rounds_share_of_ten_steps_exactly():
    n, P = 1000, 4
    lanes = 2 * (P - 1) / P * n * 8 * BETA  # one all-reduce of 8-bit lanes, no latency
    at = lanes / (0.5 * SHORT_H)  # the step at which it is exactly half of 10 steps
    edge = pick_setting(n, P, 0.0, BETA, at)
    assert edge.name == "short" and edge.short_round_s == lanes
    assert edge.r == 20.0  # an fp32 all-reduce is 4 lanes' worth: the switch sits at r = 20 without latency
    below = pick_setting(n, P, 0.0, BETA, at * (1 - 1e-9))
    assert below.name == "long" and below.r > 20.0
    assert pick_setting(n, P, 0.0, BETA, at, round_share=0.25).name == "long"  # a smaller share wants longer rounds
    assert edge.options == SETTINGS["short"] and below.options == SETTINGS["long"]


def test_r_and_the_round_are_priced_by_the_ring_model_with_latency():
    n, P, alpha, beta, step = 834_304, 3, 2e-4, 1e-8, 0.04
    pick = pick_setting(n, P, alpha, beta, step)
    assert pick.r == pytest.approx(collective_time("allreduce", 4 * n, P, alpha, beta) / step, rel=1e-12)
    assert pick.short_round_s == pytest.approx(4 * alpha + 4 / 3 * n * 8 * beta, rel=1e-12)
    assert pick.as_dict() == dict(name=pick.name, r=pick.r, step_s=step, short_round_s=pick.short_round_s,
                                  alpha=alpha, beta=beta, round_share=0.5)
    assert pick.name in pick.text() and f"r = {pick.r:.1f}" in pick.text()
    pick.options["lr"] = 1.0  # a copy: the table is not changed through a pick
    assert SETTINGS[pick.name]["lr"] != 1.0
    assert pick_setting(n, 1, alpha, beta, step).name == "short"  # one worker: nothing crosses a link
    assert doctest.testmod(regime).failed == 0


@pytest.mark.parametrize("kw, named", [
    (dict(n_params=0), "n_params"), (dict(world_size=True), "world_size"), (dict(alpha=-1.0), "alpha"),
    (dict(beta=math.nan), "beta"), (dict(step_s=math.inf), "step_s"), (dict(round_share=0.0), "round_share"),
    (dict(round_share=1.5), "round_share")])
def test_bad_arguments_are_refused_by_name(kw, named):
    args = dict(n_params=10, world_size=2, alpha=0.0, beta=1e-9, step_s=0.01)
    share = kw.pop("round_share", None)
    args.update(kw)
    with pytest.raises(ValueError, match=named):
        pick_setting(**args, **({} if share is None else dict(round_share=share)))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_setting_is_a_valid_localcub_and_harness_configuration(name):
    from lioncub.harness.regime import apply_setting

    options = {k: v for k, v in SETTINGS[name].items() if k != "lr"}
    inspect.signature(LocalCub).bind([torch.zeros(1)], lr=SETTINGS[name]["lr"], **options)
    from lioncub.harness.compare import LOCALCUB

    start = TrainConfig(optimizer="lioncub", **{**LOCALCUB, "local_steps": "auto"}, min_local_steps=50, steps=10,
                        eval_every=0)
    pick = pick_setting(1000, 4, 0.0, BETA, 1.0 if name == "short" else 1e-6)
    assert pick.name == name
    config = apply_setting(start, pick)
    for key, value in SETTINGS[name].items():
        assert getattr(config, key) == value, key
    assert config.quantizer == SETTINGS[name].get("quantizer")  # the lanes' L1 quantizer gone with the lanes
    assert config.min_local_steps == SETTINGS[name].get("min_local_steps", TrainConfig.min_local_steps)


class _Batches:
    """A deterministic stream of token batches with a position (the loader protocol measure_step restores)."""

    def __init__(self, rank):
        self.rank, self.pos = rank, 0

    def next_batch(self):
        g = torch.Generator().manual_seed(1000 * self.rank + self.pos)
        self.pos += 1
        x = torch.randint(0, 64, (2, 16), generator=g)
        return x, torch.roll(x, -1, dims=1)

    def state_dict(self):
        return dict(pos=self.pos)

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


NAP = 0.1
"""Seconds rank 1's every timed step sleeps: its step is the slowest by far (rank 0's own takes a few
milliseconds: 2-8 ms measured on a loaded 2-core host, a twelfth of the nap or less)."""


def _setting_from_link(rank, world):
    from lioncub.harness.models.gpt import GPT, GPTConfig
    from lioncub.harness.regime import _gpt_loss, setting_from_link

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    before = [p.detach().clone() for p in model.parameters()]
    loader = _Batches(rank)
    loader.next_batch()

    def loss(m, x, y):  # rank 1 made slower on purpose: every rank must price the step by its time
        if rank == 1:
            time.sleep(NAP)
        return _gpt_loss(m, x, y)
    pick = setting_from_link(model, loader, loss=loss)
    untouched = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    no_grads = all(p.grad is None for p in model.parameters())
    return pick.as_dict(), loader.pos, untouched, no_grads, sum(p.numel() for p in model.parameters())


def test_every_rank_picks_the_same_setting_from_the_slowest_ranks_numbers():
    out = run_workers(_setting_from_link, 2)
    picks = [o[0] for o in out]
    assert picks[0] == picks[1]  # the step and the link are the slowest rank's: one setting
    assert all(o[1] == 1 and o[2] and o[3] for o in out)  # loader position, parameters and gradients as they were
    p = picks[0]
    assert p["step_s"] >= NAP, p  # rank 1's step (the slowest), on rank 0 too: rank 0's own is milliseconds
    assert p["beta"] >= 0
    again = pick_setting(out[0][4], 2, p["alpha"], p["beta"], p["step_s"])
    assert again.as_dict() == p  # the pick is the pure function of the agreed numbers


def _link_run(rank, world, out, cache, resume):
    import lioncub.harness.regime as harness_regime
    from lioncub.harness.train import train_worker

    if resume:  # a resumed run takes its checkpoint's pick: measuring again would fail here
        def measured(*a, **k):
            raise AssertionError("a resumed run measured the link again")
        harness_regime.setting_from_link = measured
    config = TrainConfig(model="gpt-tiny", batch_size=4, block_size=32, optimizer="lioncub", local_steps="auto",
                         local_setting="link", steps=20, eval_every=0, ckpt_every=10, out=out, cache_dir=cache,
                         progress=False, resume=resume)
    summary = train_worker(config)
    params = [p for p in torch.load(f"{out}/ckpt/step_0000020/model.pt", weights_only=True).values()]
    return summary, params


def test_a_run_on_the_link_setting_saves_its_pick_and_a_resume_keeps_it(tmp_path, corpus_cache):
    import json

    first = run_workers(_link_run, 2, str(tmp_path / "a"), str(corpus_cache), None)
    summary = first[0][0]
    assert summary["local_setting"] == "short"  # loopback: an 8-bit round costs far less than 10 steps
    assert summary["steps"] == 20 and summary["regime_r"] > 0
    with open(tmp_path / "a" / "ckpt" / "step_0000010" / "meta.json") as f:
        meta = json.load(f)
    assert meta["local_setting"]["name"] == "short" and meta["config"]["local_steps"] == SHORT_H
    assert meta["config"]["lr"] == SETTINGS["short"]["lr"] and meta["config"]["outer"] == "sgd"
    resumed = run_workers(_link_run, 2, str(tmp_path / "b"), str(corpus_cache),
                          str(tmp_path / "a" / "ckpt" / "step_0000010"))
    assert resumed[0][0]["local_setting"] == "short"
    assert resumed[0][0]["final_val_loss"] == summary["final_val_loss"]  # the same run from step 10 on
    assert all(torch.equal(a, b) for a, b in zip(first[0][1], resumed[0][1]))


def test_link_setting_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="local_steps='auto'"):
        TrainConfig(optimizer="lioncub", local_steps=50, local_setting="link", steps=100)
    with pytest.raises(ValueError, match="steps must be a multiple"):
        TrainConfig(optimizer="lioncub", local_steps="auto", local_setting="link", steps=105, eval_every=0)
    with pytest.raises(ValueError, match="local_setting"):
        TrainConfig(optimizer="lioncub", local_setting="fast")
    with pytest.raises(ValueError, match="local_setting='link'"):
        TrainConfig(optimizer="lioncub", local_setting="link")  # every step: no local steps to set
    with pytest.raises(ValueError, match="name one of"):
        regime.SettingPick.from_dict({"name": "medium"})
