"""LocalCub's setting from the link as the harness and the race reach it (lioncub.optim.regime, lioncub.harness.regime):
one rule, the optimizer's own (``aggregation='auto'``); ``lioncub train --local-setting link`` runs it, saves its pick
in the optimizer's checkpoint and resumes it; the compute-bound step timed by real gloo workers."""
import doctest
import inspect
import time

import pytest
import torch

from tests.flat import LocalCub
from lioncub.harness.config import TrainConfig, library_arguments
from lioncub.harness.regime import resolve_setting
from lioncub.optim import regime
from lioncub.optim.regime import AUTO_LR, SETTINGS
from tests.dist import run_workers


def test_the_module_examples_run_and_the_long_setting_is_a_valid_localcub():
    assert doctest.testmod(regime).failed == 0
    options = {k: v for k, v in SETTINGS["long"].items() if k != "lr"}
    inspect.signature(LocalCub).bind([torch.zeros(1)], lr=SETTINGS["long"]["lr"], **options)


def test_the_link_setting_is_the_optimizers_own_auto_setting():
    """``--local-setting link`` is LocalCub(local_steps='auto', aggregation='auto') with AdamW at AUTO_LR, not a second
    rule: the harness builds exactly those arguments, and its label says so."""
    config = resolve_setting(TrainConfig(optimizer="lioncub", local_steps="auto", local_setting="link", steps=10,
                                         eval_every=0, nonfinite="skip"))
    assert (config.lr, config.inner, config.label) == (AUTO_LR, "adamw", "lioncub-link")
    kind, kwargs = library_arguments(config)
    assert kind == "localcub" and (kwargs["local_steps"], kwargs["aggregation"], kwargs["inner"]) == ("auto", "auto",
                                                                                                       "adamw")
    assert kwargs["options"].given() == dict(nonfinite="skip", check_every=0)
    plain = TrainConfig(optimizer="lioncub", local_steps=5, steps=10)
    assert resolve_setting(plain) is plain


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


def _measure_step(rank, world):
    from lioncub.harness.models.gpt import GPT, GPTConfig
    from lioncub.harness.regime import _gpt_loss, measure_step

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    before = [p.detach().clone() for p in model.parameters()]
    loader = _Batches(rank)
    loader.next_batch()

    def loss(m, x, y):  # rank 1 made slower on purpose: every rank must get its time
        if rank == 1:
            time.sleep(NAP)
        return _gpt_loss(m, x, y)
    step_s = measure_step(model, loader, loss=loss)
    untouched = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    no_grads = all(p.grad is None for p in model.parameters())
    return step_s, loader.pos, untouched, no_grads


def test_every_rank_gets_the_slowest_ranks_step_and_nothing_is_changed():
    out = run_workers(_measure_step, 2)
    assert out[0][0] == out[1][0] and out[0][0] >= NAP  # rank 1's step (the slowest), on rank 0 too
    assert all(o[1] == 1 and o[2] and o[3] for o in out)  # loader position, parameters and gradients as they were


def _link_run(rank, world, out, cache, resume):
    from lioncub.harness.train import train_worker

    config = TrainConfig(model="gpt-tiny", batch_size=4, block_size=32, optimizer="lioncub", local_steps="auto",
                         local_setting="link", steps=20, eval_every=0, ckpt_every=10, out=out, cache_dir=cache,
                         progress=False, resume=resume)
    summary = train_worker(config)
    params = [p for p in torch.load(f"{out}/ckpt/step_0000020/model.pt", weights_only=True).values()]
    return summary, params


def test_a_run_on_the_link_setting_picks_in_the_optimizer_and_a_resume_keeps_the_pick(tmp_path, corpus_cache):
    first = run_workers(_link_run, 2, str(tmp_path / "a"), str(corpus_cache), None)
    summary = first[0][0]
    assert summary["local_setting"] == "lowbit"  # loopback: a 2-bit round costs far less than 5 steps
    assert summary["steps"] == 20 and summary["local_steps_picked"] == regime.LOWBIT_H and summary["step_s"] > 0
    resumed = run_workers(_link_run, 2, str(tmp_path / "b"), str(corpus_cache),
                          str(tmp_path / "a" / "ckpt" / "step_0000010"))
    assert resumed[0][0]["local_setting"] == "lowbit"  # the optimizer's checkpoint held the pick
    assert resumed[0][0]["step_s"] == summary["step_s"]  # not timed again: the first run's numbers
    assert resumed[0][0]["final_val_loss"] == summary["final_val_loss"]  # the same run from step 10 on
    assert all(torch.equal(a, b) for a, b in zip(first[0][1], resumed[0][1]))


def test_link_setting_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="local_steps='auto'"):
        TrainConfig(optimizer="lioncub", local_steps=50, local_setting="link", steps=100)
    with pytest.raises(ValueError, match=r"local_setting='link' picks .*: leave bits=4, outer='sgd' at the default"):
        TrainConfig(optimizer="lioncub", local_steps="auto", local_setting="link", steps=10, eval_every=0,
                    outer="sgd", bits=4)
    with pytest.raises(ValueError, match="local_setting"):
        TrainConfig(optimizer="lioncub", local_setting="fast")
    with pytest.raises(ValueError, match="local_setting='link'"):
        TrainConfig(optimizer="lioncub", local_setting="link")  # every step: no local steps to set
