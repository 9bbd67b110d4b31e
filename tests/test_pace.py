"""``Options(pace='timed')``: LocalCub's rounds of a time (:mod:`lioncub.optim.pace`, docs/stragglers.md), on real
gloo groups of 3-4 workers.

Each worker's clock is the test's own (``opt._clock``): before each ``step()`` a rank's clock moves by its chosen
step time, so a rank slowed on purpose takes a known count of steps, with no wall-clock margin. The weighted Δ is
checked against a float64 reference written from the docstring's math: with SGD inside, Δ_i = s_i·lr·g_i, and
θ_s ← θ_s − Σ_i (s_i/Σs)·Δ_i; every value is a dyadic rational of few bits (θ0 in quarters, lr 1/4, g_i in
eighths, Σs = 16), so the fp32 round (``Mean()``: the all-reduce's sum, then / P) is exact and the comparison is equality.
"""
from __future__ import annotations

import io

import pytest
import torch

from lioncub import LionCub, LocalCub, Options, Streaming
from lioncub.aggregations import Mean, ScatterMean, SignVote
from lioncub.optim.localcub import round_settings
from tests.dist import run_workers

H, LR = 5, 0.25
PATTERN = torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 1.0, 2.0])


def _grad(rank: int) -> torch.Tensor:
    """Rank i's gradient, every step: (i + 1)/8 · PATTERN."""
    return PATTERN * (rank + 1) / 8


def _timed(params, **kw) -> LocalCub:
    return LocalCub(params, lr=LR, local_steps=kw.pop("local_steps", H), aggregation=kw.pop("aggregation", Mean()),
                    inner=lambda groups: torch.optim.SGD(groups), options=Options(pace="timed"), **kw)


class Clock:
    """A rank's clock: moves by ``step_s`` before each step."""

    def __init__(self, step_s: float, now: float = 0.0):
        self.step_s, self.now = step_s, now

    def __call__(self) -> float:
        return self.now


def _round(opt, param, clock, rank: int, most: int = 1000) -> int:
    """Steps until this rank's round ends; the count."""
    for k in range(1, most + 1):
        clock.now += clock.step_s
        param.grad = _grad(rank).clone()
        opt.step()
        if opt.synced:
            return k
    raise AssertionError("the round did not end")


# ------------------------------------------------------------------ the weighted mean, exactly
STEP_S = [1.0, 1.0, 1.0, 5.0]  # rank 3 is 5x slower: T = 5 · lower median = 5 s, its rounds 1 step


def _weighted(rank, world):
    param = torch.nn.Parameter(torch.arange(8, dtype=torch.float32) / 4)
    opt = _timed([param])
    opt._clock = clock = Clock(STEP_S[rank])
    out = []
    for _ in range(3):
        mine = _round(opt, param, clock, rank)
        out.append(dict(mine=mine, pace=opt.last_round_pace, theta=param.detach().double().tolist()))
    return out


def test_a_slowed_worker_takes_fewer_steps_and_its_delta_weighs_by_them():
    res = run_workers(_weighted, 4)
    expected_steps = [[5, 5, 5, 5], [5, 5, 5, 1], [5, 5, 5, 1]]
    theta = torch.arange(8, dtype=torch.float64) / 4  # the float64 reference, from the docstring's math
    for r, steps in enumerate(expected_steps):
        deltas = [s * LR * _grad(i).double() for i, s in enumerate(steps)]
        theta = theta - sum(s / sum(steps) * d for s, d in zip(steps, deltas))
        for rank in range(4):
            got = res[rank][r]
            assert got["mine"] == steps[rank], (r, rank)
            assert got["pace"]["steps"] == steps, (r, rank)  # who contributed how much: the same on every rank
            assert got["pace"]["budget_s"] == 5.0
            assert torch.equal(torch.tensor(got["theta"], dtype=torch.float64), theta), (r, rank)
    assert res[3][0]["pace"]["step_s"] == STEP_S  # each rank's mean step seconds, gathered


# ------------------------------------------------------------------ slower than the budget, round after round
def _many_rounds(rank, world, streaming):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8))
    opt = _timed([param], aggregation=ScatterMean(bits=2), local_steps=4, streaming=streaming)
    opt._clock = clock = Clock([0.125, 1.0, 100.0][rank])  # T = 4 · 1: rank 0 would take 32, rank 2 one step
    seen = []
    for _ in range(8):
        _round(opt, param, clock, rank)
        seen.append(opt.last_round_pace["steps"])
    if streaming:
        opt.flush()
    return seen, param.detach().clone()


@pytest.mark.parametrize("streaming", [False, True])
def test_a_worker_slower_than_the_round_time_still_sends_a_step_each_round_and_nothing_waits(streaming):
    res = run_workers(_many_rounds, 3, streaming, timeout_s=60.0)
    for seen, _ in res:
        assert seen == [[4, 4, 4]] + [[16, 4, 1]] * 7  # the fast rank stops at the cap, 4·H
    assert all(torch.equal(res[0][1], p) for _, p in res)  # the replicas stay identical


# ------------------------------------------------------------------ resume mid-round
RESUME_S = [1.0, 1.0, 1.0, 2.0]  # T = 5 s: rank 3 takes 3 steps a round (2 s each)


def _resume(rank, world):
    def fresh():
        torch.manual_seed(0)
        return torch.nn.Parameter(torch.randn(8))

    param = fresh()
    opt = _timed([param])
    opt._clock = clock = Clock(RESUME_S[rank])
    for _ in range(3):
        _round(opt, param, clock, rank)
    straight = (param.detach().clone(), opt.last_round_pace)

    param = fresh()
    opt = _timed([param])
    opt._clock = clock = Clock(RESUME_S[rank])
    _round(opt, param, clock, rank)
    for _ in range(2):  # two steps into round 1 on every rank (rank 3: 4 s of its 5)
        clock.now += clock.step_s
        param.grad = _grad(rank).clone()
        opt.step()
        assert not opt.synced
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)

    param = torch.nn.Parameter(torch.zeros(8))  # a new process's model and optimizer, its clock elsewhere
    opt = _timed([param])
    opt._clock = clock = Clock(RESUME_S[rank], now=1000.0)
    opt.load_state_dict(saved)
    rest = [_round(opt, param, clock, rank) for _ in range(2)]
    return straight, (param.detach().clone(), opt.last_round_pace), rest


def test_a_timed_round_resumes_mid_round_from_its_checkpoint():
    for rank, (straight, resumed, rest) in enumerate(run_workers(_resume, 4)):
        assert rest[0] == [3, 3, 3, 1][rank]  # the rest of round 1: its seconds already in were kept
        assert resumed[1] == straight[1] and straight[1]["steps"] == [5, 5, 5, 3]
        assert torch.equal(resumed[0], straight[0])


# ------------------------------------------------------------------ 'auto' at the rounds' own pace
# local_steps='auto' on a known link (beta 0): round_s = 2 ring all-reduces (the round's head and Mean's exchange) of
# 2(P - 1) messages each = 4·3·alpha = 6 s for P = 4. H = clamp(ceil(round_s / (share · t)), least, most) by hand:
# timed, t = t_ref = the lower median of [1, 1, 1, 5] = 1 s -> ceil(6 / 0.5) = 12 and T = 12 · 1 = 12 s (rank 3:
# ceil(12 / 5) = 3 steps a round); slowest, t = 5 s (rank 3's) -> ceil(6 / 2.5) = 3, and 3 steps everywhere.
AUTO_LINK = dict(alpha=0.5, beta=0.0, min_local_steps=3, max_local_steps=100)
AUTO_ROUND_S, AUTO_STEPS = 4 * 3 * 0.5, {"timed": 12, "slowest": 3}


def _auto(rank, world, pace):
    import lioncub.optim.auto_steps as auto_steps

    def run(step_s: float, now: float, saved=None):
        param = torch.nn.Parameter(torch.arange(8, dtype=torch.float32) / 4)
        opt = LocalCub([param], lr=LR, local_steps="auto", aggregation=Mean(), inner=lambda g: torch.optim.SGD(g),
                       options=Options(pace=pace, **AUTO_LINK))
        clock = Clock(step_s, now)
        opt._clock = clock  # the timed rounds' clock; the synchronous first round reads perf_counter: this one too
        auto_steps.time = type("Time", (), {"perf_counter": staticmethod(clock)})
        if saved is not None:
            opt.load_state_dict(saved)
        return opt, param, clock

    opt, param, clock = run(STEP_S[rank], 0.0)
    rounds = [_round(opt, param, clock, rank) for _ in range(2)]
    pick = dict(opt.steps_pick)
    budget = getattr(opt, "budget_s", None)
    clock.now += clock.step_s  # one step into the third round, then a checkpoint
    param.grad = _grad(rank).clone()
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    opt, param, clock = run(3.0, 1000.0, torch.load(io.BytesIO(buf.getvalue()), weights_only=True))  # 3 s steps now
    rest = [_round(opt, param, clock, rank) for _ in range(2)]
    return dict(rounds=rounds, pick=pick, budget=budget, rest=rest, resumed=(dict(opt.steps_pick), opt.H,
                                                                              getattr(opt, "budget_s", None)))


@pytest.mark.parametrize("pace", ["timed", "slowest"])
def test_auto_picks_h_at_the_rounds_pace_the_median_step_when_timed_the_slowest_when_not(pace):
    res = run_workers(_auto, 4, pace)
    H = AUTO_STEPS[pace]
    for rank, out in enumerate(res):
        assert out["pick"]["round_s"] == AUTO_ROUND_S and out["pick"]["H"] == H, (rank, out["pick"])
        assert out["pick"] == res[0]["pick"]  # every rank the same pick, from the same numbers
        assert out["resumed"] == (out["pick"], H, out["budget"])  # the checkpoint kept it: nothing re-timed
        if pace == "timed":
            assert out["pick"]["step_s"] == 1.0 and out["budget"] == 12.0  # t_ref, and T = H · t_ref
            assert out["rounds"] == [3, [12, 12, 12, 3][rank]]  # the timed first round (3 steps), then T's
            # resumed with 3 s steps: the rest of round 3 (1 s in: 4 more steps; rank 3, 5 s in: 3), then 12 / 3
            assert out["rest"] == [[4, 4, 4, 3][rank], 4]
        else:
            assert out["pick"]["step_s"] == 5.0 and out["budget"] is None
            assert out["rounds"] == [3, 3] and out["rest"] == [2, 3]


# aggregation='auto': the first round is the low-bit rounds' 5 timed steps; pick_rounds by hand from round_s (the
# 2-bit scatter mean's α-β price, whatever the pace) and t: H = max(5, ceil(round_s / t)), low-bit while H <= 50.
def _setting(rank, world, pace):
    import lioncub.optim.auto_steps as auto_steps

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8))
    opt = LocalCub([param], lr=LR, local_steps="auto", aggregation="auto", options=Options(pace=pace, alpha=2.0,
                                                                                          beta=0.0))
    opt._clock = clock = Clock(STEP_S[rank])
    auto_steps.time = type("Time", (), {"perf_counter": staticmethod(clock)})
    rounds = [_round(opt, param, clock, rank) for _ in range(2)]
    return rounds, opt.steps_pick["setting"], getattr(opt, "budget_s", None), param.detach().clone()


@pytest.mark.parametrize("pace", ["timed", "slowest"])
def test_the_setting_from_the_link_prices_its_rounds_at_the_rounds_pace(pace):
    import math

    res = run_workers(_setting, 4, pace)
    round_s = res[0][1]["round_s"]
    t = {"timed": 1.0, "slowest": 5.0}[pace]  # the lower median of STEP_S, or its largest
    H = max(5, math.ceil(round_s / t - 1e-9))
    assert 5 < H <= 50 if pace == "timed" else H == 5  # (alpha 2: the timed pick is not the floor)
    for rank, (rounds, setting, budget, theta) in enumerate(res):
        assert setting == res[0][1] and setting["name"] == "lowbit" and setting["H"] == H, (rank, setting)
        assert setting["step_s"] == t and torch.equal(theta, res[0][3])
        if pace == "timed":
            assert budget == H * t and rounds == [5, H if rank < 3 else math.ceil(H * t / STEP_S[rank])]
        else:
            assert budget is None and rounds == [5, H]


# ------------------------------------------------------------------ the default waits for the slowest
def _slowest(rank, world):
    param = torch.nn.Parameter(torch.arange(8, dtype=torch.float32) / 4)
    opt = LocalCub([param], lr=LR, local_steps=H, aggregation=Mean(), inner=lambda g: torch.optim.SGD(g),
                   options=Options(pace="slowest"))
    opt._clock = clock = Clock(STEP_S[rank])
    counts = [_round(opt, param, clock, rank) for _ in range(3)]
    return counts, opt.last_round_pace, "pace" in opt.state_dict()["local"], "pace" in opt.fingerprint()


def test_pace_slowest_runs_h_steps_on_every_rank_whatever_its_clock():
    for counts, pace, saved, keyed in run_workers(_slowest, 4):
        assert counts == [H] * 3 and pace is None and not saved and not keyed


# ------------------------------------------------------------------ refusals
def test_options_pace_is_checked_and_refused_where_it_cannot_run():
    timed = Options(pace="timed")
    with pytest.raises(ValueError, match=r"Options.pace must be one of \('slowest', 'timed'\)"):
        Options(pace="fast")
    with pytest.raises(ValueError, match="Options.pace does not apply to LionCub"):
        LionCub([torch.nn.Parameter(torch.zeros(2))], options=timed)
    refusals = [
        (dict(manager=object()), "torchft manager"),
        (dict(local_steps="auto", options=Options(pace="timed", min_local_steps=1)), "min_local_steps must be >= 2"),
        (dict(local_steps=1), "local_steps must be an int >= 2 or 'auto'"),
        (dict(aggregation=SignVote()), "needs a mean"),
        (dict(streaming=Streaming(fragments=2), local_steps=4), "streaming must be False or True"),
    ]
    for kw, message in refusals:
        with pytest.raises(ValueError, match=message):
            round_settings(**{"options": timed, **kw})
        assert "\n" not in message
    agg, flags = round_settings(streaming=True, options=timed)  # one round in flight: allowed
    assert flags["pace"] == "timed" and flags["delay"] == 1
    for kw in (dict(local_steps="auto"), dict(local_steps="auto", aggregation="auto")):  # the first round times both
        assert round_settings(**kw, options=timed)[1]["pace"] == "timed"


# ------------------------------------------------------------------ the race's spec and loop
class _Loader:
    def next_batch(self):
        return torch.ones(4, 2), torch.zeros(4, 2)


def test_the_race_spec_takes_timed_and_the_loop_refuses_a_step_count_with_it():
    from lioncub.baselines import build, options
    from lioncub.harness.loop import Loop

    assert options("lcub-smean2-h12-sgd1-ef-adamw-stream-timed")[1]["pace"] == "timed"
    assert "pace" not in options("lcub-smean2-h12-sgd1-ef-adamw-stream")[1]
    method = build("lcub-grad-h4-sgd1-timed", torch.nn.Linear(2, 2), lr=0.1)
    assert method.uneven_steps and method.opt.pace == "timed"
    assert not build("lcub-grad-h4-sgd1", torch.nn.Linear(2, 2), lr=0.1).uneven_steps
    for rule in (dict(steps=10), dict(budget=1.0, eval_every=5)):
        with pytest.raises(ValueError, match="stops and evaluates on the agreed clock"):
            Loop(lr=lambda s, c: 0.1, **rule).run(method, _Loader(), lambda: {})


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x, y):
        return None, ((self.lin(x) - y) ** 2).mean()


def _race_loop(rank, world):
    """The race's loop on a budget with a timed method; rank 1's clock runs 3x as fast (its steps look slow)."""
    from lioncub.baselines import build
    from lioncub.harness.loop import Loop

    method = build("lcub-grad-h4-sgd1-timed", _Net(), lr=0.01)
    if rank == 1:
        clock, t0 = method.opt._clock, method.opt._clock()
        method.opt._clock = lambda: t0 + 3 * (clock() - t0)
    syncs = []
    evals = Loop(lr=lambda s, c: 0.01, budget=0.3, eval_every_s=0.1,
                 on_step=lambda info: info.synced and syncs.append(method.opt.last_round_pace["steps"])
                 ).run(method, _Loader(), lambda: {})
    with method.evaluation():
        final = [p.detach().clone() for p in method.module.parameters()]
    return len(evals), syncs, final


def test_the_race_loop_with_a_timed_method_ends_on_every_rank_at_the_same_sync_point():
    res = run_workers(_race_loop, 2, timeout_s=60.0)
    (n0, syncs0, final0), (n1, syncs1, final1) = res
    assert n0 == n1 and syncs0 == syncs1 and len(syncs0) >= 2
    assert any(s[1] < s[0] for s in syncs0[1:])  # the ranks' steps were uneven (rank 1's rounds shorter)
    assert all(torch.equal(a, b) for a, b in zip(final0, final1))


def _harness_row(rank, world):
    """The race's timed row built as the race builds it: through the harness's factory (lioncub train's)."""
    from bench.race import build_method
    from lioncub.harness.models.gpt import GPT, GPTConfig

    def gpt():
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    method = build_method("lcub-smean2-h4-sgd1-ef-adamw-timed", gpt(), 4e-3, 0)
    plain = build_method("lcub-smean2-h4-sgd1-ef-adamw", gpt(), 4e-3, 0)
    return method.config.pace, method.opt.pace, method.uneven_steps, plain.opt.pace, plain.uneven_steps


def test_the_race_builds_its_timed_row_through_the_harness_and_the_harness_refuses_it_where_it_cannot_run():
    from lioncub.harness.config import TrainConfig, library_arguments

    assert run_workers(_harness_row, 1)[0] == ("timed", "timed", True, "slowest", False)
    with pytest.raises(ValueError, match=r"^pace='timed' apply to local_steps > 1 only"):
        TrainConfig(optimizer="lioncub", pace="timed")  # every step: no rounds to time
    with pytest.raises(ValueError, match=r"^pace='timed' apply to optimizer='lioncub' only"):
        TrainConfig(optimizer="adamw", pace="timed")
    link = TrainConfig(optimizer="lioncub", local_steps="auto", local_setting="link", eval_every=0, pace="timed")
    assert library_arguments(link)[1]["options"].pace == "timed"  # 'auto' picks at the timed rounds' pace
    with pytest.raises(ValueError, match=r"Options.pace must be one of"):
        TrainConfig(optimizer="lioncub", local_steps=5, pace="fast")


# ------------------------------------------------------------------ lioncub train --pace timed
def _train(rank, world, argv):
    from lioncub.cli import main

    assert main(argv) == 0


@pytest.mark.slow
def test_lioncub_train_pace_timed_runs_a_slowed_worker_with_fewer_steps_a_round(tmp_path, corpus_cache):
    """Rank 0 is slowed 4x (--slow-worker): T = 4 · the lower median of the two step times (rank 1's), so rank 0's
    rounds after the first are shorter than H = 4 (the synchronous rounds: 4). Its records are at rounds' ends."""
    import json

    argv = ["train", "--model", "gpt-tiny", "--batch-size", "2", "--block-size", "16", "--local-steps", "4",
            "--vote", "grad", "--pace", "timed", "--slow-worker", "0:4", "--budget", "1.5", "--no-progress",
            "--nproc", "2", "--cache-dir", str(corpus_cache), "--out", str(tmp_path)]
    run_workers(_train, 2, argv, timeout_s=120.0)
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    steps = [r["step"] for r in records if r["kind"] == "step"]
    rounds = [b - a for a, b in zip([0] + steps, steps)]  # rank 0's steps in each round (a record at each end)
    assert rounds[0] == 4 and len(rounds) >= 3, rounds
    assert all(1 <= k <= 16 for k in rounds) and min(rounds[1:]) < 4, rounds  # (16: the cap, 4·H)
    assert sum(r["kind"] == "eval" for r in records) >= 2  # on the agreed clock
