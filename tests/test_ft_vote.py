"""FTLionCub: LionCub's every-step vote on torchft, on real processes (tests/ft_worker.py, the helpers of
tests/test_ft.py)."""
from __future__ import annotations

import pytest

from tests.test_ft import (KILLED, assert_equals_a_run_resumed_without_the_failure,  # (requires torchft)
                           assert_rejoined, assert_survivors_identical, rounds_of, run_faulted, run_three)


@pytest.mark.slow
@pytest.mark.parametrize("vote", ["every-pbit", "every-sign_allreduce"])
def test_the_every_step_vote_with_no_failure_equals_lioncub_on_a_plain_group(tmp_path, vote):
    """FTLionCub: LionCub's vote every step on torchft (a quorum per step), three replicas, no failure: every step
    bit-identical to LionCub on a 3-rank gloo group (binary pbit lanes; sign_allreduce)."""
    args = ("--steps", "12", "--vote", vote)
    ft = [rounds_of(p) for p in run_three(tmp_path, "ft", *args)]
    plain = [rounds_of(p) for p in run_three(tmp_path, "plain", *args)]
    assert sorted(plain[0]) == list(range(1, 13))
    for r in range(3):
        assert sorted(ft[r]) == sorted(plain[0])
        for k in plain[0]:
            assert ft[r][k]["digest"] == plain[r][k]["digest"] == plain[0][k]["digest"], (r, k)
            assert (ft[r][k]["participants"], ft[r][k]["contributors"]) == (3, 3)


@pytest.mark.slow
def test_the_every_step_vote_survives_a_kill_inside_its_lanes_and_a_rejoin(tmp_path):
    """FTLionCub (binary pbit lanes every step): replica 2 killed inside step 8's lane all-reduce. The survivors
    retry step 8 on a quorum of 2 (the lanes then sized and decided for 2) with no step lost or repeated and stay
    identical: exactly one uncommitted agreement each, step 8 and every step on the two alone with P = C = 2, and
    bit for bit LionCub on a plain gloo group of the two resumed from their own states at step 7. The
    restarted replica heals (parameters and Lion momentum from a peer), abstains in its first step's vote (P = 3,
    C = 2) and is bit-identical to the survivors at every commit after."""
    rounds = 60
    setting = ("--vote", "every-pbit")
    logs = run_faulted(tmp_path, rounds, "--fault", f"2:{KILLED}:lanes", restart=2, setting=setting,
                       save_at=KILLED - 1)
    last = assert_survivors_identical(logs, rounds=rounds)
    compared = assert_equals_a_run_resumed_without_the_failure(tmp_path, logs, KILLED - 1, setting=setting)
    assert compared[0] == KILLED
    rejoined = compared[-1] + 1
    for r in (0, 1):
        assert [(logs[r][k]["participants"], logs[r][k]["contributors"], logs[r][k]["uncommitted"])
                for k in range(1, last + 1)] == \
            [(3, 3, 0)] * (KILLED - 1) + [(2, 2, 1)] * len(compared) + [(3, 2, 1)] + [(3, 3, 1)] * (last - rejoined)
    assert max(logs["first_life"]) == KILLED - 1
    assert_rejoined(logs)
