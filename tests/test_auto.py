"""vote='auto': the choice across world sizes and bandwidths (pure), and on a live gloo group."""
from __future__ import annotations

import pytest
import torch

from tests.flat import LionCub
from lioncub.engine import auto, cost
from lioncub.engine.auto import AUTO_CANDIDATES, DEFAULT_GAMMA, choose_vote, gamma_for, vote_costs
from tests.dist import run_workers

N = 25_000_000  # one step of a ~25M-parameter model
GBIT = 1e-9  # beta (s/bit) of a 1 Gbit/s link


def test_one_gigabit_four_workers_picks_onebit():
    # by hand, alpha = 1e-4: onebit sends 2·(3/4·3.125 MB) = 4.69 MB -> 37.5 ms + 6α + γ·n;
    # pbit (4-bit lanes) 18.75 MB -> 150 ms, sign_allreduce 37.5 MB -> 300 ms, gather 9.4 MB + 4·b·n
    costs = vote_costs([N], 4, 1e-4, GBIT)
    assert costs[("onebit", None)]["comm_s"] == pytest.approx(6e-4 + 4_687_500 * 8e-9)
    assert costs[("pbit", 4)]["comm_s"] == pytest.approx(6e-4 + 18_750_000 * 8e-9)
    assert costs[("onebit", None)]["local_s"] == pytest.approx(gamma_for("onebit", 4) * N)
    assert choose_vote([N], 4, 1e-4, GBIT) == ("onebit", None)


def test_local_cost_decides_on_a_fast_link():
    # at 1 Tbit/s nothing is bandwidth-bound: the cheapest pack/unpack wins
    cheapest = min(AUTO_CANDIDATES, key=lambda m: gamma_for(m, 4))
    got = choose_vote([N], 4, 0.0, 1e-12)
    assert got[0] == cheapest
    # and a slow local path loses even where it sends the fewest bytes
    assert choose_vote([N], 4, 1e-4, GBIT, gamma={"onebit": 1e-6})[0] != "onebit"


def test_zero_local_cost_matches_pure_alpha_beta_choice():
    zero = {m: 0.0 for m in AUTO_CANDIDATES}
    for P in (2, 3, 4, 8, 16, 64, 200):
        for alpha, beta in ((0.0, GBIT), (1e-4, GBIT), (5e-3, 1e-10), (1e-2, GBIT / 10)):
            for n in (1_000, 10**6, N):
                options = [(m, auto._bits(m, P)) for m in AUTO_CANDIDATES if cost.method_valid(m, P)]
                times = [cost.predicted_time(m, n, P, alpha, beta, bits=b) for m, b in options]
                want = options[times.index(min(times))]  # the earlier candidate wins a tie
                assert choose_vote([n], P, alpha, beta, gamma=zero) == want, (P, alpha, beta, n)


def test_latency_bound_small_buckets_pick_fewest_messages():
    # 1000 elements, 10 ms per message: gather issues P-1 messages, the allreduces 2(P-1)
    assert choose_vote([1000], 4, 1e-2, GBIT)[0] == "gather"


def test_choice_is_valid_for_every_world_size():
    for P in (1, 2, 3, 7, 15, 16, 127, 128, 255, 256, 1000):
        for beta in (GBIT, GBIT / 100):
            method, bits = choose_vote([10**6, 2 * 10**6], P, 1e-5, beta)
            assert cost.method_valid(method, P, bits=bits)
            if method == "pbit":
                assert bits == cost.predicted_bytes("pbit", 8, P)["bits"]  # the narrowest lane
    assert ("sign_allreduce", None) not in vote_costs([N], 128, 0.0, GBIT)
    assert not any(m == "pbit" for m, _ in vote_costs([N], 256, 0.0, GBIT))
    assert choose_vote([N], 1, 1e-4, GBIT) == (AUTO_CANDIDATES[0], None)  # nothing travels: a tie


def test_bucket_sizes_add_up():
    one = vote_costs([N], 4, 1e-4, GBIT)[("pbit", 4)]
    two = vote_costs([N // 2, N // 2], 4, 1e-4, GBIT)[("pbit", 4)]
    assert two["local_s"] == pytest.approx(one["local_s"])
    assert two["comm_s"] == pytest.approx(one["comm_s"] + 6e-4)  # one more allreduce: 2(P-1)·α


def test_gamma_table_and_errors():
    a, b = DEFAULT_GAMMA["gather"]
    assert gamma_for("gather", 8) == pytest.approx(a + 8 * b)
    assert gamma_for("pbit", 4, {"pbit": 2e-9}) == 2e-9
    with pytest.raises(ValueError, match="gamma keys"):
        gamma_for("pbit", 4, {"grad": 1.0})
    with pytest.raises(ValueError, match="finite"):
        gamma_for("pbit", 4, {"pbit": -1.0})
    with pytest.raises(ValueError, match="candidates"):
        vote_costs([N], 4, 0.0, GBIT, candidates=("grad",))
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="vote='auto' only"):
        LionCub(p, vote="pbit", alpha=1e-4, beta=GBIT)
    with pytest.raises(ValueError, match="both alpha and beta"):
        LionCub(p, vote="auto", alpha=1e-4)


def _auto_worker(rank, world):
    import functools

    torch.manual_seed(rank)  # different init per rank: LionCub broadcasts rank 0's
    model = torch.nn.Linear(64, 64)
    # the real calibrate on this gloo group, with small probes (16 MiB ones take ~20 s on a busy host)
    cost.calibrate = functools.partial(cost.calibrate, sizes=(4096, 65536, 262144), repeats=1)
    live = LionCub(model.parameters(), lr=1e-2, vote="auto")  # calibrate on the group
    # given (alpha, beta) that disagree: rank 0 (1 Gbit/s) would pick onebit, rank 1 (1 Tbit/s)
    # the cheapest local path; rank 0's pick must win on both
    beta = GBIT if rank == 0 else 1e-12
    opt = LionCub(model.parameters(), lr=1e-2, vote="auto", alpha=1e-4, beta=beta)
    n = sum(p.numel() for p in model.parameters())
    model(torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    opt.step()
    sd = opt.state_dict()
    # a resumed 'auto' run keeps the checkpoint's pick whatever it would pick now
    again = LionCub(model.parameters(), lr=1e-2, vote="auto", alpha=0.0, beta=1e-12)
    again.load_state_dict(sd)
    return dict(live=live.vote_chosen, alpha_beta=live.auto_alpha_beta, chosen=opt.vote_chosen,
                vote=opt.vote, saved=(sd["lioncub"]["config"]["vote"], sd["lioncub"]["vote_requested"]),
                resumed=again.vote_chosen, n=n, collectives=opt.last_step_stats.n_collectives,
                params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def test_auto_resolves_identically_on_two_ranks():
    r0, r1 = run_workers(_auto_worker, 2)
    assert r0["live"] == r1["live"] and r0["alpha_beta"] == r1["alpha_beta"]
    assert r0["live"][0] in AUTO_CANDIDATES
    expected = choose_vote([r0["n"]], 2, 1e-4, GBIT)
    assert r0["chosen"] == r1["chosen"] == expected
    assert r0["saved"] == r1["saved"] == (expected[0], "auto")
    assert r0["resumed"] == r1["resumed"] == expected
    # the step really used the chosen method (onebit: two collectives + the has-grad one)
    assert r0["collectives"] == r1["collectives"] == 1 + cost.predicted_bytes(expected[0], 8, 2)["n_collectives"]
    assert torch.equal(r0["params"], r1["params"])


def test_cli_auto_link_and_bench_arguments():
    from lioncub.cli import _without_link, build_parser, main

    args = build_parser().parse_args(["train", "--vote", "auto", "--link", "1gbit", "--nproc", "2"])
    assert (args.vote, args.link) == ("auto", "1gbit")
    assert _without_link(["train", "--link", "1gbit", "--steps", "3", "--link=2gbit"]) == ["train", "--steps", "3"]
    with pytest.raises(SystemExit):  # refused before any namespace is built
        main(["train", "--link", "bogus"])
    bench = build_parser().parse_args(["bench", "net", "--", "--rates", "1gbit"])
    assert (bench.which, bench.script_args) == ("net", ["--rates", "1gbit"])
