"""``LocalCub(local_steps='auto', aggregation='auto')``: the whole setting from the link, in the optimizer.

The first round is the low-bit rounds' (5 timed steps of the 2-bit scatter mean, outer SGD at 1); at its end
``pick_rounds`` chooses from α, β (given here, so the pick is known) and the slowest rank's step. Low-bit: the
same rounds on with the H it priced (5 on a free link). Long: the 4-bit scatter mean with Nesterov 0.7 and
H >= 50. The references are built independently: the default LocalCub (whose rounds are the low-bit ones at
H = 5) for the free-link run and for the first round of the long one, and an uninterrupted run for a resume in
the middle of a long round.
"""
from __future__ import annotations

import io

import pytest
import torch

import lioncub
from lioncub import Options
from tests.dist import run_workers

LONG = dict(alpha=1.0, beta=1e-6, max_local_steps=20)  # a 2-bit round of ~6 s against 5 steps of ~1 ms: long
SHORT = dict(alpha=0.0, beta=0.0)  # a free link: low-bit rounds at H = 5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _steps(model, opt, rank, first, last, log=None):
    for t in range(first, last):
        g = torch.Generator().manual_seed(1000 * rank + t)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if log is not None and opt.synced:
            log.append((t + 1, opt.H, repr(opt.aggregation), opt.rule.name, opt.rule.lr))


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _auto(model, link):
    return lioncub.LocalCub(model.parameters(), lr=1e-2, local_steps="auto", aggregation="auto",
                            options=Options(**link))


def _long_worker(rank, world):
    import torch.distributed as dist

    a, ref = _model(), _model()
    opt, ref_opt = _auto(a, LONG), lioncub.LocalCub(ref.parameters(), lr=1e-2)  # the default: the low-bit rounds
    log = []
    _steps(a, opt, rank, 0, 5, log)
    _steps(ref, ref_opt, rank, 0, 5)
    first_round = all(torch.equal(p, q) for p, q in zip(a.parameters(), ref.parameters()))
    _steps(a, opt, rank, 5, 35, log)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    _steps(a, opt, rank, 35, 55, log)
    flat = torch.cat([p.detach().reshape(-1) for p in a.parameters()])  # a round's end: identical replicas
    got = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(got, flat)
    _steps(a, opt, rank, 55, 65, log)
    b = _model()
    resumed = _auto(b, LONG)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    _steps(b, resumed, rank, 35, 65)
    return dict(log=log, first_round=first_round, resumed=all(torch.equal(p, q) for p, q in zip(a.parameters(),
                                                                                               b.parameters())),
                identical=all(torch.equal(got[0], t) for t in got), setting=opt.steps_pick["setting"]["name"],
                fingerprint=opt.fingerprint())


def test_a_slow_link_switches_to_long_rounds_after_the_timed_first_round_and_resumes_bit_for_bit():
    for out in run_workers(_long_worker, 2):
        assert out["setting"] == "long" and out["first_round"] and out["identical"] and out["resumed"], out
        assert out["log"] == [(5, 50, "ScatterMean(bits=4)", "nesterov", 0.7),
                              (55, 50, "ScatterMean(bits=4)", "nesterov", 0.7)], out["log"]
        assert out["fingerprint"] == dict(local_steps="auto", aggregation="auto", tie="alternate", delay=0)


def _short_worker(rank, world):
    a, ref = _model(), _model()
    opt, ref_opt = _auto(a, SHORT), lioncub.LocalCub(ref.parameters(), lr=1e-2)
    log = []
    _steps(a, opt, rank, 0, 30, log)
    _steps(ref, ref_opt, rank, 0, 30)
    return dict(log=log, same=all(torch.equal(p, q) for p, q in zip(a.parameters(), ref.parameters())),
                setting=opt.steps_pick["setting"]["name"])


def test_a_free_link_keeps_the_low_bit_rounds_and_equals_the_default_localcub():
    for out in run_workers(_short_worker, 2):
        assert out["setting"] == "lowbit" and out["same"], out
        assert [t for t, *_ in out["log"]] == [5, 10, 15, 20, 25, 30] and {r[1:] for r in out["log"]} == {
            (5, "ScatterMean(bits=2)", "sgd", 1.0)}, out["log"]


def _mismatch_worker(rank, world):
    a, b = _model(), _model()
    long_opt, short_opt = _auto(a, LONG), _auto(b, SHORT)
    _steps(a, long_opt, rank, 0, 12)
    _steps(b, short_opt, rank, 0, 12)
    try:
        short_opt.load_state_dict(long_opt.state_dict())
    except ValueError as exc:
        return str(exc)
    return None


def test_a_checkpoint_of_the_other_setting_is_refused_in_one_line():
    for msg in run_workers(_mismatch_worker, 2):
        assert msg is not None and msg.startswith("state_dict was saved with the long setting; this optimizer "
                                                  "already runs the lowbit one") and "\n" not in msg, msg


@pytest.mark.parametrize("kw", [dict(local_steps=10), dict(local_steps="auto", outer="nesterov"),
                                dict(local_steps="auto", streaming=True),
                                dict(local_steps="auto", options=Options(min_local_steps=50))])
def test_auto_refuses_what_it_would_pick_itself(kw):
    with pytest.raises(ValueError, match=r"^LocalCub: aggregation='auto' picks the whole setting from the link"):
        lioncub.LocalCub([torch.nn.Parameter(torch.zeros(3))], aggregation="auto", **kw)


@pytest.mark.parametrize("round_s, step_s, want", [
    (0.0, 0.04, ("lowbit", 5)),          # a free link
    (0.2, 0.04, ("lowbit", 5)),          # a round of exactly 5 steps' compute
    (0.2001, 0.04, ("lowbit", 6)),       # a hair more: one step more
    (0.48, 0.04, ("lowbit", 12)),        # 12 steps' worth (the 5 Mbit/s race's): H = 12
    (2.0, 0.04, ("lowbit", 50)),         # exactly 50 steps: the last low-bit H
    (2.001, 0.04, ("long", 50)),         # beyond it: long rounds
    (0.1, 0.0, ("long", 50)),            # no compute to hide a round behind
])
def test_the_auto_rule_is_its_docstring(round_s, step_s, want):
    """pick_rounds: the smallest H >= 5 with round <= H·step, low-bit rounds while H <= 50 (the round's α-β time
    is round_seconds of the 2-bit scatter mean's exchange, tested with the scatter mean's plan)."""
    from lioncub.optim.regime import pick_rounds

    assert pick_rounds(round_s, step_s) == want
