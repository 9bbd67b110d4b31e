"""A node mean inside the replica groups under torchft: 2 groups x 2 ranks, every rank the whole model, each step's
gradients averaged over the group's ranks, the rounds (or LionCub's vote every step) across the groups rank by rank
(lioncub.ft, docs/fault_tolerance.md "Replica groups of many ranks"; `lioncub train --ft --inside mean`).

The processes are tests/ft_groups_worker.py's with ``--inside mean``, run by tests/test_ft_groups.py's helpers (its
own gloo world per group, a Manager per rank, a real lighthouse in this process). The reference shares nothing of
torchft nor of the optimizer's node mean: one 4-rank gloo world, each gradient summed over its node's two ranks by
``dist.all_reduce`` and halved, then LocalCub (LionCub) on the cross-node group of its local rank. With a node mean
every rank of both groups holds the same parameters, so every rank's hash of a round is the same.
"""
from __future__ import annotations

import pytest

from tests.conftest import require
from tests.dist import run_workers

require("torchft")  # (probed, not imported: see tests/test_ft.py)

from tests.test_ft import records  # noqa: E402
from tests.test_ft_groups import (GROUPS, KILLED, RANKS, assert_killed_group_healed, finals, out_of,  # noqa: E402
                                  refused, run_ft, run_plain, train_ft)

MEAN = ("--inside", "mean")
KEYS = [(g, k) for g in range(GROUPS) for k in range(RANKS)]


def assert_all_ranks_identical(logs, keys=KEYS) -> None:
    """Every round that all of ``keys`` logged holds the same parameters on all of them (groups and ranks)."""
    shared = set.intersection(*(set(logs[key]) for key in keys))
    assert shared
    for r in shared:
        assert len({logs[key][r]["digest"] for key in keys}) == 1, r


@pytest.mark.slow
@pytest.mark.parametrize("vote", ["mean8", "every-pbit"], ids=["localcub", "vote"])
def test_node_mean_groups_equal_a_node_mean_then_rounds_without_torchft(tmp_path, vote):
    """No failure: every round of every rank bit-identical to the reference (the node's mean gradient by hand, then
    LocalCub's rounds, H = 4, or LionCub's pbit vote every step, on the cross-node group of the local rank), record
    for record; P = C = 2 in every round (C counted once per group, not once per rank), and all four ranks the
    same parameters."""
    rounds = 6 if vote == "mean8" else 10
    setting = (*MEAN, "--vote", vote)
    ft, _ = run_ft(tmp_path, rounds, setting=setting)
    plain = run_plain(tmp_path, rounds, *setting)
    for key in KEYS:
        assert sorted(plain[key]) == list(range(1, rounds + 1)), key
        mine, reference = ([(x["round"], x["skipped"], x["digest"]) for x in records(out_of(tmp_path, mode, *key))
                            if "done" not in x] for mode in ("ft", "plain"))
        assert mine == reference, key
        assert {(x["participants"], x["contributors"], x["uncommitted"]) for x in ft[key].values()} == {(2, 2, 0)}
    assert_all_ranks_identical(ft)
    assert_all_ranks_identical(plain)
    assert ft[(0, 0)][1]["digest"] != ft[(0, 0)][rounds]["digest"]  # (it trains)


@pytest.mark.slow
def test_a_rank_killed_takes_its_node_mean_group_out_and_the_group_heals_back(tmp_path):
    """Rank 1 of group 1 is killed as round 5's lane all-reduce starts; its group goes with it. Group 0's attempt of
    round 5 fails (rank 1's exchange lost its peer, and the group's verdict is one for both ranks: one uncommitted
    each), is retried on a quorum of its own with the same Δ and commits alone (P = C = 1). Group 1 restarts, each
    rank heals the whole model from the same rank of group 0 (P = 2, C = 1: it adds nothing that round) and is
    bit-identical to group 0 from then on. Group 0 logs every round once, in order: 0 lost, 0 repeated; at every
    round all four ranks hold the same parameters."""
    rounds = 12
    logs, _ = run_ft(tmp_path, rounds, "--fault", f"3:{KILLED}:lanes", restart=True, setting=MEAN)
    assert_killed_group_healed(logs, rounds, failed=1)
    assert_all_ranks_identical(logs, [(0, 0), (0, 1), ("first", 0), ("first", 1)])  # (and after: as group 0)


@pytest.mark.slow
def test_lioncub_train_ft_inside_mean_survives_a_killed_rank(tmp_path):
    """`lioncub train --ft --replicas 2 --nproc-per-replica 2 --inside mean` (gpt-tiny, H = 5, no FSDP2): group 1's
    last rank killed as round 4's lane all-reduce starts, the group restarted and healed. The summary counts one kill,
    one restart, one uncommitted agreement, two heals (the start's init_sync, the restarted group's), nothing lost
    or repeated; round 4 on group 0 alone; at the end every rank of both groups holds the same whole model."""
    summary_file, logs, stdout = train_ft(tmp_path, "--ft-stop-round", "6", "--ft-fault", "1:4:lanes", *MEAN)
    summary = summary_file["summary"]
    assert "2 replica groups of 2 ranks (a node mean inside)" in stdout and "identical at the end: True" in stdout
    assert summary["kills"] == 1 and summary["restarts"] == 1 and summary_file["late"] == []
    assert summary["lost_or_repeated_rounds"] == 0 and summary["healed_over_rounds"] == 0
    assert summary["uncommitted"] == 1 and summary["heals"] == 2
    assert summary["finished"] == GROUPS and summary["identical"]
    ends = finals(logs)
    assert len({d for f in ends for d in f["digests"]}) == 1 and [len(f["digests"]) for f in ends] == [RANKS] * GROUPS
    rounds = [{rec["round"]: rec for rec in log if rec["kind"] == "round"} for log in logs]
    assert sorted(rounds[0]) == list(range(1, max(rounds[0]) + 1))
    assert (rounds[0][4]["participants"], rounds[0][4]["contributors"]) == (1, 1)
    assert ends[0]["round"] == ends[1]["round"] >= 6


class StandIn:  # a manager the refusals stop before any use (or that registers and is never asked for a quorum)
    _use_async_quorum = False

    def __init__(self, ranks):
        self._group_world_size = ranks

    def register_state_dict_fn(self, *a):
        pass


def _refusal_worker(rank, world):
    import torch

    from tests.flat import FTLocalCub

    model = torch.nn.Linear(4, 2)
    out = dict(one=refused(lambda: FTLocalCub(model.parameters(), StandIn(1), vote="grad")))
    opt = FTLocalCub(model.parameters(), StandIn(world), vote="grad")
    out["mean"] = opt.node_mean
    out["scaler"] = refused(lambda: opt.step(grad_scaler=torch.amp.GradScaler("cpu")))
    return out


def test_what_a_node_mean_group_cannot_run_is_refused_in_one_line():
    """Plain parameters on a group's world of 2 with a manager of a 1-rank group, and a GradScaler with a node mean
    (each rank's own loss scale), in the library; `--inside mean` on groups of one rank, on the command line."""
    out = run_workers(_refusal_worker, 2)[0]
    assert out["one"] == ("manager: its replica group has 1 ranks (world_size=) but the parameters are plain on a "
                          "world of 2 (a node mean); build it on each rank of the group with make_manager, which "
                          "takes the group's torch.distributed world")
    assert out["mean"] is True
    assert out["scaler"].startswith("grad_scaler: a node mean inside a replica group averages the gradients before")
    assert all("\n" not in text for text in (out["one"], out["scaler"]))


def test_inside_mean_needs_groups_of_many_ranks(capsys):
    from lioncub.cli import main

    with pytest.raises(SystemExit, match="2"):
        main(["train", "--ft", "--inside", "mean", "--model", "gpt-tiny", "--no-progress"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("lioncub train: error: --inside mean averages the gradients over a replica group's ranks: give "
                    "--nproc-per-replica N > 1 (with one rank a group is one worker)")
