"""Warm spares (``lioncub train --ft --warm-spare``, :mod:`lioncub.ft.spare`): a lost replica's place taken at
once by a process that had already started, on real processes and torchft's lighthouse on loopback."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from lioncub.ft.spare import READY, activate, wait_for_activation, wait_ready
from tests.conftest import require

# Probed, not imported: torchft imports triton, and a triton imported at collection without TRITON_INTERPRET
# breaks the kernel tests' interpreter (tests/triton_cases.py).
require("torchft")


def test_a_spare_waits_for_its_line_and_takes_the_deadline_from_it():
    assert wait_for_activation(io.StringIO('{"deadline": 1234.5}\n')) == 1234.5
    assert wait_for_activation(io.StringIO('{"deadline": null}\n')) is None
    with pytest.raises(SystemExit) as stop:  # its standard input closed: not needed, a clean exit
        wait_for_activation(io.StringIO(""))
    assert stop.value.code == 0


def test_a_spare_that_died_is_not_activated():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, text=True)
    proc.wait()
    assert activate(proc, 1.0) is False


def _printer(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_spare_is_ready_once_it_prints_its_line_and_not_before():
    """wait_ready: the ready line after other output (one pipe read may hold both) is seen; a spare that exits
    without it, or says nothing in time, is not ready."""
    proc = _printer(f"import sys, time; sys.stdout.write('a warning\\n{READY}\\n'); sys.stdout.flush(); time.sleep(5)")
    assert wait_ready(proc, 20) is True
    proc.kill(), proc.wait()
    proc = _printer("print('something else')")
    assert wait_ready(proc, 20) is False
    proc.wait()
    proc = _printer("import time; time.sleep(5)")
    assert wait_ready(proc, 0.3) is False
    proc.kill(), proc.wait()


def test_a_spare_prints_ready_then_nothing_more_on_its_stdout():
    """After its ready line a spare's standard output goes nowhere: once activated it is a replica whose output no
    one reads, and a full pipe would block it."""
    code = ("import sys; from lioncub.ft.spare import wait_for_activation; d = wait_for_activation(); "
            "print('x' * 200000); print(d)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert wait_ready(proc, 60) is True
    assert activate(proc, 7.0)
    assert proc.wait(timeout=60) == 0  # 200 kB after the line did not fill the unread pipe
    assert proc.stdout.read() == ""


def test_a_spares_warm_up_leaves_no_trace():
    """The spare's forward and backward before it waits: the gradients dropped, a norm's running statistics, the
    loader's position and torch's random state as they were (a dropout layer draws from it)."""
    import torch

    from lioncub.ft.replica import _warm_up

    class Loader:
        def __init__(self):
            self.pos = 3

        def next_batch(self):
            self.pos += 1
            return torch.randn(8, 4), None

        def state_dict(self):
            return {"pos": self.pos}

        def load_state_dict(self, state):
            self.pos = state["pos"]

    class Data:
        loader = Loader()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    stats = [b.clone() for b in model.buffers()]
    ran = []

    def loss_of(x, _):
        ran.append(x.shape)
        return model(x).square().sum()

    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    _warm_up(model, Data, loss_of)
    assert ran == [(8, 4)] and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), stats)) and Data.loader.pos == 3
    assert torch.equal(torch.rand(3), expected)


def test_bad_spare_counts_are_refused():
    from lioncub.ft.train import FTPlan

    with pytest.raises(ValueError, match="--warm-spare must be 0..8"):
        FTPlan(warm_spare=-1).check()
    with pytest.raises(ValueError, match="--warm-spare must be 0..8"):
        FTPlan(warm_spare=9).check()


RESTART_S = 60.0
"""The test's restart delay: the slow way back, which a spare that works never waits for (its replica is back in
about a second, so the delay costs the test nothing); the spare must be back in a fifth of it."""


@pytest.mark.slow  # ~20-40 s: three replicas of gpt-tiny and their spares
def test_a_killed_replica_is_replaced_by_its_warm_spare_long_before_its_restart(tmp_path):
    """Replica 2 is killed inside round 20's exchange; its restart would come RESTART_S later, its warm spare takes
    its place at once: the replica is back (joined, healed) within a fifth of that (about a second on loopback: the
    heartbeat timeout, a quorum and a heal), no round is lost, repeated or healed over, its life after the heal
    commits every round in order, and the three replicas end identical. The counts are exact: the survivors' round-20
    agreement fails once (one uncommitted each, the summary's 1, one stall), round 20 holds their two Δ only, the
    spare's first commit has P = 3, C = 2 (healed: nothing to add) and every later one all three; a survivor never
    heals, the spare never fails an agreement."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lioncub.cli", "train", "--ft", "--model", "gpt-tiny", "--local-steps", "5",
           "--batch-size", "2", "--block-size", "32", "--budget", "300", "--ft-stop-round", "40", "--ft-fault", "2:20:lanes",
           "--restart-after", f"{RESTART_S:g}", "--warm-spare", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "identical at the end: True" in done.stdout and "warm spares" in done.stdout
    record = json.loads((out / "ft_summary.json").read_text())
    summary = record["summary"]
    assert [k["replica"] for k in record["kills"]] == [2]
    assert [(r["replica"], r.get("spare")) for r in record["restarts"]] == [(2, True)] and record["late"] == []
    kill_to_join, stall = summary["kill_to_join_s"], summary["stall_s"]
    assert len(kill_to_join) == 1 and kill_to_join[0] is not None and 0 < kill_to_join[0] < RESTART_S / 5
    assert len(stall) == 1 and stall[0] is not None and 0 <= stall[0] < RESTART_S / 5
    assert summary["kills"] == summary["restarts"] == 1 and summary["uncommitted"] == 1
    assert summary["lost_or_repeated_rounds"] == 0 and summary["healed_over_rounds"] == 0
    assert summary["identical"] and summary["finished"] == 3
    logs = [[json.loads(line) for line in (out / f"replica_{r}.jsonl").read_text().splitlines()] for r in range(3)]
    joins = [rec for rec in logs[2] if rec["kind"] == "joined"]
    assert len(joins) == 2 and joins[1]["heals"] == 1 and joins[1]["pid"] != joins[0]["pid"]
    first_life = [(rec["round"], rec["participants"], rec["contributors"], rec["uncommitted"]) for rec in logs[2]
                  if rec["kind"] == "round" and rec["pid"] == joins[0]["pid"]]
    assert first_life == [(k, 3, 3, 0) for k in range(1, 20)]  # it never committed round 20
    spare = [(rec["round"], rec["participants"], rec["contributors"], rec["uncommitted"]) for rec in logs[2]
             if rec["kind"] == "round" and rec["pid"] == joins[1]["pid"]]
    back, last = spare[0][0], spare[-1][0]
    assert back >= 20 and last >= 40
    assert spare == [(back, 3, 2, 0)] + [(k, 3, 3, 0) for k in range(back + 1, last + 1)]
    for r in (0, 1):
        rounds = [rec for rec in logs[r] if rec["kind"] == "round"]
        assert [(rec["round"], rec["participants"], rec["contributors"], rec["uncommitted"]) for rec in rounds] == \
            [(k, 3, 3, 0) for k in range(1, 20)] + [(k, 2, 2, 1) for k in range(20, back)] + [(back, 3, 2, 1)] + \
            [(k, 3, 3, 1) for k in range(back + 1, last + 1)]
        assert {rec["heals"] for rec in rounds} == {rounds[0]["heals"]}


@pytest.mark.slow  # ~40-60 s: two groups of two ranks of gpt-tiny and a spare group each
def test_a_killed_group_is_replaced_by_its_spare_group_long_before_its_restart(tmp_path):
    """Replica groups of 2 ranks (`--nproc-per-replica 2`, FSDP2 inside) with a spare group each (`--warm-spare 1`):
    group 1's last rank is killed as round 4's lanes start (--ft-fault 1:4:lanes), the supervisor kills its other rank
    and activates both ranks of the group's spare (set up, sharded and warmed up in their own world before the run),
    each of which heals its own shard from the same rank of group 0. The group is back within a fifth of the restart
    delay; the counts are those of the restart the slow way (tests/test_ft_groups.py): one kill, one restart (a spare
    one), one uncommitted agreement, two heals (the fresh start's init_sync and the spare group's), nothing lost or
    repeated; round 4 on group 0 alone, the spare group's first commit with nothing to add (P = 2, C = 1) and every
    later one both; at the end each rank's shard bit-identical across the groups."""
    from tests.test_ft_groups import GROUPS, RANKS, finals, train_ft

    record, logs, stdout = train_ft(tmp_path, "--ft-stop-round", "8", "--ft-fault", "1:4:lanes", "--warm-spare", "1",
                                    "--restart-after", f"{RESTART_S:g}")
    summary = record["summary"]
    assert "identical at the end: True" in stdout and "warm spares" in stdout
    assert [k["replica"] for k in record["kills"]] == [1]
    assert [(r["replica"], r.get("spare")) for r in record["restarts"]] == [(1, True)] and record["late"] == []
    kill_to_join = summary["kill_to_join_s"]
    assert len(kill_to_join) == 1 and kill_to_join[0] is not None and 0 < kill_to_join[0] < RESTART_S / 5
    assert summary["kills"] == summary["restarts"] == 1 and summary["uncommitted"] == 1 and summary["heals"] == 2
    assert summary["lost_or_repeated_rounds"] == 0 and summary["healed_over_rounds"] == 0
    assert summary["identical"] and summary["finished"] == GROUPS
    ends = finals(logs)
    assert ends[0]["digests"] == ends[1]["digests"] and len(set(ends[0]["digests"])) == RANKS
    joins = [rec for rec in logs[1] if rec["kind"] == "joined"]
    assert len(joins) == 2 and joins[1]["heals"] == 1 and joins[1]["pid"] != joins[0]["pid"]
    rounds = [[(rec["round"], rec["participants"], rec["contributors"]) for rec in log if rec["kind"] == "round"]
              for log in logs]
    first = [rec["round"] for rec in logs[1] if rec["kind"] == "round" and rec["pid"] == joins[0]["pid"]]
    assert first == [1, 2, 3]  # it never committed round 4
    spare = [(rec["round"], rec["participants"], rec["contributors"]) for rec in logs[1]
             if rec["kind"] == "round" and rec["pid"] == joins[1]["pid"]]
    back, last = spare[0][0], spare[-1][0]
    assert back >= 4 and last >= 8 and spare == [(back, 2, 1)] + [(k, 2, 2) for k in range(back + 1, last + 1)]
    assert rounds[0] == [(k, 2, 2) for k in range(1, 4)] + [(k, 1, 1) for k in range(4, back)] + [(back, 2, 1)] + \
        [(k, 2, 2) for k in range(back + 1, last + 1)]


def _niceness(pid: int) -> list[int]:
    """The niceness of every thread of ``pid`` (field 19 of /proc/PID/task/TID/stat)."""
    import os

    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            out.append(int(f.read().rsplit(")", 1)[1].split()[16]))
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a niceness needs root")
def test_a_spare_started_low_runs_at_the_supervisors_priority_once_restored():
    """start_spare(nice=19): the spare and the threads it starts run at niceness 19 (its set-up takes idle CPU only);
    restore_priority gives every thread of it the supervisor's niceness back, threads started before it included."""
    from lioncub.ft.spare import restore_priority, start_spare

    code = ("import sys, threading, time; t = threading.Thread(target=time.sleep, args=(60,), daemon=True); t.start(); "
            "print('ready', flush=True); sys.stdin.readline()")
    [proc] = start_spare([sys.executable, "-c", code], dict(os.environ), nice=19)
    try:
        assert wait_ready(proc, 30)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        low = _niceness(proc.pid)
        assert len(low) == 2 and set(low) == {min(mine + 19, 19)}
        restore_priority(proc)
        assert _niceness(proc.pid) == [mine, mine]
    finally:
        proc.kill()
        proc.wait()
