"""A slower worker in the testbed (issue 67, item 1; :mod:`lioncub.testbed.straggler`, docs/stragglers.md).

The sleep rule and the pause schedule are checked exactly at given values (the clock is an argument, the sleep a
recorder: no wall clock); the flags' refusals through each entry point; and one real ``lioncub train`` and one
race run on a 2-rank gloo group, from what they record: the slowed rank slept (F - 1) x its own measured compute
(to float rounding, 1e-9 relative: the recorded sleep is the rule's, summed), the other slept nothing.
"""
from __future__ import annotations

import json

import pytest

from lioncub.cli import main
from lioncub.harness.config import TrainConfig
from lioncub.testbed.straggler import Straggler, check_workers, pauses_due, parse_flags, slowdown_sleep
from tests.dist import run_workers

WORLD = 2


def test_the_sleep_is_factor_minus_one_times_the_measured_compute():
    assert slowdown_sleep(1.5, 0.25) == 0.125
    assert slowdown_sleep(3.0, 0.125) == 0.25
    assert slowdown_sleep(2.0, 0.0375) == 0.0375
    assert slowdown_sleep(1.0, 0.4) == 0.0


def test_the_pause_schedule_at_given_clock_values():
    """One pause at each multiple of T reached, less those taken (T = 10 s)."""
    due = [pauses_due(t, 10.0, taken) for t, taken in
           [(0.0, 0), (9.999, 0), (10.0, 0), (10.0, 1), (19.9, 1), (25.0, 1), (25.0, 0), (30.0, 3), (41.0, 3)]]
    assert due == [0, 0, 1, 0, 0, 1, 2, 0, 1]


def test_a_straggler_sleeps_what_each_step_owes():
    """Factor 2 with a 1 s pause every 10 s of training (its pauses not counted): the calls the loop makes
    (compute, this rank's training seconds so far) and the sleeps asked, exactly."""
    slept = []
    s = Straggler(factor=2.0, pause_s=1.0, every_s=10.0, sleep=slept.append)
    calls = [(0.5, 0.0), (0.25, 4.0), (0.5, 9.5), (0.25, 10.5), (0.5, 11.5), (0.125, 20.5), (0.5, 21.5), (0.25, 42.0)]
    # training seconds less pauses: 0, 4, 9.5, 10.5 (pause 1 due), 10.5, 19.5, 20.5 (pause 2), 40 (pauses 3, 4)
    assert [s.after_backward(c, t) for c, t in calls] == [0.5, 0.25, 0.5, 1.25, 0.5, 0.125, 1.5, 2.25]
    assert slept == [0.5, 0.25, 0.5, 1.25, 0.5, 0.125, 1.5, 2.25]
    assert s.totals() == dict(factor=2.0, pause_s=1.0, every_s=10.0, compute_s=2.875, slept_s=2.875, paused_s=4.0,
                              pauses=4)


def test_only_the_named_rank_is_slowed():
    slept = []
    slow, pause = parse_flags(["1:1.5"], ["2:3:30"], world=4)
    assert (slow, pause) == (((1, 1.5),), ((2, 3.0, 30.0),))
    workers = [Straggler.for_rank(r, slow, pause, sleep=slept.append) for r in range(4)]
    assert [(w.factor, w.pause_s, w.every_s, w.active) for w in workers] == [
        (1.0, 0.0, 0.0, False), (1.5, 0.0, 0.0, True), (1.0, 3.0, 30.0, True), (1.0, 0.0, 0.0, False)]
    assert [w.after_backward(0.5, 0.0) for w in workers] == [0.0, 0.25, 0.0, 0.0]
    assert slept == [0.25]
    assert parse_flags(["0:2,3:1.25", "2:4"]) == (((0, 2.0), (3, 1.25), (2, 4.0)), ())


class _Busy:
    """A method for :class:`~lioncub.harness.loop.Loop` whose backward is a little real compute (no group)."""

    def __init__(self):
        import torch

        self.x = torch.randn(256, 256)

    def backward(self, x, y):
        return float((self.x @ self.x).sum())

    def step(self, lr):
        return True

    def evaluation(self):
        import contextlib

        return contextlib.nullcontext()


def test_the_loop_sleeps_inside_the_step_by_its_measured_compute():
    """The loop hands the straggler each step's measured compute (the StepInfo's), and the sleep is inside the
    step: t_step >= t_slept = 49 x t_compute (a real sleep is never short; outside the step, t_step would be
    about a fiftieth of it)."""
    from lioncub.harness.loop import Loop

    class Loader:
        def next_batch(self):
            return None, None

    infos, straggler = [], Straggler(factor=50.0)
    Loop(lr=lambda step, clock: 0.0, steps=3, on_step=infos.append, straggler=straggler).run(
        _Busy(), Loader(), lambda: {})
    assert len(infos) == 3 and straggler.compute_s == sum(i.t_compute for i in infos) > 0
    for info in infos:
        assert info.t_slept == slowdown_sleep(50.0, info.t_compute) > 0
        assert info.t_step >= info.t_slept + info.t_compute


BAD = [  # (argv after the entry point's own, the one line's text)
    (["--slow-worker", "1"], "--slow-worker 1: expected RANK:FACTOR, e.g. 1:1.5"),
    (["--slow-worker", "one:2"], "--slow-worker one:2: RANK must be a worker's rank, an int >= 0, got 'one'"),
    (["--slow-worker", "1:fast"], "--slow-worker 1:fast: FACTOR must be a number, got 'fast'"),
    (["--slow-worker", "1:0.5"], "--slow-worker 1:0.5: FACTOR must be >= 1 (1: no slowdown; 1.5: compute takes 1.5x"),
    (["--slow-worker", "1:inf"], "--slow-worker 1:inf: the numbers must be finite"),
    (["--slow-worker=-1:2"], "--slow-worker -1:2: RANK must be an int >= 0, got -1"),
    (["--slow-worker", "1:2", "--slow-worker", "1:3"], "--slow-worker 1:3: rank 1 is given twice; one entry per rank"),
    (["--pause-worker", "1:2"], "--pause-worker 1:2: expected RANK:S:T (a pause of S seconds every T seconds)"),
    (["--pause-worker", "1:0:10"], "--pause-worker 1:0:10: S and T must be > 0 seconds"),
    (["--pause-worker", "0:1:-5"], "--pause-worker 0:1:-5: S and T must be > 0 seconds"),
]
OUT_OF_RANGE = "RANK must be 0..{last} (there are {n} workers), got {rank}"


def _one_error_line(capsys, call, prog="") -> str:
    """The one line argparse ends with (exit 2, no traceback); ``prog``: the program it names (the benches'
    is whatever started Python)."""
    with pytest.raises(SystemExit) as exc:
        call()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"{prog}: error: " if prog else "") and ": error: " in line, err
    return line


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    d = tmp_path_factory.mktemp("straggler")
    (d / "text.txt").write_text("To be, or not to be, that is the question. " * 60)
    return ["--data", str(d / "text.txt"), "--cache-dir", str(d / "cache"), "--out", str(d / "out")]


@pytest.mark.parametrize("extra, message", BAD + [
    (["--slow-worker", "2:1.5"], "--slow-worker 2:1.5: " + OUT_OF_RANGE.format(last=1, n=2, rank=2)),
    (["--pause-worker", "0:1:5,5:1:5"], "--pause-worker 5:1:5: " + OUT_OF_RANGE.format(last=1, n=2, rank=5)),
])
def test_lioncub_train_refuses_a_bad_slowdown_in_one_line(capsys, text, extra, message):
    argv = ["train", "--model", "gpt-tiny", "--steps", "1", "--no-compare", "--nproc", "2", "--no-progress", *text,
            *extra]
    assert message in _one_error_line(capsys, lambda: main(argv), "lioncub train")


def test_the_benches_and_train_config_refuse_the_same(capsys, text):
    from bench import fault_tolerance, race

    for extra, message in BAD[:3] + [(["--slow-worker", "4:2"], OUT_OF_RANGE.format(last=3, n=4, rank=4))]:
        assert message in _one_error_line(capsys, lambda: race.main([*extra, "--report-only", "x"]))
    for extra, message in BAD[-3:] + [(["--pause-worker", "3:1:5"], OUT_OF_RANGE.format(last=2, n=3, rank=3))]:
        assert message in _one_error_line(capsys, lambda: fault_tolerance.main([*extra, "--report-only", "x"]))
    line = _one_error_line(capsys, lambda: main(["train", "--ft", "--model", "gpt-tiny", "--no-progress", *text,
                                                 "--slow-worker", "3:2"]), "lioncub train")
    assert "--slow-worker 3:2: " + OUT_OF_RANGE.format(last=2, n=3, rank=3) in line  # --replicas 3
    with pytest.raises(ValueError, match=r"slow_workers 1:0.5: FACTOR must be >= 1"):
        TrainConfig(slow_workers=((1, 0.5),))
    with pytest.raises(ValueError, match=r"pause_workers: each entry must be \(rank, seconds, every\)"):
        TrainConfig(pause_workers=((1, 2.0),))
    with pytest.raises(ValueError, match=r"slow_workers 1:3: rank 1 is given twice"):
        check_workers([(1, 2.0), (1, 3.0)], ())
    # JSON's lists (ft_config.json, a checkpoint's meta) come back as the typed tuples
    assert TrainConfig(slow_workers=[[1, 2]], pause_workers=[[0, 1, 5]]).slow_workers == ((1, 2.0),)


FACTOR = 2.0


def _slowed_runs(rank, world, out, data_dir):
    """``lioncub train`` (in-process on this group, as tests/test_cli_flags.py runs it) with rank 1 FACTOR x
    slower, then the race's run (``bench.race.train_one``) with the same slowdown; the race's record."""
    import os

    from bench import race
    from tests.test_loop import _race_args

    argv = ["train", "--model", "gpt-tiny", "--batch-size", "2", "--block-size", "16", "--steps", "4",
            "--eval-every", "0", "--optimizer", "lioncub", "--vote", "onebit", "--no-progress", "--nproc", str(world),
            "--cache-dir", os.path.dirname(data_dir), "--out", out, "--slow-worker", f"1:{FACTOR:g}"]
    assert main(argv) == 0
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    args = _race_args(slow_workers=((1, FACTOR),), pause_workers=())
    return race.train_one(args, "lioncub-onebit", 1e-3, 0, data_dir)


def _assert_only_rank_1_slept(workers):
    """Rank 1 slept (FACTOR - 1) x its own compute (to 1e-9 relative), within its training seconds; rank 0
    slept nothing."""
    assert [w["factor"] for w in workers] == [1.0, FACTOR]
    fast, slow = workers
    assert fast["compute_s"] > 0 and fast["slept_s"] == 0.0 and fast["paused_s"] == 0.0
    assert slow["compute_s"] > 0 and slow["slept_s"] == pytest.approx((FACTOR - 1) * slow["compute_s"], rel=1e-9)
    assert slow["paused_s"] == 0.0 and slow["pauses"] == 0
    assert slow["train_s"] >= slow["compute_s"] + slow["slept_s"]  # the sleep is inside its steps (never short)


def test_a_real_run_slows_the_named_worker_alone(tmp_path, corpus_cache):
    out = str(tmp_path / "run")
    data_dir = str(corpus_cache / "shakespeare-bytes")
    race_runs = run_workers(_slowed_runs, WORLD, out, data_dir, timeout_s=120.0)
    records = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    (train,) = [r["workers"] for r in records if r["kind"] == "straggler"]
    assert [w["rank"] for w in train] == [0, 1]
    _assert_only_rank_1_slept(train)
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 4 and all(r["t_slept"] == 0.0 for r in steps)  # rank 0's own steps
    summary = next(iter(__import__("csv").DictReader(open(f"{out}/summary.csv"))))
    assert summary["stragglers"] == "--slow-worker 1:2"
    assert summary["worker_slept_s"].split(";")[0] == "0.000"
    from bench.race import merge

    (merged,) = merge([[run] for run in race_runs])
    _assert_only_rank_1_slept(merged["straggler"])
    assert merged["steps"] == 4 and merged["status"] == "ok"


@pytest.mark.slow
def test_lioncub_train_ft_slows_the_named_replica_alone(tmp_path):
    """``lioncub train --ft --slow-worker 2:2`` (3 replicas, loopback, to round 4: ~10 s): replica 2's final
    line and the summary record its sleep, (2 - 1) x its compute; the others slept nothing."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torchft")
    out = tmp_path / "ft"
    cmd = [sys.executable, "-m", "lioncub.cli", "train", "--ft", "--model", "gpt-tiny", "--local-steps", "5",
           "--batch-size", "2", "--block-size", "32", "--budget", "300", "--ft-stop-round", "4",
           "--slow-worker", "2:2", "--out", str(out), "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replica 2 slowed" in done.stdout and "replica 0 slowed" not in done.stdout
    workers = json.loads((out / "ft_summary.json").read_text())["summary"]["straggler"]
    assert [w["factor"] for w in workers] == [1.0, 1.0, 2.0]
    assert all(w["compute_s"] > 0 and w["slept_s"] == 0.0 for w in workers[:2])
    assert workers[2]["slept_s"] == pytest.approx(workers[2]["compute_s"], rel=1e-9) and workers[2]["slept_s"] > 0
    assert workers[2]["train_s"] >= workers[2]["compute_s"] + workers[2]["slept_s"]
