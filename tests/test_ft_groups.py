"""Replica groups of many ranks under torchft: 2 groups x 2 ranks, FSDP2 shards inside each group, LocalCub's rounds
across the groups rank by rank (lioncub.ft, docs/fault_tolerance.md "Replica groups of many ranks").

Each rank is tests/ft_groups_worker.py in its own process: a group is its own gloo world (the FSDP2 mesh over its two
ranks), every rank holds its own torchft Manager, and the lighthouse runs in the test process. Ranks log a line per
committed round with a hash of their own shard's bytes: equal hashes at the same rank of two groups are bit-identical
shards. Failures strike at chosen points of a chosen round (lioncub.ft.faults), so each expected log is exact.
The last tests run the same layout through the command, `lioncub train --ft --nproc-per-replica 2`.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import require
from tests.dist import run_workers

require("torchft")  # (probed, not imported: see tests/test_ft.py)

from lioncub.ft import start_lighthouse  # noqa: E402
from tests.test_ft import HEARTBEAT_MS, free_port, records, rounds_of  # noqa: E402

WORKER = Path(__file__).with_name("ft_groups_worker.py")
GROUPS, RANKS = 2, 2
KILLED = 5  # the round in which a fault strikes


def launch(mode: str, group: int, rank: int, out: Path, port: int, *args: str, lighthouse=None) -> subprocess.Popen:
    import os

    cmd = [sys.executable, str(WORKER), "--mode", mode, "--group", str(group), "--rank", str(rank),
           "--master-port", str(port), "--out", str(out), *args]
    if lighthouse is not None:
        cmd += ["--lighthouse", lighthouse.address()]
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def out_of(tmp_path: Path, mode: str, group: int, rank: int) -> Path:
    return tmp_path / f"{mode}_{group}_{rank}.jsonl"


def start_group(tmp_path, group: int, *args: str, lighthouse) -> list[subprocess.Popen]:
    port = free_port()  # (a group's own world: its own rendezvous)
    return [launch("ft", group, k, out_of(tmp_path, "ft", group, k), port, *args, lighthouse=lighthouse)
            for k in range(RANKS)]


def finish(procs: dict, exits=None, timeout=240) -> dict:
    """Each process's stderr once it ended with its expected exit code (0 unless ``exits`` says otherwise); every
    process is killed if one does not end in time."""
    errs = {}
    for key, p in procs.items():
        try:
            _, errs[key] = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{key} did not finish in time")
        assert p.returncode == (exits or {}).get(key, 0), f"{key} exited {p.returncode}: {errs[key][-3000:]}"
    return errs


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def run_ft(tmp_path, rounds: int, *args: str, restart: bool = False, setting: tuple = ()) -> tuple[dict, dict]:
    """Both groups on torchft (lighthouse min_replicas=1: one group may commit alone) until they stop together at
    the first commit from round ``rounds`` on. ``restart``: a ``--fault`` kills a rank of group 1; its other rank is
    then killed too (a failed rank takes its group out, as torchelastic restarts a node's ranks together), and once
    group 0 committed two rounds alone, group 1 starts again (no faults) and rejoins through a heal. Returns each
    (group, rank)'s records by round, and the restarted group's first life's by round under ``("first", rank)`` and
    its second life's records under ``("after", rank)``. ``setting``: the worker's options of every life (``--vote``)."""
    lh = start_lighthouse(1, heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=10000)
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    ready.mkdir()
    if not restart:
        stop.touch()
    common = ("--rounds", str(rounds), "--stop-file", str(stop), "--H", "4", "--step-sleep", "0.02", *setting)
    first = (*common, "--ready-dir", str(ready), "--ready-count", str(GROUPS * RANKS), *args)
    procs = {}
    try:
        for g in range(GROUPS):
            procs.update({(g, k): p for k, p in enumerate(start_group(tmp_path, g, *first, lighthouse=lh))})
        before = {}
        if restart:
            victims = [procs[(1, k)] for k in range(RANKS)]
            deadline = time.time() + 180
            while all(p.poll() is None for p in victims):
                assert time.time() < deadline, "the fault did not strike"
                time.sleep(0.05)
            killed = [p.returncode for p in victims]
            kill_all(victims)  # the group's other rank goes with it
            assert -9 in killed, killed
            while sum(1 for r in records(out_of(tmp_path, "ft", 0, 0)) if r.get("participants") == 1) < 2:
                assert time.time() < deadline, "group 0 did not commit without group 1"
                time.sleep(0.1)
            before = {k: len(records(out_of(tmp_path, "ft", 1, k))) for k in range(RANKS)}
            procs.update({(1, k): p for k, p in enumerate(start_group(tmp_path, 1, *common, lighthouse=lh))})
            while any(len(records(out_of(tmp_path, "ft", 1, k))) == before[k] for k in range(RANKS)):
                assert time.time() < deadline + 120, "group 1 did not rejoin"
                assert all(procs[(1, k)].poll() is None for k in range(RANKS)), "group 1 died again"
                time.sleep(0.1)
            stop.touch()
        finish(procs)
    finally:
        kill_all(procs.values())
        lh.shutdown()
    logs = {(g, k): rounds_of(out_of(tmp_path, "ft", g, k)) for g in range(GROUPS) for k in range(RANKS)}
    for k in range(RANKS) if restart else ():
        lines = records(out_of(tmp_path, "ft", 1, k))
        logs[("first", k)] = {r["round"]: r for r in lines[:before[k]] if "done" not in r}
        logs[("after", k)] = [r for r in lines[before[k]:] if "done" not in r]
    return logs, procs


def run_plain(tmp_path, rounds: int, *args: str) -> dict:
    """The reference: LocalCub on one gloo world of 2 x 2 ranks, FSDP2 over the shard dimension of a 2-D mesh and
    the rounds across its replicate dimension (no torchft, no quorum)."""
    port = free_port()
    procs = {(g, k): launch("plain", g, k, out_of(tmp_path, "plain", g, k), port, "--rounds", str(rounds), "--H", "4",
                            *args) for g in range(GROUPS) for k in range(RANKS)}
    try:
        finish(procs)
    finally:
        kill_all(procs.values())
    return {key: rounds_of(out_of(tmp_path, "plain", *key)) for key in procs}


def assert_groups_identical(logs, groups=(0, 1)) -> None:
    """At every rank, every round the groups both logged holds the same shard on both."""
    for k in range(RANKS):
        a, b = (logs[(g, k)] for g in groups)
        shared = set(a) & set(b)
        assert shared and all(a[r]["digest"] == b[r]["digest"] for r in shared), k


@pytest.mark.slow
@pytest.mark.parametrize("nan", [False, True], ids=["clean", "nan"])
def test_no_failure_equals_hsdp_localcub_without_torchft(tmp_path, nan):
    """2 groups x 2 ranks, no failure: every round of every rank's shard bit-identical to LocalCub's HSDP rounds on
    one 4-rank gloo world (a 2-D mesh: FSDP2 over 'shard', the rounds over 'replicate'), a reference that shares
    nothing of torchft (no Manager, no quorum, no managed group, one all-reduce over the world for the agreement
    where the groups sum twice) and is itself checked against the whole model in tests/test_sharded.py. ``nan``:
    rank 1 of group 1 holds a NaN gradient at its inner step 13 (round 4): every rank of both groups drops round 4
    (the agreement's flag crosses the group and the groups) and redoes it, record for record as the reference."""
    rounds = 6
    args = ("--nan-at", "1:1:13") if nan else ()
    ft, _ = run_ft(tmp_path, rounds, *args)
    plain = run_plain(tmp_path, rounds, *args)
    for key in plain:
        assert sorted(plain[key]) == list(range(1, rounds + 1)), key
        assert sorted(ft[key]) == sorted(plain[key]), key
        assert [ft[key][r]["digest"] for r in plain[key]] == [plain[key][r]["digest"] for r in plain[key]], key
        assert {(x["participants"], x["contributors"], x["uncommitted"]) for x in ft[key].values()} == {(2, 2, 0)}
        mine, reference = ([(x["round"], x["skipped"], x["digest"]) for x in records(out_of(tmp_path, mode, *key))
                            if "done" not in x] for mode in ("ft", "plain"))
        assert mine == reference, key
        assert [x[:2] for x in mine] == [(r, 0) for r in range(1, 4)] + [(3, 1)] * nan + [(r, nan) for r in range(4, 7)]
    assert_groups_identical(ft)


@pytest.mark.slow
def test_a_groups_verdict_is_one_for_all_its_ranks(tmp_path):
    """Rank 1 of group 1 reports an error before round 5's commit while every collective succeeded: its group's
    other rank does not commit round 5 either (torchft's ManagerServer ANDs should_commit over the group's ranks),
    group 0 commits it (P = C = 2). At the retry both ranks of group 1 are one commit behind and heal, each from the
    same rank of group 0 (their Δ void: C = 1 in round 6), and every shard is bit-identical across the groups."""
    rounds = 8
    logs, _ = run_ft(tmp_path, rounds, "--fault", f"3:{KILLED}:commit:error")
    assert_groups_identical(logs)
    for k in range(RANKS):
        assert sorted(logs[(0, k)]) == list(range(1, rounds + 1))
        assert sorted(logs[(1, k)]) == [r for r in range(1, rounds + 1) if r != KILLED], k
        assert (logs[(0, k)][KILLED]["participants"], logs[(0, k)][KILLED]["contributors"]) == (2, 2)
        for g in range(GROUPS):
            assert (logs[(g, k)][KILLED + 1]["participants"], logs[(g, k)][KILLED + 1]["contributors"]) == (2, 1)
        assert logs[(1, k)][KILLED + 1]["heals"] == logs[(1, k)][KILLED - 1]["heals"] + 1
        assert logs[(1, k)][rounds]["uncommitted"] == 1 and logs[(0, k)][rounds]["uncommitted"] == 0
        assert logs[(0, k)][rounds]["heals"] == logs[(0, k)][1]["heals"]  # a live group never heals


@pytest.mark.slow
@pytest.mark.parametrize("point, failed, vote", [("lanes", 1, "mean8"), ("inner", 0, "mean8"),
                                                 ("lanes", 1, "every-pbit")])
def test_a_rank_killed_takes_its_group_out(tmp_path, point, failed, vote):
    """Rank 1 of group 1 is killed as round 5's lane all-reduce starts (``lanes``) or at its first inner step
    (``inner``); its group goes with it. In the lanes, group 0's attempt fails (on rank 1's managed group at least, so
    on both its ranks: one uncommitted each), is retried with the same Δ on a quorum of its own, and commits
    (P = C = 1); in the inner steps, round 5's quorum is group 0 alone from the start (nothing uncommitted). Group 1
    restarts, heals each rank's shard from the same rank of group 0 (P = 2, C = 1: it adds nothing that round) and
    from then on is bit-identical to group 0. Nothing lost, nothing twice: group 0 logs every round once, in order.
    ``every-pbit``: the same for FTLionCub, LionCub's vote every step (a round is one step), on the groups' shards."""
    rounds = 12
    logs, _ = run_ft(tmp_path, rounds, "--fault", f"3:{KILLED}:{point}", restart=True, setting=("--vote", vote))
    assert_killed_group_healed(logs, rounds, failed)


def assert_killed_group_healed(logs, rounds: int, failed: int) -> None:
    """run_ft(restart=True)'s logs of group 1 killed in round KILLED: group 0 commits every round once, in order
    (``failed`` uncommitted attempts of round KILLED, then alone: P = C = 1), group 1 never committed round KILLED,
    and its next life heals once, adds nothing to its first round (P = 2, C = 1) and equals group 0 from then on."""
    for k in range(RANKS):
        a = logs[(0, k)]
        last = max(a)
        assert sorted(a) == list(range(1, last + 1)) and last >= rounds
        assert [(a[r]["participants"], a[r]["contributors"]) for r in range(1, KILLED)] == [(2, 2)] * (KILLED - 1)
        assert (a[KILLED]["participants"], a[KILLED]["contributors"]) == (1, 1)
        assert {a[r]["uncommitted"] for r in range(1, KILLED)} == {0}
        assert {a[r]["uncommitted"] for r in range(KILLED, last + 1)} == {failed}  # the one failed attempt, or none
        assert {a[r]["heals"] for r in a} == {a[1]["heals"]}
        assert max(logs[("first", k)]) == KILLED - 1  # group 1 never committed round 5
        after = logs[("after", k)]
        assert after and after[0]["heals"] == 1 and (after[0]["participants"], after[0]["contributors"]) == (2, 1)
        assert all(rec["digest"] == a[rec["round"]]["digest"] for rec in after)
        rejoined = after[0]["round"]
        assert {(a[r]["participants"], a[r]["contributors"]) for r in range(KILLED + 1, rejoined)} <= {(1, 1)}
        assert (a[rejoined]["participants"], a[rejoined]["contributors"]) == (2, 1)
        assert {(a[r]["participants"], a[r]["contributors"]) for r in range(rejoined + 1, last + 1)} == {(2, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("vote", ["every-pbit", "every-sign_allreduce"])
def test_the_every_step_vote_on_groups_equals_lioncub_on_a_2d_mesh(tmp_path, vote):
    """FTLionCub (LionCub's vote every step on torchft) on 2 groups x 2 ranks, FSDP2 inside, no failure: every step
    of every rank's shard bit-identical to LionCub on one 4-rank gloo world, FSDP2 over the 'shard' dimension of a
    2-D mesh and the vote across its 'replicate' dimension (no torchft, no quorum; checked against the whole model
    in tests/test_sharded.py), for the binary pbit lanes and sign_allreduce."""
    steps = 10
    ft, _ = run_ft(tmp_path, steps, setting=("--vote", vote))
    plain = run_plain(tmp_path, steps, "--vote", vote)
    for key in plain:
        assert sorted(plain[key]) == list(range(1, steps + 1)), key
        assert sorted(ft[key]) == sorted(plain[key]), key
        assert [ft[key][r]["digest"] for r in plain[key]] == [plain[key][r]["digest"] for r in plain[key]], key
        assert {(x["participants"], x["contributors"], x["uncommitted"]) for x in ft[key].values()} == {(2, 2, 0)}
    assert_groups_identical(ft)
    assert ft[(0, 0)][steps]["digest"] != ft[(0, 1)][steps]["digest"]  # two different shards


def refused(run) -> str:
    """The ValueError's message that ``run()`` raises, or ``'ran'``."""
    try:
        run()
    except ValueError as exc:
        return str(exc)
    return "ran"


def _refusal_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.flat import FTLocalCub
    from tests.ft_groups_worker import model_of

    class StandIn:  # refused before it is used
        _use_async_quorum = False

        def __init__(self, ranks):
            self._group_world_size = ranks

        def register_state_dict_fn(self, *a):
            raise AssertionError("not reached")

    sharded = model_of(init_device_mesh("cpu", (world,)))
    out = dict(ranks=refused(lambda: FTLocalCub(sharded.parameters(), StandIn(1), vote="grad")))
    two_d = model_of(init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))["shard"])
    out["two_d"] = refused(lambda: FTLocalCub(two_d.parameters(), StandIn(1), vote="grad"))
    return out


def test_what_a_replica_group_of_many_ranks_cannot_run_is_refused_in_one_line():
    """A manager whose group is not the shards' world, and FSDP2 on a 2-D mesh with replicas of its own: each one
    line saying what to use instead (plain copies inside a group are a node mean: tests/test_ft_node_mean.py)."""
    out = run_workers(_refusal_worker, 2)[0]
    assert out["ranks"].startswith("manager: its replica group has 1 ranks (world_size=) but the parameters are "
                                   "sharded over 2")
    assert out["two_d"].startswith("under torchft the replicas are the manager's replica groups: shard the model")
    assert all("\n" not in text for text in out.values())


def train_ft(tmp_path, *args: str, min_replicas: int = 1) -> tuple[dict, list[list[dict]], str]:
    """`lioncub train --ft` on 2 replica groups of 2 ranks (gpt-tiny, H = 5), ended by events (--ft-stop-round):
    its ft_summary.json, each group's log (its rank 0's) and the command's output. ``min_replicas`` 1: a group goes
    on alone while the other is down; 2: every round on both."""
    import json
    import os

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lioncub.cli", "train", "--ft", "--replicas", str(GROUPS), "--nproc-per-replica",
           str(RANKS), "--min-replicas", str(min_replicas), "--model", "gpt-tiny", "--local-steps", "5", "--batch-size", "2",
           "--block-size", "32", "--budget", "300", "--restart-after", "1", "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [[json.loads(line) for line in (out / f"replica_{g}.jsonl").read_text().splitlines()] for g in range(GROUPS)]
    return json.loads((out / "ft_summary.json").read_text()), logs, done.stdout


def finals(logs) -> list[dict]:
    return [next(rec for rec in reversed(log) if rec["kind"] == "final") for log in logs]


@pytest.mark.slow
@pytest.mark.parametrize("method", [(), ("--optimizer", "lioncub", "--vote", "pbit", "--local-steps", "1")],
                         ids=["localcub", "vote"])
def test_lioncub_train_ft_on_groups_of_two_ranks_survives_a_killed_rank(tmp_path, method):
    """`lioncub train --ft --replicas 2 --nproc-per-replica 2`: each group its own gloo world with gpt-tiny
    FSDP2-sharded over its two ranks. Group 1's last rank is killed as round 4's lane all-reduce starts
    (--ft-fault 1:4:lanes); the supervisor kills the group's other rank, restarts both 1 s later, and each heals its
    shard from the same rank of group 0. The summary counts exactly that, per group: one kill and one restart, one
    uncommitted agreement (group 0's failed attempt of round 4, retried alone), two heals (the fresh start's, torchft's
    init_sync of one group from the other at round 0, and the restarted group's), nothing lost or repeated;
    round 4 on group 0 alone (P = C = 1), group 1 back with nothing to add (P = 2, C = 1); at the end both ranks'
    shards (distinct halves of the model) bit-identical across the groups. ``vote``: the same for LionCub's vote every
    step (FTLionCub, a round of one step), what bench.fault_tolerance --method vote runs."""
    summary_file, logs, stdout = train_ft(tmp_path, "--ft-stop-round", "6", "--ft-fault", "1:4:lanes", *method)
    summary = summary_file["summary"]
    assert "2 replica groups of 2 ranks" in stdout and "identical at the end: True" in stdout
    assert [k["replica"] for k in summary_file["kills"]] == [1] and [k["replica"] for k in summary_file["restarts"]] == [1]
    assert summary["kills"] == 1 and summary["restarts"] == 1 and summary_file["late"] == []
    assert summary["lost_or_repeated_rounds"] == 0 and summary["healed_over_rounds"] == 0
    assert summary["uncommitted"] == 1 and summary["heals"] == 2
    assert summary["finished"] == GROUPS and summary["identical"]
    ends = finals(logs)
    assert [len(f["digests"]) for f in ends] == [RANKS] * GROUPS and ends[0]["digests"] == ends[1]["digests"]
    assert len(set(ends[0]["digests"])) == RANKS  # two different shards
    rounds = [{rec["round"]: rec for rec in log if rec["kind"] == "round"} for log in logs]
    assert sorted(rounds[0]) == list(range(1, max(rounds[0]) + 1))  # group 0: every round once, in order
    assert (rounds[0][4]["participants"], rounds[0][4]["contributors"]) == (1, 1)
    starts = [next(rec for rec in log if rec["kind"] == "joined") for log in logs]
    assert [(rec["round"], rec["participants"]) for rec in starts] == [(0, 2)] * 2  # both in the first quorum
    assert sorted(rec["heals"] for rec in starts) == [0, 1]  # init_sync: one group takes the other's start
    joins = [rec for rec in logs[1] if rec["kind"] == "joined"]
    assert len(joins) == 2 and joins[1]["heals"] == 1
    back = joins[1]["round"]
    assert back >= 4 and (rounds[0][back]["participants"], rounds[0][back]["contributors"]) == (2, 1)
    assert max(r for r, rec in rounds[1].items() if rec["wall"] < joins[1]["wall"]) == 3  # never committed round 4
    assert ends[0]["round"] == ends[1]["round"] >= 6


@pytest.mark.slow
def test_lioncub_train_ft_on_groups_of_two_ranks_without_failure(tmp_path):
    """No failure: both groups commit every round together (P = C = 2), nothing uncommitted, one heal only (the fresh
    start's init_sync), and each rank's shard bit-identical across the groups at the end."""
    summary_file, logs, _ = train_ft(tmp_path, "--ft-stop-round", "4", min_replicas=2)
    summary = summary_file["summary"]
    assert summary["kills"] == 0 and summary["uncommitted"] == 0 and summary["heals"] == 1
    assert summary["lost_or_repeated_rounds"] == 0 and summary["identical"] and summary["finished"] == GROUPS
    for log in logs:
        assert {(rec["participants"], rec["contributors"]) for rec in log if rec["kind"] == "round"} == {(2, 2)}
    ends = finals(logs)
    assert ends[0]["digests"] == ends[1]["digests"] and len(set(ends[0]["digests"])) == RANKS
