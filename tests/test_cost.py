"""The α-β cost model: formulas against hand-computed values, method choice, calibration."""
from __future__ import annotations

import doctest
import math

import pytest

from lioncub.engine import cost
from lioncub import votes
from lioncub.engine.auto import AUTO_CANDIDATES, choose_vote
from lioncub.engine.cost import fit_alpha_beta, method_valid, predicted_bytes, predicted_time

N = 10**6

# n = 10^6, P = 4, worked by hand from docs/design.md §3:
#   grad fp32 : allreduce 4e6 B            -> 2·3/4·4e6        = 6e6 B
#   grad bf16 : allreduce 2e6 B            -> 1.5·2e6          = 3e6 B
#   sign_ar   : allreduce 1e6 B            -> 1.5e6 B
#   gather    : all_gather 125000 B/rank   -> 3·125000         = 375000 B
#   onebit    : N = 31250·4 = 125000; a2a 3/4·125000 + ag 3·31250 = 187500 B
#   pbit      : P = 4 > 3 -> 4-bit lanes, 500000 B allreduce -> 750000 B
HAND_P4 = [
    ("grad", {}, 6e6, 1, [4_000_000]),
    ("grad", {"grad_dtype": "bf16"}, 3e6, 1, [2_000_000]),
    ("sign_allreduce", {}, 1.5e6, 1, [1_000_000]),
    ("gather", {}, 375000.0, 1, [125_000]),
    ("onebit", {}, 187500.0, 2, [125_000, 31_250]),
    ("pbit", {}, 750000.0, 1, [500_000]),
    ("pbit", {"bits": 8}, 1.5e6, 1, [1_000_000]),
    ("pbit", {"quantizer": "l1"}, 1.5e6, 1, [1_000_000]),  # multi-level quantizers: 8-bit lanes
    ("pbit", {"quantizer": "sign"}, 750000.0, 1, [500_000]),  # {-1,0,1} -> [0,2]: 2·4 = 8 <= 15
]


@pytest.mark.parametrize("method,kw,sent,ncoll,payload", HAND_P4)
def test_bytes_by_hand_p4(method, kw, sent, ncoll, payload):
    got = predicted_bytes(method, N, 4, **kw)
    assert got["bytes_sent"] == pytest.approx(sent)
    assert got["bytes_recv"] == got["bytes_sent"]
    assert got["n_collectives"] == ncoll
    assert got["payload_bytes"] == payload


def test_time_by_hand_p4():
    a, b = 1e-4, 1e-9
    assert predicted_time("grad", N, 4, a, b) == pytest.approx(6e-4 + 6e6 * 8e-9)
    assert predicted_time("sign_allreduce", N, 4, a, b) == pytest.approx(6e-4 + 0.012)
    assert predicted_time("gather", N, 4, a, b) == pytest.approx(3e-4 + 0.003)
    assert predicted_time("onebit", N, 4, a, b) == pytest.approx(2 * (3e-4 + 7.5e-4))
    assert predicted_time("pbit", N, 4, a, b) == pytest.approx(6e-4 + 0.006)
    # the pack/compute term applies to votes only
    assert predicted_time("pbit", N, 4, a, b, gamma=1e-9) == pytest.approx(6e-4 + 0.006 + 1e-3)
    assert predicted_time("grad", N, 4, a, b, gamma=1e-9) == pytest.approx(0.0486)


def test_padding_and_single_worker():
    # onebit pads to whole bytes per rank: n = 1001, P = 3 -> N = ceil(1001/24)·3 = 126
    assert predicted_bytes("onebit", 1001, 3)["payload_bytes"] == [126, 42]
    assert predicted_bytes("gather", 1001, 3)["payload_bytes"] == [126]
    assert predicted_bytes("pbit", 1001, 3, bits=2)["payload_bytes"] == [251]
    for m in cost.METHODS:
        one = predicted_bytes(m, N, 1)  # nothing travels, but the vote still calls the collectives
        assert one["bytes_sent"] == 0 and one["n_collectives"] == (2 if m == "onebit" else 1)
        assert predicted_time(m, N, 1, 1e-3, 1e-9) == 0.0
        assert predicted_bytes(m, 0, 4)["n_collectives"] == 0  # empty tensors short-cut


def test_methods_lists_the_registry_each_in_its_own_words():
    """grad then every registered vote method, each described by its own docstring's first
    paragraph, which names every collective its plan issues."""
    listed = cost.methods()
    assert tuple(listed) == cost.METHODS == ("grad", *votes.METHODS)
    assert listed["grad"] == cost.GRAD_PLAN
    assert listed["onebit"] == ("packed sign bits; all-to-all of P chunks, each rank votes its chunk, "
                                "all-gather of the voted bits.")
    for name, cls in votes.METHODS.items():
        assert listed[name] and "\n" not in listed[name] and not listed[name].startswith("``"), name
        for kind, _ in cls(4).plan(N):
            assert kind.replace("_", "-").replace("allreduce", "all-reduce") in listed[name], (name, kind)


def test_methods_lists_a_newly_registered_method_by_its_class_docstring(monkeypatch):
    class Trial(votes.VoteMethod):
        """``trial``: int8 signs, one all-gather;
        summed on every rank.

        Not a method anyone ships."""
        name = "trial"

    monkeypatch.setitem(votes.METHODS, "trial", Trial)
    assert cost.methods()["trial"] == "int8 signs, one all-gather; summed on every rank."


def test_the_module_examples_run():
    """The doctests of cost.py (the suite does not collect --doctest-modules)."""
    result = doctest.testmod(cost)
    assert result.attempted >= 3 and result.failed == 0


def test_lane_widths():
    assert [predicted_bytes("pbit", 8, p)["bits"] for p in (2, 3, 4, 15, 16, 255)] == [2, 2, 4, 4, 8, 8]
    assert method_valid("pbit", 15, bits=4) and not method_valid("pbit", 16, bits=4)
    assert not method_valid("pbit", 256)  # binary signs overflow even 8-bit lanes
    # 'sign' sends {-1,0,1} offset to [0,2]: 2P <= 2^w - 1
    assert method_valid("pbit", 7, bits=4, quantizer="sign") and not method_valid("pbit", 8, bits=4, quantizer="sign")
    # multi-level quantizers take s = floor((2^w-1)/2P) levels and need s >= 1
    assert method_valid("pbit", 127, quantizer="l1") and not method_valid("pbit", 128, quantizer="l1")
    assert method_valid("sign_allreduce", 127) and not method_valid("sign_allreduce", 128)
    assert not method_valid("onebit", 4, quantizer="l1") and not method_valid("gather", 4, quantizer="l1")


@pytest.mark.parametrize(
    "call,needle",
    [  # each message must start by naming the argument at fault (and say what it got)
        (lambda: predicted_bytes("allgather", N, 4), r"^method must be one of .*; got 'allgather'$"),
        (lambda: predicted_bytes("grad", N, 4, grad_dtype="fp16"), r"^grad_dtype must be one of .*; got 'fp16'$"),
        (lambda: predicted_bytes("pbit", N, 4, bits=3), r"^bits must be None or one of \(2, 4, 8\) .*; got 3$"),
        (lambda: predicted_bytes("pbit", N, 16, bits=4), r"^method='pbit' \(bits=4, .*not valid for world_size=16$"),
        (lambda: predicted_bytes("sign_allreduce", N, 128),
         r"^method='sign_allreduce' .*not valid for world_size=128$"),
        (lambda: predicted_bytes("grad", -1, 4), r"^n must be an int >= 0, got -1$"),
        (lambda: predicted_bytes("grad", N, 0), r"^world_size must be an int >= 1, got 0$"),
        (lambda: predicted_bytes("pbit", N, 4, quantizer="l3"), r"^quantizer must be None or one of .*; got 'l3'$"),
        (lambda: predicted_bytes("onebit", N, 4, quantizer="l1"), r"^method='onebit' .*quantizer='l1'\) is not valid"),
        (lambda: predicted_time("grad", N, 4, -1.0, 1e-9), r"^alpha must be a finite number >= 0; got -1\.0$"),
        (lambda: predicted_time("grad", N, 4, 1e-4, float("nan")), r"^beta must be a finite number >= 0; got nan$"),
        (lambda: choose_vote([N], 256, 1e-4, 1e-9, candidates=("pbit", "sign_allreduce")),
         r"^no candidate in \('pbit', 'sign_allreduce'\) is valid for world_size=256$"),
    ],
)
def test_bad_input_names_argument(call, needle):
    """A bare ``match="n"`` would pass for any message holding the letter n: anchored at the
    start, each pattern needs the message to name the argument at fault first."""
    with pytest.raises(ValueError, match=needle):
        call()


WORLD = (2, 4, 8, 16, 64, 200)
ZERO = {m: 0.0 for m in AUTO_CANDIDATES}  # no local cost: the choice is the α-β model's alone


def _choose(n, P, alpha, beta, candidates=AUTO_CANDIDATES):
    """The run-time choice (auto.choose_vote) on one bucket, priced by the α-β model only."""
    return choose_vote([n], P, alpha, beta, gamma=ZERO, candidates=candidates)


@pytest.mark.parametrize("P", WORLD)
def test_choose_latency_bound_prefers_fewest_messages(P):
    # tiny tensor, huge α: gather's P-1 messages beat every 2(P-1)-message method
    assert _choose(64, P, alpha=1e-3, beta=1e-12) == ("gather", None)


@pytest.mark.parametrize("P", WORLD)
def test_choose_bandwidth_bound(P):
    # 1 Gbit/s-like link, 10^8 elements: bytes dominate.
    # P = 2: gather and onebit both send n/8 bytes, gather needs one message less.
    # P >= 3: onebit sends 2(P-1)/P·n/8 < (P-1)·n/8 (gather) < 2(P-1)/P·n·w/8 (pbit, w >= 2).
    want = ("gather", None) if P == 2 else ("onebit", None)
    assert _choose(10**8, P, alpha=5e-5, beta=1e-9) == want


@pytest.mark.parametrize(
    "P,want",
    [
        (2, ("pbit", 2)),
        (4, ("pbit", 4)),
        (8, ("pbit", 4)),
        (16, ("sign_allreduce", None)),  # 4-bit lanes overflow; 8-bit pbit ties int8, first wins
        (64, ("sign_allreduce", None)),
        (200, ("pbit", 8)),  # int8 sums overflow past 127 workers
    ],
)
def test_choose_among_allreduce_paths(P, want):
    got = _choose(10**7, P, 5e-5, 1e-9, candidates=("sign_allreduce", "pbit"))
    assert got == want


def test_fit_recovers_synthetic_alpha_beta():
    P, a, b = 4, 2e-4, 8e-10
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 24]
    times = [2 * (P - 1) * a + 2 * (P - 1) / P * 8 * s * b for s in sizes]
    fa, fb = fit_alpha_beta(sizes, times, P)
    assert fa == pytest.approx(a, rel=1e-6) and fb == pytest.approx(b, rel=1e-6)
    with pytest.raises(ValueError, match="distinct"):
        fit_alpha_beta([10, 10], [1.0, 2.0], P)


def _live_worker(rank, world_size):
    import torch

    from lioncub.comm import CommStats
    from lioncub.votes.api import majority_vote

    sent = {}
    for method, kw in [("sign_allreduce", {}), ("gather", {}), ("onebit", {}), ("pbit", {}),
                       ("pbit", {"bits": 8}), ("pbit", {"quantizer": "l1"})]:
        for n in (1, 1001, 4096):
            stats = CommStats()
            majority_vote(torch.randn(n), method=method, step=0, stats=stats, **kw)
            sent[(method, kw.get("bits"), kw.get("quantizer"), n)] = (stats.bytes_sent, stats.n_collectives)
    return cost.calibrate(sizes=(1 << 10, 1 << 16, 1 << 20), repeats=2), sent


def test_live_two_workers_calibrate_and_vote_bytes():
    """One gloo group (spawning costs ~6 s): calibrate agrees across ranks, and the
    bytes/collectives the real vote records are the model's, padding included (docs/design.md §6, §12)."""
    from tests.dist import run_workers

    P = 2
    (ab0, sent0), (ab1, sent1) = run_workers(_live_worker, P)
    a0, b0 = ab0
    assert ab0 == ab1
    assert 0 < a0 < 1 and math.isfinite(a0)
    assert 0 < b0 < 1e-6 and math.isfinite(b0)  # loopback moves far more than 1 Mbit/s
    assert sent0 == sent1
    for (method, bits, quantizer, n), (nbytes, ncoll) in sent0.items():
        want = predicted_bytes(method, n, P, bits=bits, quantizer=quantizer)
        assert nbytes == pytest.approx(want["bytes_sent"]), (method, bits, quantizer, n)
        assert ncoll == want["n_collectives"], (method, bits, quantizer, n)


def _probe_count(rank, world, max_probe_s):
    from lioncub.testing.audit import DeviceAudit

    with DeviceAudit("cpu") as audit:
        ab = cost.calibrate(sizes=(1 << 24, 1 << 10, 1 << 16), repeats=1, warmup=0, max_probe_s=max_probe_s)
    return ab, sum("allreduce" in c.name for c in audit.collectives)


def test_calibrate_skips_the_larger_probes_once_one_is_slow_on_every_rank_alike():
    """Each size probed costs one timed all-reduce and one agreement; a stop after two sizes leaves the 16 MiB
    probe out on both ranks (a rank that went on alone would hang the group), and the fit still comes out."""
    from tests.dist import run_workers

    stopped = run_workers(_probe_count, 2, 0.0)  # every probe is "slow": stop after the two smallest sizes
    assert [n for _, n in stopped] == [4, 4] and stopped[0][0] == stopped[1][0]
    full = run_workers(_probe_count, 2, math.inf)
    assert [n for _, n in full] == [6, 6] and full[0][0] == full[1][0]
    with pytest.raises(ValueError, match="max_probe_s"):
        cost.calibrate(sizes=(1, 2), max_probe_s=-1.0)
