"""NodeCub on a real 4-rank gloo group laid out as 2 nodes x 2 ranks.

The reference (float64, in this process): the node's mean gradient, the node's Lion
momentum, then ``reference_vote`` over the nodes' ``c``. The update each rank applied is
read back from its parameters, ``u = (θ·(1-ηλ) - θ') / η``, rounded to the nearest
integer (|error| < 1e-3 with η = 1e-2), and compared with the reference exactly.
"""
import math

import pytest
import torch

from lioncub import Lion, node_groups, reference_vote
from tests.flat import LionCub, NodeCub
from lioncub.engine import cost
from lioncub.optim.nodecub import shard_owners
from tests.dist import run_workers

SHAPES = [(40,), (30, 3), (17,), (5, 5)]
LR, WD, BETAS, STEPS = 1e-2, 0.1, (0.9, 0.99), 3
CONFIGS = {
    "onebit-shard": dict(vote="onebit"),
    "onebit-all": dict(vote="onebit", shard=False),
    "sign_allreduce-shard": dict(vote="sign_allreduce"),
    "gather-shard": dict(vote="gather", tie="plus"),
    "pbit-shard": dict(vote="pbit"),
}


def _grad(rank: int, step: int, i: int):
    """Rank ``rank``'s gradient of parameter ``i`` at ``step``; None where a test leaves it out:
    at step 1 rank 1 has none for parameter 2 (counts as zero in node 0's mean); at step 2 no
    rank has one for parameter 3 (skipped everywhere, as Lion skips it)."""
    if (step, i) == (1, 2) and rank == 1 or (step, i) == (2, 3):
        return None
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + i)
    return torch.randn(SHAPES[i], generator=g)


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _run(opt, params, rank, steps=STEPS, first=0, after_step=None):
    traj = [[p.detach().clone() for p in params]]
    for s in range(first, steps):
        for i, p in enumerate(params):
            p.grad = _grad(rank, s, i)
        opt.step()
        traj.append([p.detach().clone() for p in params])
        if after_step is not None:
            after_step()
    return traj


def _worker(rank, world):
    out = {}
    layout = node_groups(2)
    out["layout"] = (layout.nodes, layout.node, layout.local_rank)
    for name, kwargs in CONFIGS.items():
        params = _params(seed=rank)  # different on every rank: NodeCub starts all from rank 0's
        opt = NodeCub(params, lr=LR, betas=BETAS, weight_decay=WD, layout=layout, check_every=1, **kwargs)
        sent = out[name + "/vote_bytes"] = []  # per step, what the cross-node vote (its LionCub) sent
        out[name] = _run(opt, params, rank, after_step=lambda: sent.append(opt.voter.last_step_stats.bytes_sent))
        out[name + "/owners"] = opt.owners
        out[name + "/inter_bytes"] = opt.last_step_stats.bytes_sent
    # resume: a fresh optimizer loaded with step 2's state continues bit for bit
    params = _params(seed=0)
    opt = NodeCub(params, lr=LR, betas=BETAS, weight_decay=WD, layout=layout, vote="onebit")
    _run(opt, params, rank, steps=2)
    saved, at = opt.state_dict(), [p.detach().clone() for p in params]
    params2 = [torch.nn.Parameter(t.clone()) for t in at]
    opt2 = NodeCub(params2, lr=LR, betas=BETAS, weight_decay=WD, layout=layout, vote="onebit")
    opt2.load_state_dict(saved)
    out["resumed"] = _run(opt2, params2, rank, first=2)[-1]
    out["straight"] = _run(opt, params, rank, first=2)[-1]
    # one rank per node: exactly the flat LionCub
    flat_layout = node_groups(1)
    params, params_flat = _params(seed=0), _params(seed=0)
    a = _run(NodeCub(params, lr=LR, betas=BETAS, weight_decay=WD, layout=flat_layout, vote="onebit"), params, rank)
    b = _run(LionCub(params_flat, lr=LR, betas=BETAS, weight_decay=WD, vote="onebit"), params_flat, rank)
    out["flat_equal"] = all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    # one node of four: the node mean, then Lion
    params = _params(seed=0)
    out["one_node"] = _run(NodeCub(params, lr=LR, betas=BETAS, weight_decay=WD, layout=node_groups(4),
                                   vote="sign_allreduce"), params, rank)
    # a NaN on rank 3 only: every rank skips (skip_step) or raises (raise)
    for policy in ("skip_step", "raise"):
        params = _params(seed=0)
        opt = NodeCub(params, lr=LR, layout=layout, vote="onebit", nonfinite=policy)
        for i, p in enumerate(params):
            p.grad = torch.full(SHAPES[i], float("nan") if rank == 3 and i == 1 else 1.0)
        before = [p.detach().clone() for p in params]
        try:
            opt.step()
            out[policy] = ("stepped", opt.skipped_steps, all(torch.equal(x, p) for x, p in zip(before, params)))
        except FloatingPointError as exc:
            out[policy] = ("raised", str(exc))
    return out


def _reference(name: str, kwargs: dict, start):
    """Per step, the update u every rank must apply (None = parameter skipped)."""
    method = kwargs["vote"]
    tie = kwargs.get("tie", "alternate")
    moms = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(2)]
    updates = []
    for s in range(STEPS):
        step_u = []
        for i in range(len(SHAPES)):
            grads = [_grad(r, s, i) for r in range(4)]
            if all(g is None for g in grads):
                step_u.append(None)
                continue
            cs = []
            for k in range(2):  # node k = ranks 2k, 2k+1
                mean = sum((grads[r] if grads[r] is not None else torch.zeros(SHAPES[i])).double()
                           for r in (2 * k, 2 * k + 1)) / 2
                cs.append(BETAS[0] * moms[k][i] + (1 - BETAS[0]) * mean)
                moms[k][i] = BETAS[1] * moms[k][i] + (1 - BETAS[1]) * mean
            step_u.append(reference_vote([c.float() for c in cs], method=method, step=s, tie=tie))
        updates.append(step_u)
    return updates


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, 4, timeout_s=120)


def test_layout_is_two_nodes_of_two(results):
    assert [r["layout"] for r in results] == [(2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_update_is_the_node_mean_then_a_vote_across_nodes(results, name):
    traj = results[0][name]
    updates = _reference(name, CONFIGS[name], traj[0])
    for s, step_u in enumerate(updates):
        for i, u in enumerate(step_u):
            before, after = traj[s][i], traj[s + 1][i]
            if u is None:
                assert torch.equal(before, after), f"step {s} param {i}: no gradient anywhere, must be untouched"
                continue
            applied = (before * (1 - LR * WD) - after) / LR
            assert (applied - applied.round()).abs().max() < 1e-3
            assert torch.equal(applied.round(), u), f"{name} step {s} param {i}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_replicas_identical_on_all_four_ranks(results, name):
    for r in range(1, 4):
        for a, b in zip(results[0][name], results[r][name]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{name}: rank {r} differs from rank 0"
    start = _params(seed=0)  # every rank started from rank 0's parameters
    assert all(torch.equal(x, y) for x, y in zip(results[3][name][0], start))


def test_shards_split_the_model_and_each_node_sends_one_voters_bytes(results):
    """Per rank and step, the exact bytes of the cross-node vote: its agreement all-reduce (one
    uint8 count per parameter it holds, plus one) and one vote of the elements it holds that
    have a gradient somewhere (lioncub.engine.cost, 2 voters). Sharded, a node's two ranks together
    send one voter's vote of the whole model (up to rounding each shard to whole lanes);
    unsharded, each of them sends it."""
    sizes = [math.prod(s) for s in SHAPES]
    assert results[0]["onebit-shard/owners"] == shard_owners(sizes, 2) == [1, 0, 1, 1]
    for name, kwargs in CONFIGS.items():
        method, shard = kwargs["vote"], kwargs.get("shard", True)

        def one_voter(n):
            return cost.predicted_bytes(method, n, 2)["bytes_sent"]

        for s in range(STEPS):
            active = [i for i in range(len(SHAPES)) if any(_grad(r, s, i) is not None for r in range(4))]
            whole = one_voter(sum(sizes[i] for i in active))
            for node in range(2):
                payload = []
                for r in (2 * node, 2 * node + 1):
                    owners = results[r][name + "/owners"]
                    assert owners == ([1, 0, 1, 1] if shard else [r % 2] * len(SHAPES)), (name, r)
                    mine = [i for i, j in enumerate(owners) if j == r % 2]
                    n = sum(sizes[i] for i in mine if i in active)
                    # the vote alone: NodeCub's one agreement over the world serves its voter (no agreement of its own)
                    assert results[r][name + "/vote_bytes"][s] == one_voter(n), (name, s, r)
                    payload.append(results[r][name + "/vote_bytes"][s])
                if shard:  # each shard rounds up to whole bytes/lanes: at most one element's vote more
                    assert whole <= sum(payload) <= whole + one_voter(1), (name, s, payload, whole)
                else:
                    assert payload == [whole, whole], (name, s)
        last = [results[r][name + "/inter_bytes"] for r in range(4)]
        assert all(b > results[r][name + "/vote_bytes"][-1] for r, b in enumerate(last))  # + flag, replica check
    sharded = [results[r]["onebit-shard/vote_bytes"][-1] for r in range(4)]
    full = [results[r]["onebit-all/vote_bytes"][-1] for r in range(4)]
    assert all(a < b for a, b in zip(sharded, full))


def test_resume_is_bit_exact(results):
    for r in range(4):
        assert all(torch.equal(a, b) for a, b in zip(results[r]["resumed"], results[r]["straight"]))


def test_one_rank_per_node_is_the_flat_lioncub(results):
    assert all(r["flat_equal"] for r in results)


def test_one_node_is_the_node_mean_then_lion(results):
    params = _params(seed=0)
    lion = Lion(params, lr=LR, betas=BETAS, weight_decay=WD)
    for s in range(STEPS):
        for i, p in enumerate(params):
            grads = [_grad(r, s, i) for r in range(4)]
            p.grad = None if all(g is None for g in grads) else sum(
                (g if g is not None else torch.zeros(SHAPES[i])).double() for g in grads).float() / 4
        lion.step()
        for got, want in zip(results[0]["one_node"][s + 1], params):
            # fp32 all-reduce vs a float64 mean: the sums differ in the last bit at most
            torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=0)


def test_nonfinite_on_one_rank_is_agreed_by_all(results):
    assert all(r["skip_step"] == ("stepped", 1, True) for r in results)
    assert all(r["raise"][0] == "raised" for r in results)
    assert "non-finite gradient on 1 rank(s)" in results[0]["raise"][1]


def _bad_layouts(rank, world):
    errors = []
    for local_size in (3, 0, None):
        try:
            node_groups(local_size)
        except ValueError as exc:
            errors.append(str(exc))
    layout = node_groups(2)
    params = _params(seed=0)
    for kwargs in (dict(process_group=None), dict(overlap=True), dict(shard="yes"), dict(nonfinite="ignore")):
        try:
            NodeCub(params, layout=layout, **kwargs)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    try:
        NodeCub([torch.nn.Parameter(torch.zeros(3))], layout=layout)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def test_bad_layouts_are_named_errors(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    errors = run_workers(_bad_layouts, 2, timeout_s=60)[0]
    assert len(errors) == 8, errors
    assert "local_size must divide the world size 2" in errors[0]
    assert "local_size must be an int >= 1" in errors[1]
    assert "LOCAL_WORLD_SIZE" in errors[2]
    assert errors[3].startswith("process_group is not a NodeCub argument")
    assert errors[4].startswith("overlap is not a NodeCub argument")
    assert "shard must be a bool" in errors[5]
    assert "nonfinite must be one of" in errors[6]
    assert "shard=True needs at least local_size=2 parameters" in errors[7]
