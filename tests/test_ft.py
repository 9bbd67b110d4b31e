"""LocalCub on torchft (lioncub.ft): real processes, a lighthouse and three replica groups on loopback.

Each replica is tests/ft_worker.py in its own process (one worker per replica group, gloo through
torchft's ProcessGroupGloo); the lighthouse runs in the test process. Replicas log a line per
committed round: its number, the participants P and contributors C, and a hash of the
parameters' bytes (equal hashes = bit-identical replicas).
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

from lioncub.ft import FTLocalCub, QuorumError, start_lighthouse  # noqa: E402

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


@pytest.mark.slow
@pytest.mark.parametrize("vote", ["grad", "mean8"])
def test_no_failure_equals_localcub_on_a_plain_group(tmp_path, vote):
    """Three replicas on torchft, no failure: every round bit-identical to LocalCub on a 3-rank gloo group."""
    args = ("--steps", "20", "--H", "4", "--vote", vote)
    ft = [rounds_of(p) for p in run_three(tmp_path, "ft", *args)]
    plain = [rounds_of(p) for p in run_three(tmp_path, "plain", *args)]
    assert sorted(plain[0]) == list(range(1, 6))
    for r in range(3):
        assert sorted(ft[r]) == sorted(plain[0])
        for k in plain[0]:
            assert ft[r][k]["digest"] == plain[r][k]["digest"] == plain[0][k]["digest"], (r, k)
            assert (ft[r][k]["participants"], ft[r][k]["contributors"]) == (3, 3)
    assert all(ft[r][k]["uncommitted"] == 0 for r in range(3) for k in ft[r])


ROUNDS = 80  # ~0.15 s each: the survivors still train when the restarted replica is up (~3-5 s)


def _kill_and_rejoin(tmp_path, *extra):
    """Replica 2 dies (SIGKILL) at inner step 30; restarted once the survivors committed two
    rounds without it. Returns (logs of 0, 1, 2 as dicts by round, the kill's wall time, lines of 2)."""
    lh = start_lighthouse(2, heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=1000)
    outs = [tmp_path / f"kill_{r}.jsonl" for r in range(3)]
    common = ("--rounds", str(ROUNDS), "--H", "4", "--vote", "mean8", "--step-sleep", "0.03")
    try:
        procs = [launch("ft", r, outs[r], *common, *(extra if r == 2 else ()), lighthouse=lh) for r in range(3)]
        procs[2].wait(timeout=120)
        killed_at = time.time()
        assert procs[2].returncode == -9, procs[2].stderr.read()[-2000:]
        deadline = time.time() + 60
        while sum(1 for r in records(outs[0]) if r.get("participants") == 2) < 2:
            assert time.time() < deadline, "the survivors did not commit without the dead replica"
            time.sleep(0.1)
        before_restart = len(records(outs[2]))
        procs[2] = launch("ft", 2, outs[2], *common, lighthouse=lh)
        finish(procs)
    finally:
        lh.shutdown()
    return [rounds_of(p) for p in outs], killed_at, records(outs[2])[before_restart:]


@pytest.mark.slow
def test_a_replica_killed_mid_round_then_restarted(tmp_path):
    """Survivors commit with 2 participants within the heartbeat timeout plus a margin, no round is
    lost or applied twice, and the restarted replica heals and is bit-identical at the next agreement."""
    (r0, r1, r2), killed_at, after = _kill_and_rejoin(tmp_path, "--die-at-step", "30")
    assert sorted(r0) == sorted(r1) == list(range(1, ROUNDS + 1))  # every round committed once, in order
    for k in r0:
        assert r0[k]["digest"] == r1[k]["digest"], k
    first_two = min(r0[k]["wall"] for k in r0 if r0[k]["participants"] == 2)
    margin_s = 3.0  # a round, the quorum, gloo's reconnection, on 2 loaded cores
    assert first_two - killed_at < HEARTBEAT_MS / 1000 + margin_s
    assert max(k for k in r2 if r2[k]["wall"] < killed_at) < 8  # it died in round 8 (steps 28-31)
    rejoined = [rec for rec in after if "done" not in rec]
    assert rejoined and rejoined[0]["heals"] >= 1
    assert rejoined[0]["participants"] == 3 and rejoined[0]["contributors"] == 2  # the join: Δ = 0
    for rec in rejoined:  # bit-identical from the first agreement after the heal on
        assert rec["digest"] == r0[rec["round"]]["digest"], rec["round"]
    assert r0[ROUNDS]["participants"] == r0[ROUNDS]["contributors"] == 3


@pytest.mark.slow
def test_a_replica_killed_inside_the_collective(tmp_path):
    """A death inside the round's lane all-reduce: that round is uncommitted on both survivors and
    retried with the same Δ on the next quorum (2 participants); the survivors stay identical."""
    (r0, r1, _), _, _ = _kill_and_rejoin(tmp_path, "--die-at-step", "30", "--die-in-agreement")
    assert sorted(r0) == sorted(r1) == list(range(1, ROUNDS + 1))
    for k in r0:
        assert r0[k]["digest"] == r1[k]["digest"], k
    retried = [k for k in r0 if r0[k]["uncommitted"] > 0]
    assert retried, "no survivor saw an uncommitted round"
    first = min(retried)
    assert r0[first]["participants"] == 2 and r1[first]["uncommitted"] >= 1
    assert r0[first - 1]["participants"] == 3


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
    with pytest.raises(ValueError, match="vote must be 'grad' or 'pbit'"):
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


def _write_log(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_supervisor_summary_on_hand_made_logs(tmp_path):
    """ft.train.summarize: rounds per second, the stall of a kill (the survivors' excess wait at the next
    commit plus the rejoin commit's), rejoin times, a repeated round counted, identity at the end."""
    from lioncub.ft.train import FTPlan, FTRun, summarize

    def rnd(replica, k, wall, stall=0.1, c=3):
        return dict(kind="round", replica=replica, round=k, wall=wall, stall=stall, contributors=c, participants=3,
                    uncommitted=0)

    final = dict(kind="final", round=4, digest="abc", val_loss=2.0)
    _write_log(tmp_path / "replica_0.jsonl", [dict(kind="start"), dict(kind="joined", wall=0.0)]
               + [rnd(0, 1, 1.0), rnd(0, 2, 2.0), rnd(0, 3, 3.6, stall=0.7, c=2), rnd(0, 4, 4.6, stall=0.4)]
               + [dict(final, wall=5.0)])
    _write_log(tmp_path / "replica_1.jsonl", [dict(kind="start"), dict(kind="joined", wall=0.0)]
               + [rnd(1, 1, 1.0), rnd(1, 2, 2.0), rnd(1, 3, 3.6, stall=0.7, c=2), rnd(1, 4, 4.6, stall=0.4)]
               + [dict(final, wall=5.0)])
    _write_log(tmp_path / "replica_2.jsonl", [dict(kind="start"), dict(kind="joined", wall=0.0), rnd(2, 1, 1.0),
                                              rnd(2, 2, 2.0), dict(kind="start"), dict(kind="joined", wall=4.2, heals=1),
                                              rnd(2, 4, 4.6, stall=0.4), rnd(2, 4, 4.7), dict(final, wall=5.0)])
    run = FTRun(kills=[dict(replica=2, wall=2.5)], restarts=[dict(replica=2, wall=3.0)])
    s = summarize(str(tmp_path), FTPlan(kill_every=30), run, budget=4)
    assert s["rounds"] == 4 and s["span_s"] == pytest.approx(3.6)
    assert s["rounds_per_s"] == pytest.approx(3 / 3.6)
    assert s["replica_rounds_per_s"] == pytest.approx((3 + 2 + 3) / 3.6)
    assert s["agree_s_median"] == pytest.approx(0.1)
    assert s["stall_s"] == [pytest.approx(0.6 + 0.3)]  # round 3 waited 0.7 (0.6 extra); round 4, the rejoin, 0.4
    assert s["rejoin_s"] == [pytest.approx(1.2)]
    assert s["lost_or_repeated_rounds"] == 1  # replica 2 logged round 4 twice in one life
    assert s["heals"] == 1 and s["identical"] and s["val_loss"] == 2.0 and s["finished"] == 3


@pytest.mark.slow
def test_lioncub_train_ft_survives_scheduled_kills(tmp_path):
    """`lioncub train --ft --kill-every`: two kills and restarts on loopback, no round lost or repeated,
    three replicas identical at the end, each kill's stall measured."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lioncub.cli", "train", "--ft", "--model", "gpt-tiny", "--local-steps", "5",
           "--batch-size", "2", "--block-size", "32", "--budget", "40", "--kill-every", "10", "--restart-after", "2",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "identical at the end: True" in done.stdout
    summary = json.loads((out / "ft_summary.json").read_text())["summary"]
    assert summary["kills"] == 2 and summary["restarts"] == 2
    assert summary["lost_or_repeated_rounds"] == 0 and summary["identical"] and summary["finished"] == 3
    assert all(s is not None for s in summary["stall_s"]) and summary["heals"] >= 2


def test_no_lighthouse_reachable_is_a_clear_error():
    """make_manager with nothing listening at the lighthouse's address: one line naming it."""
    from lioncub.ft import make_manager

    port = free_port()  # bound and released: nothing listens there now
    with pytest.raises(ConnectionError, match=rf"no torchft lighthouse reachable at http://127.0.0.1:{port}"):
        make_manager("x", f"http://127.0.0.1:{port}", connect_timeout_s=1.0)
