"""The fault-tolerant run's summary (:func:`lioncub.ft.summary.summarize`) on hand-made replica logs: rounds per
second, the stall of a kill, the way back of a lost replica, rounds lost, repeated or healed over."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


def rnd(replica, k, wall, stall=0.1, c=3):
    """One replica's log line for a committed round ``k``."""
    return dict(kind="round", replica=replica, round=k, wall=wall, stall=stall, contributors=c, participants=3,
                uncommitted=0)


def _write_log(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_supervisor_summary_on_hand_made_logs(tmp_path):
    """ft.train.summarize: rounds per second, the stall of a kill (the survivors' excess wait at the next
    commit plus the rejoin commit's), rejoin times, a repeated round counted, identity at the end."""
    from lioncub.ft.train import FTPlan, FTRun, summarize

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


def test_a_kill_whose_replica_is_back_by_the_next_commit_stalls_once(tmp_path):
    """A replica back (a warm spare) before the survivors' next commit: that commit is both the first after the kill
    and the rejoin's; its excess wait counts once in stall_s, not twice."""
    from lioncub.ft.train import FTPlan, FTRun, summarize

    final = dict(kind="final", round=3, digest="abc", val_loss=2.0)
    for k in (0, 1):
        _write_log(tmp_path / f"replica_{k}.jsonl", [dict(kind="start"), dict(kind="joined", wall=0.0),
                   rnd(k, 1, 1.0), rnd(k, 2, 3.6, stall=1.6, c=2), rnd(k, 3, 4.6), dict(final, wall=5.0)])
    _write_log(tmp_path / "replica_2.jsonl", [dict(kind="start"), dict(kind="joined", wall=0.0), rnd(2, 1, 1.0),
                                              dict(kind="start"), dict(kind="joined", wall=3.5, heals=1),
                                              rnd(2, 3, 4.6), dict(final, wall=5.0)])
    run = FTRun(kills=[dict(replica=2, wall=2.0)], restarts=[dict(replica=2, wall=2.0, spare=True)])
    s = summarize(str(tmp_path), FTPlan(kill_every=30, warm_spare=1), run, budget=4)
    assert s["stall_s"] == [pytest.approx(1.5)]  # round 2 waited 1.6 (1.5 extra), once
    assert s["kill_to_join_s"] == [pytest.approx(1.5)] and s["lost_or_repeated_rounds"] == 0


def test_the_summary_counts_a_heal_after_an_uncommitted_round_not_a_loss(tmp_path):
    """A replica that did not commit round 2 while its peers did, then healed (its log: 1, 3 with heals up
    by one), has taken round 2 from a peer: healed_over_rounds 1, lost_or_repeated_rounds 0. The same jump
    without a heal is a lost round; a round logged twice is a repeated one."""
    from lioncub.ft.train import FTPlan, FTRun, summarize

    def rnd(replica, k, heals=0):
        return dict(kind="round", replica=replica, round=k, wall=float(k) + replica / 10, stall=0.1, contributors=3,
                    participants=3, uncommitted=0, heals=heals)

    def logs(lines_of_1):
        for r in range(3):
            lines = lines_of_1 if r == 1 else [rnd(r, k) for k in (1, 2, 3)]
            _write_log(tmp_path / f"replica_{r}.jsonl", [dict(kind="start"), dict(kind="joined", wall=0.0)] + lines)
        return summarize(str(tmp_path), FTPlan(), FTRun(), budget=4)

    s = logs([rnd(1, 1), dict(rnd(1, 3, heals=1), uncommitted=1)])
    assert (s["healed_over_rounds"], s["lost_or_repeated_rounds"], s["uncommitted"]) == (1, 0, 1)
    s = logs([rnd(1, 1), rnd(1, 3)])
    assert (s["healed_over_rounds"], s["lost_or_repeated_rounds"]) == (0, 1)
    s = logs([rnd(1, 1), rnd(1, 2), rnd(1, 2), rnd(1, 3)])
    assert (s["healed_over_rounds"], s["lost_or_repeated_rounds"]) == (0, 1)


def test_identical_compares_every_shard_of_replica_groups_of_many_ranks(tmp_path):
    """--nproc-per-replica: a group's final line holds every rank's hash (``digests``, rank order); ``identical``
    needs each shard equal across the groups, not only rank 0's (``digest``)."""
    from lioncub.ft.train import FTPlan, FTRun, summarize

    def finals(second):
        for g, digests in enumerate((["a", "b"], ["a", second])):
            _write_log(tmp_path / f"replica_{g}.jsonl", [dict(kind="start"), dict(kind="joined", wall=0.0),
                       rnd(g, 1, 1.0, c=2), dict(kind="final", round=1, wall=2.0, digest=digests[0], digests=digests,
                                                 val_loss=2.0)])
        return summarize(str(tmp_path), FTPlan(replicas=2, nproc_per_replica=2), FTRun(), budget=4)

    assert finals("b")["identical"] and not finals("c")["identical"]


def test_bad_rank_settings_are_refused_in_one_line():
    """--nproc-per-replica below 1 and an unknown --inside are refused; warm spares of groups of many ranks (spare groups) are not."""
    from lioncub.ft.train import FTPlan

    with pytest.raises(ValueError, match=r"^--nproc-per-replica must be >= 1 \(ranks per replica group\), got 0$"):
        FTPlan(nproc_per_replica=0).check()
    with pytest.raises(ValueError, match=r"^--inside must be 'fsdp2' or 'mean' \(what a replica group runs inside\), "
                       r"got 'ddp'$"):
        FTPlan(nproc_per_replica=2, inside="ddp").check()
    FTPlan(nproc_per_replica=2, warm_spare=1).check()
    FTPlan(nproc_per_replica=2, inside="mean").check()
    FTPlan(nproc_per_replica=2, replicas=2, min_replicas=1, kill_every=30, faults=()).check()
