"""NodeCub's votes against an independent reference, on 4 gloo ranks as 2 nodes x 2 ranks.

For ``vote='pbit'`` (quantizer None, ``'l1'`` / ``'linf'`` with 8-bit lanes) and
``vote='onebit'``, each with ``shard=True`` and ``shard=False``, the workers run NodeCub
for a few steps and return what they saw (the start, each voter's generator state before
each step, the parameters and momenta after it). This process then recomputes every step
from every rank's gradients, in the order and dtype the code uses:

* node mean ``ḡ_k``: fp32 gradients (a missing one counts as zero), summed over the node's
  two ranks, divided by 2 (``lioncub.optim.nodecub.node_mean``);
* the voters of a parameter: with ``shard=True`` local rank ``shard_owners(...)[i]`` of
  every node, with ``shard=False`` every local rank; their vote's LionCub has one bucket
  (``bucket_mb`` large), its parameters in reversed registration order (``_make_buckets``);
* per node ``c_k = β1·m_k + (1-β1)·ḡ_k`` concatenated over that bucket, then
  ``reference_vote([c_0, c_1], ...)`` with, for ``linf``, each voter's generator replayed
  from the state it had before the step;
* ``θ ← θ·(1-ηλ) - η·u`` and ``m_k ← β2·m_k + (1-β2)·ḡ_k``.

Every rank's parameters after every step, and every voter's momenta, must equal the
reference bit for bit (``torch.equal``; no tolerance).
"""
import pytest
import torch

from lioncub import node_groups, reference_vote
from tests.flat import NodeCub
from lioncub.optim.nodecub import shard_owners
from tests.dist import run_workers

WORLD, LOCAL = 4, 2
SHAPES = [(40,), (30, 3), (17,), (5, 5), (64,), (3,)]
LR, WD, BETAS, STEPS = 1e-2, 0.1, (0.9, 0.99), 3
BUCKET_MB = 4.0  # far more than the model: one bucket per voter

VOTES = {
    "pbit": dict(vote="pbit"),
    "pbit-l1": dict(vote="pbit", quantizer="l1", bits=8),
    "pbit-linf": dict(vote="pbit", quantizer="linf", bits=8),
    "onebit": dict(vote="onebit"),
}
CONFIGS = {f"{name}-{'shard' if shard else 'all'}": dict(kw, shard=shard)
           for name, kw in VOTES.items() for shard in (True, False)}


def _grad(rank: int, step: int, i: int):
    """Rank ``rank``'s gradient of parameter ``i`` at ``step``: of varied scale per element
    (so that the l1/linf codes are not all the same), and None for rank 1, parameter 2 at
    step 1 (node 0's mean is then rank 0's over 2)."""
    if (rank, step, i) == (1, 1, 2):
        return None
    g = torch.Generator().manual_seed(7919 * rank + 101 * step + i)
    x = torch.randn(SHAPES[i], generator=g)
    return x * torch.rand(SHAPES[i], generator=g).mul(3.0).exp()


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _worker(rank, world):
    layout = node_groups(local_size=LOCAL)
    out = {"layout": (layout.nodes, layout.node, layout.local_rank)}
    for name, kwargs in CONFIGS.items():
        params = _params(seed=100 + rank)  # differ per rank: NodeCub starts every rank from rank 0's
        opt = NodeCub(params, lr=LR, betas=BETAS, weight_decay=WD, layout=layout, bucket_mb=BUCKET_MB, **kwargs)
        where = {id(p): i for i, p in enumerate(opt.params)}
        rec = out[name] = {
            "owners": list(opt.owners),
            "mine": list(opt._mine),
            "buckets": [[where[id(opt.voter.param_entries[k][1])] for k in b.index] for b in opt.voter.buckets],
            "start": [p.detach().clone() for p in params],
            "gen": [], "params": [], "momenta": [], "vote_steps": [],
        }
        for s in range(STEPS):
            for i, p in enumerate(params):
                p.grad = _grad(rank, s, i)
            rec["gen"].append(opt.voter.generator.get_state().clone())
            rec["vote_steps"].append(opt.voter.steps)
            opt.step()
            rec["params"].append([p.detach().clone() for p in params])
            rec["momenta"].append({i: opt.voter.state[params[i]]["exp_avg"].detach().clone() for i in opt._mine})
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_worker, WORLD)


def _generator(state):
    g = torch.Generator()
    g.set_state(state)
    return g


def _reference(results, name):
    """Per step, the parameters every local rank must hold, and each node's momenta."""
    kw = CONFIGS[name]
    vote_args = dict(method=kw["vote"], bits=kw.get("bits"), quantizer=kw.get("quantizer"))
    n, nodes = len(SHAPES), WORLD // LOCAL
    sizes = [torch.Size(s).numel() for s in SHAPES]
    owners = shard_owners(sizes, LOCAL) if kw["shard"] else None
    theta = [t.clone() for t in results[0][name]["start"]]  # NodeCub broadcast rank 0's
    m = [[torch.zeros(s) for s in SHAPES] for _ in range(nodes)]
    decay = 1.0 - LR * WD
    traj, moms, zeros = [], [], 0
    for s in range(STEPS):
        gbar = []
        for k in range(nodes):
            ranks = range(k * LOCAL, (k + 1) * LOCAL)
            node = []
            for i in range(n):
                total = torch.zeros(sizes[i])
                for r in ranks:  # fp32 SUM all-reduce of the node's flat fp32 gradients
                    g = _grad(r, s, i)
                    total = total + (torch.zeros(sizes[i]) if g is None else g.reshape(-1).float())
                node.append(total.div(LOCAL).view(SHAPES[i]))
            gbar.append(node)
        # each local rank j's view of the model after the step
        per_local = []
        for j in range(LOCAL):
            voted = [i for i in range(n) if owners[i] == j] if kw["shard"] else list(range(n))
            order = list(reversed(voted))  # the inner LionCub's one bucket
            cs = [torch.cat([torch.mul(m[k][i], BETAS[0]).add_(gbar[k][i], alpha=1 - BETAS[0]).reshape(-1)
                             for i in order]) for k in range(nodes)]
            gens = [_generator(results[k * LOCAL + j][name]["gen"][s]) for k in range(nodes)]
            u = reference_vote(cs, step=s, generators=gens, **vote_args)
            zeros += int((u == 0).sum())
            us = dict(zip(order, u.split([sizes[i] for i in order])))
            per_local.append({i: theta[i].mul(decay).add_(us[i].view(SHAPES[i]), alpha=-LR) for i in voted})
        new = []
        for i in range(n):
            j = owners[i] if kw["shard"] else 0
            new.append(per_local[j][i])
            if not kw["shard"]:  # every local rank voted on it, with identical inputs
                for other in per_local[1:]:
                    assert torch.equal(other[i], new[i]), (name, s, i)
        theta = new
        for k in range(nodes):
            for i in range(n):
                m[k][i] = torch.mul(m[k][i], BETAS[1]).add_(gbar[k][i], alpha=1 - BETAS[1])
        traj.append([t.clone() for t in theta])
        moms.append([[t.clone() for t in mk] for mk in m])
    return traj, moms, owners, zeros


def test_layout(results):
    assert [r["layout"] for r in results] == [(2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_reference(results, name):
    kw = CONFIGS[name]
    traj, moms, owners, zeros = _reference(results, name)
    sizes = [torch.Size(s).numel() for s in SHAPES]
    for rank, out in enumerate(results):
        rec = out[name]
        j = rank % LOCAL
        # the plan the reference assumed: who votes on what, in which bucket order
        if kw["shard"]:
            assert rec["owners"] == owners
            assert sorted(set(owners)) == list(range(LOCAL))  # both local ranks own something
        assert rec["mine"] == ([i for i in range(len(SHAPES)) if owners[i] == j] if kw["shard"]
                               else list(range(len(SHAPES))))
        assert rec["buckets"] == [list(reversed(rec["mine"]))]
        assert rec["vote_steps"] == list(range(STEPS))
        assert sum(sizes[i] for i in rec["mine"]) * 4 < BUCKET_MB * 2**20
        for s in range(STEPS):
            for i, (got, want) in enumerate(zip(rec["params"][s], traj[s])):
                assert torch.equal(got, want), (
                    f"{name}: rank {rank} step {s} param {i}: max |diff| {(got - want).abs().max().item():.3g}, "
                    f"{int((got != want).sum())} of {got.numel()} elements differ")
            for i, got in rec["momenta"][s].items():
                want = moms[s][rank // LOCAL][i]
                assert torch.equal(got, want), (
                    f"{name}: rank {rank} step {s} momentum {i}: max |diff| "
                    f"{(got - want).abs().max().item():.3g}")
    if kw["vote"] == "pbit":  # two voters: disagreements vote 0, and the test met some
        assert zeros > 0
