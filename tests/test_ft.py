"""LocalCub on torchft (lioncub.ft): real processes, a lighthouse and three replica groups on loopback.

Each replica is tests/ft_worker.py in its own process (one worker per replica group, gloo through
torchft's ProcessGroupGloo); the lighthouse runs in the test process. Replicas log a line per
committed round: its number, the participants P and contributors C, and a hash of the
parameters' bytes (equal hashes = bit-identical replicas).

Failures are injected at chosen points of a chosen round (lioncub.ft.faults: ``--fault``), never by a
clock, so each test's expected log is exact (docs/fault_tolerance.md, "What each failure does").
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import require  # noqa: E402

os.environ.setdefault("RUST_LOG", "error")  # torchft's lighthouse logs every quorum at INFO
# Probed, not imported: torchft imports triton, and a triton imported at collection without
# TRITON_INTERPRET breaks tests/test_triton.py's interpreter (its kernels call triton.language's own).
require("torchft")

from lioncub.ft import QuorumError, start_lighthouse  # noqa: E402
from tests.flat import FTLocalCub

WORKER = Path(__file__).with_name("ft_worker.py")
HEARTBEAT_MS = 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, replica: int, out: Path, *args: str, lighthouse=None, port=0) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--mode", mode, "--replica", str(replica), "--out", str(out), *args]
    if lighthouse is not None:
        cmd += ["--lighthouse", lighthouse.address()]
    if port:
        cmd += ["--master-port", str(port)]
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(procs, timeout=120) -> None:
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a replica did not finish in time")
        assert p.returncode == 0, f"replica exited {p.returncode}: {err[-3000:]}"


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def rounds_of(path: Path) -> dict[int, dict]:
    return {r["round"]: r for r in records(path) if "done" not in r}


def run_three(tmp_path: Path, mode: str, *args: str, min_replicas: int = 3, tag: str = "") -> list[Path]:
    outs = [tmp_path / f"{mode}{tag}_{r}.jsonl" for r in range(3)]
    if mode == "ft":
        lh = start_lighthouse(min_replicas, heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=3000)
        try:
            finish([launch("ft", r, outs[r], *args, lighthouse=lh) for r in range(3)])
        finally:
            lh.shutdown()
    else:
        port = free_port()
        finish([launch("plain", r, outs[r], *args, port=port) for r in range(3)])
    return outs


CHUNKS = ("--round-chunk", "70", "--scale-block", "32")
"""A round in chunks, the first weight (128 elements) in two slices (tests/test_frozen_and_chunks.py)."""


@pytest.mark.slow
@pytest.mark.parametrize("vote,chunks", [("grad", ()), ("mean8", ()), ("mean8", CHUNKS)],
                         ids=["grad", "mean8", "mean8-chunks"])
def test_no_failure_equals_localcub_on_a_plain_group(tmp_path, vote, chunks):
    """Three replicas on torchft, no failure: every round bit-identical to LocalCub on a 3-rank gloo group (the
    torchft rounds in chunks too: each chunk's d and residual held until the commit)."""
    args = ("--steps", "20", "--H", "4", "--vote", vote)
    ft = [rounds_of(p) for p in run_three(tmp_path, "ft", *args, *chunks)]
    plain = [rounds_of(p) for p in run_three(tmp_path, "plain", *args, *chunks[2:])]  # (whole, the same blocks)
    assert sorted(plain[0]) == list(range(1, 6))
    for r in range(3):
        assert sorted(ft[r]) == sorted(plain[0])
        for k in plain[0]:
            assert ft[r][k]["digest"] == plain[r][k]["digest"] == plain[0][k]["digest"], (r, k)
            assert (ft[r][k]["participants"], ft[r][k]["contributors"]) == (3, 3)
    assert all(ft[r][k]["uncommitted"] == 0 for r in range(3) for k in ft[r])


COMMON = ("--H", "4", "--vote", "mean8", "--step-sleep", "0.03", *CHUNKS)  # failures strike between chunks too
KILLED = 8  # the round in which a fault strikes


def run_faulted(tmp_path, rounds: int, *args: str, restart: int | None = None, exits=None,
                setting: tuple = (), save_at: int | None = None) -> list[dict]:
    """Three replicas on torchft for ``rounds`` committed rounds, each given ``args`` (a ``--fault``
    applies only to the replica it names). ``restart``: the replica killed by a fault, started again
    (without faults) once the survivors committed two rounds without it; they stop together at the
    first commit from round ``rounds`` on after it rejoined. ``exits``: {replica: exit code}
    expected instead of 0. Returns each replica's records by round, the restarted replica's first
    life by round under ``"first_life"`` and its second life's records under ``"after"``, and
    stderr texts under ``"stderr"``. ``setting``: arguments every life of every replica gets (after COMMON's).
    ``save_at``: every replica's first life saves its state after round ``save_at``'s commit (:func:`saved_state`)."""
    lh = start_lighthouse(2, heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=3000)
    outs = [tmp_path / f"faulted_{r}.jsonl" for r in range(3)]
    stop = tmp_path / "stop"
    if restart is None:
        stop.touch()
    common = ("--rounds", str(rounds), "--stop-file", str(stop), *COMMON, *setting)
    args = common + args + (("--save-at", f"{save_at}:{saved_state(tmp_path, '{replica}')}") if save_at else ())
    exits = dict(exits or {})
    try:
        procs = [launch("ft", r, outs[r], *args, lighthouse=lh) for r in range(3)]
        before_restart = 0
        if restart is not None:
            procs[restart].wait(timeout=120)
            assert procs[restart].returncode == -9, procs[restart].stderr.read()[-2000:]
            deadline = time.time() + 60
            while sum(1 for r in records(outs[(restart + 1) % 3]) if r.get("participants") == 2) < 2:
                assert time.time() < deadline, "the survivors did not commit without the dead replica"
                time.sleep(0.1)
            before_restart = len(records(outs[restart]))
            procs[restart] = launch("ft", restart, outs[restart], *common, lighthouse=lh)
            while len(records(outs[restart])) == before_restart:  # its heal's commit: now the others may stop
                assert time.time() < deadline + 120 and procs[restart].poll() is None, "the replica did not rejoin"
                time.sleep(0.1)
            stop.touch()
        errs = {}
        for r, p in enumerate(procs):
            try:
                _, errs[r] = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise AssertionError(f"replica {r} did not finish in time")
            assert p.returncode == exits.get(r, 0), f"replica {r} exited {p.returncode}: {errs[r][-3000:]}"
    finally:
        lh.shutdown()
    logs = [rounds_of(p) for p in outs]
    if restart is None:
        return dict(enumerate(logs), stderr=errs)
    lines = records(outs[restart])
    first = {rec["round"]: rec for rec in lines[:before_restart] if "done" not in rec}
    return dict(enumerate(logs), first_life=first, after=lines[before_restart:], stderr=errs)


def saved_state(tmp_path: Path, replica) -> Path:
    return tmp_path / f"state_{replica}.pt"


def assert_equals_a_run_resumed_without_the_failure(tmp_path, logs, resumed_from: int, survivors=(0, 1),
                                                    setting: tuple = ()) -> list[int]:
    """The survivors' rounds after ``resumed_from`` (the retried round first), up to the last before anyone
    joins them, against the library's plain optimizer on a gloo group of the survivors (no torchft, no quorum,
    nothing fails or is retried) resumed from each one's own state saved at ``resumed_from`` (run_faulted's
    ``save_at``): LocalCub, or LionCub for the every-step vote (``setting`` ``--vote every-...``). Every round
    bit for bit; returns the rounds compared."""
    a = logs[survivors[0]]
    compared = []
    while resumed_from + len(compared) + 1 in a and \
            a[resumed_from + len(compared) + 1]["participants"] == len(survivors):
        compared.append(resumed_from + len(compared) + 1)
    assert compared, f"no round after {resumed_from} on the survivors alone"
    outs = [tmp_path / f"resumed_{r}.jsonl" for r in survivors]
    common = ("--H", "4", "--vote", "mean8", *CHUNKS[2:], *setting, "--rounds", str(compared[-1]),
              "--group", ",".join(str(r) for r in survivors), "--from-ft")
    port = free_port()
    finish([launch("plain", r, out, *common, "--load", str(saved_state(tmp_path, r)), port=port)
            for r, out in zip(survivors, outs)])
    for r, out in zip(survivors, outs):
        resumed = rounds_of(out)
        assert sorted(resumed) == compared, (r, sorted(resumed), compared)
        for k in compared:
            assert resumed[k]["digest"] == logs[r][k]["digest"], (r, k)
    return compared


def assert_survivors_identical(logs, survivors=(0, 1), rounds: int = 0) -> int:
    """Every round from 1 to the last (at least ``rounds``) committed once, in order, bit-identical on
    the survivors; returns the last."""
    a, b = (logs[r] for r in survivors)
    last = max(a)
    assert last >= rounds and sorted(a) == sorted(b) == list(range(1, last + 1))
    assert all(a[k]["digest"] == b[k]["digest"] for k in a)
    return last


def assert_rejoined(logs, replica: int = 2) -> None:
    """The restarted replica's first record is its heal's commit (P = 3, C = 2: it adds Δ = 0), and from
    there it is bit-identical to a survivor at every commit."""
    rejoined = [rec for rec in logs["after"] if "done" not in rec]
    assert rejoined and rejoined[0]["heals"] == 1
    assert (rejoined[0]["participants"], rejoined[0]["contributors"]) == (3, 2)
    assert all(rec["digest"] == logs[0][rec["round"]]["digest"] for rec in rejoined)


@pytest.mark.slow
def test_a_replica_killed_during_its_inner_steps(tmp_path):
    """Killed at the first inner step of round 8: the survivors' round-8 quorum has P = 2 after the heartbeat
    timeout (no collective fails: nothing uncommitted), and the restarted replica heals and is identical."""
    rounds = 60
    logs = run_faulted(tmp_path, rounds, "--fault", f"2:{KILLED}:inner", restart=2)
    last = assert_survivors_identical(logs, rounds=rounds)
    for r in (0, 1):
        assert [logs[r][k]["participants"] for k in (KILLED - 1, KILLED)] == [3, 2]
        assert logs[r][last]["uncommitted"] == 0
    assert max(logs["first_life"]) == KILLED - 1  # its first life ended before round 8's agreement
    assert_rejoined(logs)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["head", "lanes"])
def test_a_replica_killed_inside_the_agreement(tmp_path, point):
    """Killed after round 8's quorum formed, before the head all-reduce or as the lane all-reduce starts:
    that agreement fails on both survivors (one uncommitted each, exactly), is retried with the same Δ on
    a quorum of 2, and commits; the survivors stay identical; the restarted replica heals. The retried
    round and every round after it on the two alone equal, bit for bit, LocalCub on a plain gloo group of
    the two resumed from their own states at round 7: the retry is an ordinary 2-replica round from θ_s,
    its outer state and residuals as round 7 left them (nothing of the failed attempt kept)."""
    rounds = 60
    logs = run_faulted(tmp_path, rounds, "--fault", f"2:{KILLED}:{point}", restart=2, save_at=KILLED - 1)
    last = assert_survivors_identical(logs, rounds=rounds)
    compared = assert_equals_a_run_resumed_without_the_failure(tmp_path, logs, KILLED - 1)
    assert compared[0] == KILLED
    for r in (0, 1):
        assert [(logs[r][k]["participants"], logs[r][k]["contributors"], logs[r][k]["uncommitted"])
                for k in range(1, KILLED)] == [(3, 3, 0)] * (KILLED - 1)
        assert [(logs[r][k]["participants"], logs[r][k]["contributors"]) for k in compared] == [(2, 2)] * len(compared)
        assert {logs[r][k]["uncommitted"] for k in range(KILLED, last + 1)} == {1}  # the one failed attempt
        assert {logs[r][k]["heals"] for k in logs[r]} == {logs[r][1]["heals"]}  # a survivor never heals
        rejoined = compared[-1] + 1  # the restarted replica's heal round: P = 3, C = 2, then all three
        assert (logs[r][rejoined]["participants"], logs[r][rejoined]["contributors"]) == (3, 2)
        assert {(logs[r][k]["participants"], logs[r][k]["contributors"]) for k in range(rejoined + 1, last + 1)} \
            == {(3, 3)}
    assert max(logs["first_life"]) == KILLED - 1
    assert_rejoined(logs)


@pytest.mark.slow
def test_a_replica_killed_after_the_agreement_before_its_commit(tmp_path):
    """Killed after every collective of round 8 finished: the survivors commit round 8 with its Δ
    (P = C = 3, nothing uncommitted) and round 9 without it; the restarted replica heals."""
    rounds = 60
    logs = run_faulted(tmp_path, rounds, "--fault", f"2:{KILLED}:commit", restart=2)
    last = assert_survivors_identical(logs, rounds=rounds)
    for r in (0, 1):
        assert (logs[r][KILLED]["participants"], logs[r][KILLED]["contributors"]) == (3, 3)
        assert logs[r][KILLED + 1]["participants"] == 2 and logs[r][last]["uncommitted"] == 0
    assert max(logs["first_life"]) == KILLED - 1  # it never committed round 8
    assert_rejoined(logs)


def test_a_round_committed_by_one_survivor_and_not_another(tmp_path):
    """Replica 1's own should_commit fails in round 8 while 0 and 2 commit it (what a collective that
    fails on one side only produces). Replica 1 logs no round 8: at its retry it is one commit behind,
    heals from a peer (its Δ is void: C = 2 in round 9) and commits round 9 with the others. Every
    round of every replica is bit-identical to the others'; nothing lost, nothing twice (the heal is
    counted as one, see test_the_supervisor_summary_on_hand_made_logs)."""
    rounds = 12
    logs = run_faulted(tmp_path, rounds, "--fault", f"1:{KILLED}:commit:error")
    for r in (0, 2):
        assert sorted(logs[r]) == list(range(1, rounds + 1))
        assert (logs[r][KILLED]["participants"], logs[r][KILLED]["contributors"]) == (3, 3)
        assert (logs[r][KILLED + 1]["participants"], logs[r][KILLED + 1]["contributors"]) == (3, 2)
        assert logs[r][rounds]["uncommitted"] == 0 and logs[r][rounds]["heals"] == logs[r][1]["heals"]
    assert sorted(logs[1]) == [k for k in range(1, rounds + 1) if k != KILLED]
    assert logs[1][KILLED + 1]["heals"] == logs[1][KILLED - 1]["heals"] + 1
    assert logs[1][KILLED + 1]["uncommitted"] == 1
    for k in logs[1]:
        assert logs[1][k]["digest"] == logs[0][k]["digest"] == logs[2][k]["digest"], k


@pytest.mark.slow
def test_running_out_of_attempts_is_a_quorum_error(tmp_path):
    """max_attempts=2 and replica 1's commit failing in round 8 and again, healed, in round 9: it stops
    with QuorumError naming max_attempts; the others commit on, identical, without it from round 10.
    The survivors never fail an agreement (nothing uncommitted, no heal): round 8 has every Δ (C = 3),
    round 9 all but replica 1's, void after its heal (P = 3, C = 2), then the two alone; and from round 10
    on they equal LocalCub on a plain gloo group of the two resumed from their states at round 9."""
    rounds = 14
    logs = run_faulted(tmp_path, rounds, "--max-attempts", "2", "--fault", f"1:{KILLED}:commit:error",
                       "--fault", f"1:{KILLED + 1}:commit:error", exits={1: 3}, save_at=KILLED + 1)
    assert "did not commit in 2 agreements (max_attempts)" in logs["stderr"][1]
    assert max(logs[1]) == KILLED - 1
    last = assert_survivors_identical(logs, (0, 2), rounds=rounds)
    compared = assert_equals_a_run_resumed_without_the_failure(tmp_path, logs, KILLED + 1, survivors=(0, 2))
    assert compared == list(range(KILLED + 2, last + 1))
    for r in (0, 2):
        assert [(logs[r][k]["participants"], logs[r][k]["contributors"]) for k in range(1, last + 1)] == \
            [(3, 3)] * KILLED + [(3, 2)] + [(2, 2)] * (last - KILLED - 1)
        assert {(logs[r][k]["uncommitted"], logs[r][k]["heals"]) for k in logs[r]} == {(0, logs[r][1]["heals"])}


@pytest.mark.slow
def test_a_non_finite_round_under_torchft_equals_the_plain_group(tmp_path):
    """Replica 1's gradient is NaN at inner step 30 (round 8): every replica drops round 8 (skipped = 1,
    parameters back to θ_s), redoes it, and every record equals LocalCub's on a plain 3-rank group
    with the same NaN, bit for bit."""
    args = ("--steps", "40", "--H", "4", "--vote", "mean8", "--nan-at", "1:30")
    ft = run_three(tmp_path, "ft", *args)
    plain = run_three(tmp_path, "plain", *args)
    for r in range(3):
        got = [(x["round"], x["skipped"], x["digest"]) for x in records(ft[r]) if "done" not in x]
        assert got == [(x["round"], x["skipped"], x["digest"]) for x in records(plain[r]) if "done" not in x]
        assert got == [(k, 0, got[k - 1][2]) for k in range(1, KILLED)] + [(KILLED - 1, 1, got[KILLED - 2][2])] + \
            [(k, 1, got[k][2]) for k in range(KILLED, 11)]  # round 7, its skip (θ_s again), then rounds 8-10
        assert got == [(x["round"], x["skipped"], x["digest"]) for x in records(ft[0]) if "done" not in x]


@pytest.mark.slow
def test_resume_from_a_checkpoint_under_torchft(tmp_path):
    """Three replicas train 3 rounds and save; relaunched from their checkpoints they train 3 more:
    bit-identical to 6 uninterrupted rounds."""
    args = ("--H", "4", "--vote", "mean8")
    whole = [rounds_of(p) for p in run_three(tmp_path, "ft", "--steps", "24", *args, tag="whole")]
    lh = start_lighthouse(3, heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=3000)
    outs = [tmp_path / f"resume_{r}.jsonl" for r in range(3)]
    ckpts = [tmp_path / f"ckpt_{r}.pt" for r in range(3)]
    try:
        finish([launch("ft", r, outs[r], "--steps", "12", "--save", str(ckpts[r]), *args, lighthouse=lh)
                for r in range(3)])
        finish([launch("ft", r, outs[r], "--steps", "24", "--load", str(ckpts[r]), *args, lighthouse=lh)
                for r in range(3)])
    finally:
        lh.shutdown()
    for r in range(3):
        resumed = rounds_of(outs[r])
        assert sorted(resumed) == list(range(1, 7))
        assert all(resumed[k]["digest"] == whole[0][k]["digest"] for k in resumed)


def test_bad_settings_are_refused():
    """One-line errors naming the argument, before anything connects."""
    import torch

    class NoManager:
        _use_async_quorum = False

        def register_state_dict_fn(self, *a):
            raise AssertionError("not reached")

    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="under torchft a round's aggregation must be a sum"):
        FTLocalCub(p, NoManager(), vote="onebit")
    with pytest.raises(ValueError, match="delay must be 0"):
        FTLocalCub(p, NoManager(), vote="grad", delay=1)
    with pytest.raises(ValueError, match="aggregate='mean'"):
        FTLocalCub(p, NoManager(), vote="pbit", bits=8, quantizer="l1")
    async_manager = NoManager()
    async_manager._use_async_quorum = True
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        FTLocalCub(p, async_manager, vote="grad")
    with pytest.raises(ValueError, match="max_attempts"):
        FTLocalCub(p, NoManager(), vote="grad", max_attempts=0)


def test_a_stop_round_below_one_is_refused():
    from lioncub.ft.train import FTPlan

    with pytest.raises(ValueError, match="--ft-stop-round must be a round >= 1, got 0"):
        FTPlan(stop_round=0).check()


def test_bad_fault_specs_are_refused_in_one_line():
    from lioncub.ft.faults import Fault, parse_fault
    from lioncub.ft.train import FTPlan

    assert parse_fault("2:5:lanes") == Fault(2, 5, "lanes", "kill")
    assert parse_fault("1:3:commit:error") == Fault(1, 3, "commit", "error")
    for spec, message in (("2:5", "REPLICA:ROUND:POINT"), ("a:5:head", "REPLICA:ROUND:POINT"),
                          ("2:5:middle", "point must be one of inner, head, lanes, commit"),
                          ("2:5:head:explode", "action must be one of kill, error"), ("2:0:head", "round >= 1")):
        with pytest.raises(ValueError, match=message):
            parse_fault(spec)
    with pytest.raises(ValueError, match=r"--ft-fault 3:5:head: replica must be < --replicas \(3\)"):
        FTPlan(faults=("3:5:head",)).check()
    with pytest.raises(ValueError, match="--ft-fault and --kill-every"):
        FTPlan(faults=("1:5:head",), kill_every=10).check()


def test_no_quorum_in_time_is_a_clear_error():
    """A lone replica under min_replicas=2: QuorumError naming min_replica_size and the timeout."""
    import torch
    from lioncub.ft import make_manager

    lh = start_lighthouse(2, heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=200)
    try:
        manager = make_manager("solo", lh.address(), min_replicas=2, timeout_s=2.0, quorum_timeout_s=1.5)
        opt = FTLocalCub([torch.nn.Parameter(torch.zeros(3))], manager, vote="grad", local_steps=2)
        t0 = time.perf_counter()
        with pytest.raises(QuorumError, match=r"no quorum of min_replica_size=2 replicas within"):
            opt.join()
        assert time.perf_counter() - t0 < 10
        manager.shutdown(wait=False)
    finally:
        lh.shutdown()


@pytest.mark.slow
def test_lioncub_train_ft_survives_faults_at_chosen_points(tmp_path):
    """`lioncub train --ft --ft-fault`: replica 1's own commit of round 20 fails while its peers commit (it heals
    at round 21), and replica 2 is killed inside round 30's lane all-reduce and restarted 2 s later. The
    summary counts exactly that: one kill and restart, one round healed over, none lost or repeated, the
    survivors' round 30 on a quorum of 2, the three replicas identical at the end. The run ends on events, not
    the clock (--ft-stop-round: round 40 or later with all three back), so a slow host changes nothing."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lioncub.cli", "train", "--ft", "--model", "gpt-tiny", "--local-steps", "5",
           "--batch-size", "2", "--block-size", "32", "--budget", "300", "--ft-stop-round", "40",
           "--ft-fault", "1:20:commit:error", "--ft-fault", "2:30:lanes", "--restart-after", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "identical at the end: True" in done.stdout
    record = json.loads((out / "ft_summary.json").read_text())
    summary = record["summary"]
    assert [k["replica"] for k in record["kills"]] == [2] and [k["replica"] for k in record["restarts"]] == [2]
    assert summary["kills"] == 1 and summary["restarts"] == 1 and record["late"] == []
    assert summary["lost_or_repeated_rounds"] == 0 and summary["healed_over_rounds"] == 1
    assert summary["identical"] and summary["finished"] == 3
    assert len(summary["stall_s"]) == 1 and summary["stall_s"][0] is not None and summary["stall_s"][0] >= 0
    assert summary["uncommitted"] == 2  # replica 1: its own failed commit, then the kill's
    logs = [[json.loads(line) for line in (out / f"replica_{r}.jsonl").read_text().splitlines()] for r in range(3)]
    rounds = [{rec["round"]: rec for rec in log if rec["kind"] == "round"} for log in logs]
    assert 20 not in rounds[1] and rounds[1][21]["heals"] == rounds[1][19]["heals"] + 1
    assert [(rounds[r][20]["participants"], rounds[r][20]["contributors"]) for r in (0, 2)] == [(3, 3)] * 2
    assert [(rounds[r][21]["participants"], rounds[r][21]["contributors"]) for r in (0, 1)] == [(3, 2)] * 2
    assert [(rounds[r][30]["participants"], rounds[r][30]["contributors"]) for r in (0, 1)] == [(2, 2)] * 2
    joins = [rec for rec in logs[2] if rec["kind"] == "joined"]
    assert len(joins) == 2 and joins[1]["heals"] == 1  # its second life began with a heal
    # and its shard continued where a replica that never stopped would read at the heal's round, not from the start
    from lioncub.harness.config import default_cache_dir
    from lioncub.harness.data import TokenLoader, ensure_prepared

    never_stopped = TokenLoader(os.path.join(ensure_prepared("shakespeare", default_cache_dir()), "train.bin"),
                                block_size=32, batch_size=2, rank=2, world_size=3, seed=0)
    for _ in range(joins[1]["round"] * 5):
        never_stopped.next_batch()
    assert joins[1]["round"] > 0 and joins[1]["data"] == never_stopped.state_dict()
    ends = [next(rec for rec in log if rec["kind"] == "final")["round"] for log in logs]
    assert len(set(ends)) == 1 and ends[0] >= 40 and summary["span_s"] < 250  # the stop round's, not the budget's


def test_no_lighthouse_reachable_is_a_clear_error():
    """make_manager with nothing listening at the lighthouse's address: one line naming it."""
    from lioncub.ft import make_manager

    port = free_port()  # bound and released: nothing listens there now
    with pytest.raises(ConnectionError, match=rf"no torchft lighthouse reachable at http://127.0.0.1:{port}"):
        make_manager("x", f"http://127.0.0.1:{port}", connect_timeout_s=1.0)


def test_torchft_process_group_follows_the_parameters_device():
    """NCCL for CUDA parameters, gloo elsewhere (the choice only: this host has no NCCL to build one)."""
    import torch

    from lioncub.ft import process_group_name

    assert process_group_name("cpu") == "ProcessGroupGloo"
    assert process_group_name(torch.device("cuda", 1)) == "ProcessGroupNCCL"
    assert process_group_name("meta") == "ProcessGroupGloo"
