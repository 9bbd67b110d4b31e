"""NodeCub with every option it hands its cross-node vote (issue 45, hole 3), on 4 gloo ranks as 2 nodes x 2.

NodeCub = the node's mean gradient (one in-node all-reduce), then a LionCub over the cross-node group
with the options given. The reference here builds that composition by hand: the node mean with
``dist.all_reduce`` over the node's ranks, then a plain LionCub with the same options over the
cross-node group. With ``shard=False`` NodeCub must equal it bit for bit (parameters and every state
entry) for each option, and (the reference cannot see this) all 4 ranks must hold the same parameters:
the two local ranks of a node vote in different cross-node groups, so a per-rank draw seeded by the
global rank would split them. With ``shard=True`` (each local rank votes its own tensors) every rank
of the job must hold the same parameters after each step too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lioncub import node_groups
from tests.flat import LionCub, NodeCub
from tests.dist import run_workers

OPTIONS = [  # every option NodeCub passes to its cross-node LionCub that changes the vote's state
    dict(vote="pbit", error_feedback="worker"),
    dict(vote="onebit", error_feedback="server"),
    dict(vote="onebit", error_feedback="both"),
    dict(vote="pbit", stochastic_signs=True, seed=3),
    dict(vote="onebit", tie="hold"),
    dict(vote="onebit", aggregate="mean"),
    dict(vote="onebit", aggregate="mean", mean_restart=2, mean_norm="geometric"),
]
STEPS = 3


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(11)),
            torch.nn.Parameter(torch.randn(3, 4))]


def _grads(params, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _state(opt, params):
    return [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in params]


def _replicas(params, world) -> bool:
    """Whether every rank of the job holds these parameters bit for bit."""
    mine = torch.cat([p.detach().reshape(-1) for p in params])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], x) for x in every)


def _worker(rank, world):
    layout = node_groups(2)
    out = []
    for cfg in OPTIONS:
        node = _params()
        opt = NodeCub(node, lr=1e-2, layout=layout, shard=False, **cfg)
        ref = _params()
        ref_opt = LionCub(ref, lr=1e-2, process_group=layout.inter, **cfg)
        sharded = _params()
        sharded_opt = NodeCub(sharded, lr=1e-2, layout=layout, shard=True, **cfg)
        same, replicas = True, True
        for step in range(STEPS):
            for ps in (node, ref, sharded):
                _grads(ps, rank, step)
            for p in ref:  # the node's mean gradient, by hand
                dist.all_reduce(p.grad, group=layout.intra)
                p.grad /= layout.local_size
            opt.step()
            ref_opt.step()
            sharded_opt.step()
            same &= all(torch.equal(a, b) for a, b in zip(node, ref))
            replicas &= _replicas(node, world) and _replicas(sharded, world)
        voter = _state(opt.voter, node)
        state_same = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                         for a, b in zip(voter, _state(ref_opt, ref)))
        out.append((same, state_same, replicas, sorted(voter[0])))
    return out


def test_every_vote_option_through_nodecub_is_the_node_mean_then_that_vote():
    for res in run_workers(_worker, 4):
        for cfg, (same, state_same, replicas, keys) in zip(OPTIONS, res):
            assert same and state_same, (cfg, keys)
            assert replicas, cfg
