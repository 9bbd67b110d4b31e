"""Warm spares (``lioncub train --ft --warm-spare``, :mod:`lioncub.ft.spare`): a lost replica's place taken at
once by a process that had already started, on real processes and torchft's lighthouse on loopback."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from lioncub.ft.spare import activate, wait_for_activation
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


@pytest.mark.slow  # ~60 s: three replicas of gpt-tiny and their spares
def test_a_killed_replica_is_replaced_by_its_warm_spare_long_before_its_restart(tmp_path):
    """Replica 2 is killed inside round 20's exchange; its restart would come 30 s later, its warm spare takes
    its place at once: the replica is back (joined, healed) well within those 30 s, no round is lost or repeated,
    its life after the heal commits every round in order, and the three replicas end identical."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lioncub.cli", "train", "--ft", "--model", "gpt-tiny", "--local-steps", "5",
           "--batch-size", "2", "--block-size", "32", "--budget", "40", "--ft-fault", "2:20:lanes",
           "--restart-after", "30", "--warm-spare", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "identical at the end: True" in done.stdout and "warm spares" in done.stdout
    record = json.loads((out / "ft_summary.json").read_text())
    summary = record["summary"]
    assert [k["replica"] for k in record["kills"]] == [2]
    assert [(r["replica"], r.get("spare")) for r in record["restarts"]] == [(2, True)]
    assert summary["kill_to_join_s"][0] is not None and summary["kill_to_join_s"][0] < 30
    assert summary["lost_or_repeated_rounds"] == 0 and summary["identical"] and summary["finished"] == 3
    log = [json.loads(line) for line in (out / "replica_2.jsonl").read_text().splitlines()]
    joins = [rec for rec in log if rec["kind"] == "joined"]
    assert len(joins) == 2 and joins[1]["heals"] == 1 and joins[1]["pid"] != joins[0]["pid"]
    after = [rec["round"] for rec in log if rec["kind"] == "round" and rec["wall"] > joins[1]["wall"]]
    assert after and after == list(range(after[0], after[0] + len(after)))
