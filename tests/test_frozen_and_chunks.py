"""What grows with the model, bounded: frozen parameters never travel; the set-up broadcast goes a chunk at a time."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lioncub import LionCub, comm
from tests.dist import run_workers


def _broadcast_worker(rank, world):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(3, generator=g), torch.randn(4, 3, generator=g), torch.randn(0, generator=g),
               torch.randn(5, 2, generator=g).t(), torch.randn(7, generator=g, dtype=torch.float64),
               torch.randn(2, generator=g).to(torch.bfloat16)]
    sizes = []
    real = dist.broadcast

    def spy(t, *args, **kwargs):
        sizes.append(t.numel())
        return real(t, *args, **kwargs)

    dist.broadcast = spy
    try:
        comm.broadcast_from_first(tensors, chunk=5)
    finally:
        dist.broadcast = real
    first = [t.clone() for t in tensors]
    dist.broadcast_object_list(first, src=0)
    return sizes, all(torch.equal(a, b) for a, b in zip(tensors, first))


def test_setup_broadcast_travels_a_chunk_at_a_time():
    for sizes, same in run_workers(_broadcast_worker, 2):
        assert same  # every rank holds rank 0's values, bit for bit (fp32, fp64, bf16, non-contiguous)
        # 3 + 12 elements in slices of 5; the transposed (non-contiguous) 10 alone; then 7 + 2 in chunks of 5
        assert sizes == [5, 5, 5, 10, 5, 4], sizes


def _frozen_worker(rank, world, freeze):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    base = [p.detach().clone() for p in model.parameters()]
    if freeze:
        model[0].weight.requires_grad_(False)
    opt = LionCub(model.parameters(), lr=0.01, vote="onebit")
    sent = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * rank + step)
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sent.append(opt.last_step_stats.bytes_sent)
    unchanged = [torch.equal(p, b) for p, b in zip(model.parameters(), base)]
    refused = None
    if freeze:
        model[0].weight.requires_grad_(True)
        model(torch.randn(5, 8)).pow(2).mean().backward()
        try:
            opt.step()
        except ValueError as exc:
            refused = str(exc)
    return sent, unchanged, refused, opt.plan.frozen == ([model[0].weight] if freeze else [])


def test_frozen_parameters_are_never_sent_nor_updated():
    trained = run_workers(_frozen_worker, 2, False)[0]
    frozen = run_workers(_frozen_worker, 2, True)[0]
    assert trained[1] == [False] * 4 and frozen[1] == [True, False, False, False]
    # the frozen 16 x 8 weight is 128 elements of the model's 212: the vote's bytes shrink accordingly
    assert all(f < t for f, t in zip(frozen[0], trained[0])), (frozen[0], trained[0])
    assert frozen[3] and trained[3]
    assert frozen[2] == ("params: a parameter of shape (16, 8) had requires_grad=False when the optimizer was built "
                         "and now has a gradient; build the optimizer after unfreezing (its parameters with "
                         "requires_grad=False are left out of every step)")


def test_frozen_on_one_rank_without_a_group():
    model = nn.Linear(4, 2)
    model.bias.requires_grad_(False)
    opt = LionCub(model.parameters(), lr=0.1)
    bias = model.bias.detach().clone()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert torch.equal(model.bias, bias)
    assert [p for _, p in opt.param_entries] == [model.weight]


def _round_worker(rank, world, kw, chunk):
    from lioncub import LocalCub

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = LocalCub(model.parameters(), lr=0.01, local_steps=2, inner="adamw", **kw)
    if chunk is not None:
        opt.round_chunk = chunk
    exchanges = []
    for step in range(6):
        g = torch.Generator().manual_seed(10 * rank + step)
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if opt.synced:
            exchanges.append(opt.last_round_stats.n_collectives)
    return [p.detach().clone() for p in model.parameters()], exchanges


@pytest.mark.parametrize("kw", [dict(vote="grad"), dict(vote="onebit", error_feedback=True),
                                dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True)],
                         ids=["fp32-mean", "onebit-ef", "lane-mean"])
def test_a_round_in_chunks_equals_the_round_whole(kw):
    whole = run_workers(_round_worker, 2, kw, None)
    chunked = run_workers(_round_worker, 2, kw, 130)  # 128 | 16 + 64 + 4 elements: two chunks
    for (p_whole, n_whole), (p_chunked, n_chunked) in zip(whole, chunked):
        assert all(torch.equal(a, b) for a, b in zip(p_whole, p_chunked))
        assert all(c > w for c, w in zip(n_chunked, n_whole)), (n_chunked, n_whole)  # more, smaller exchanges


@pytest.mark.parametrize("n,buckets", [(10, 8), (1000, 64), (4097, 100)])
def test_the_divergence_sketch_in_slices_equals_it_at_once(monkeypatch, n, buckets):
    from lioncub.engine import momentum

    m = torch.randn(n, generator=torch.Generator().manual_seed(n))
    whole = momentum.divergence_sketch(m, buckets, torch.Generator().manual_seed(7))
    monkeypatch.setattr(momentum, "SKETCH_SLICE", 3)  # a few chunks (rows) at a time
    sliced = momentum.divergence_sketch(m, buckets, torch.Generator().manual_seed(7))
    assert torch.equal(whole, sliced)
    # and against the definition: signed sums of consecutive chunks of width ceil(n / buckets)
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(7), dtype=torch.int8).double() * 2 - 1
    width = -(-n // buckets)
    want = [float((m.double()[k * width:(k + 1) * width] * signs[k * width:(k + 1) * width]).sum())
            for k in range(buckets)]
    assert sliced.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)


def _node_worker(rank, world, chunk):
    from lioncub import NodeCub, node_groups
    from lioncub.optim import nodecub

    if chunk is not None:
        nodecub.NODE_CHUNK = chunk
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = NodeCub(model.parameters(), lr=0.01, layout=node_groups(local_size=2), vote="onebit")
    collectives = 0
    for step in range(3):
        g = torch.Generator().manual_seed(10 * rank + step)
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        collectives += opt.last_intra_stats.n_collectives
    return [p.detach().clone() for p in model.parameters()], collectives


def test_nodecub_in_node_collectives_in_chunks_equal_them_whole():
    whole = run_workers(_node_worker, 4, None)
    chunked = run_workers(_node_worker, 4, 70)  # every tensor its own chunk but the 16 + 4 biases
    for (p_whole, n_whole), (p_chunked, n_chunked) in zip(whole, chunked):
        assert all(torch.equal(a, b) for a, b in zip(p_whole, p_chunked))
        assert n_chunked > n_whole, (n_chunked, n_whole)


def _auto_worker(rank, world):
    from lioncub import NodeCub, node_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    # rank 1 (its cross-node group's first rank) prices 'gather' out: its group alone would pick 'onebit'
    gamma = {"gather": (1.0, 0.0)} if rank == 1 else None
    opt = NodeCub(model.parameters(), lr=0.01, layout=node_groups(local_size=2), shard=False, vote="auto",
                  alpha=1e-4, beta=1e-9, gamma=gamma)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step()
    return opt.voter.vote_chosen


def test_nodecub_auto_runs_one_pick_on_every_rank():
    """Two cross-node groups, [0, 2] and [1, 3], whose first ranks price the votes apart: one pick, rank 0's."""
    picks = run_workers(_auto_worker, 4)
    assert picks == [("gather", None)] * 4, picks


def test_lion_multi_tensor_step_in_chunks_equals_it_whole(monkeypatch):
    from lioncub import Lion, lion as lion_module

    def run(chunk):
        if chunk is not None:
            monkeypatch.setattr(lion_module, "FOREACH_CHUNK", chunk)
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(n)) for n in (7, 30, 2, 11)]
        opt = Lion(params, lr=0.1, weight_decay=0.1, foreach=True)
        for step in range(3):
            for k, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + k))
            opt.step()
        return [p.detach().clone() for p in params]

    whole, chunked = run(None), run(9)  # 7 | 30 | 2 | 11 ... in runs of at most 9 elements
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_fake_tensors_take_the_torch_path_and_leave_no_table_behind():
    """Under FakeTensorMode (a memory estimate, a trace) the C loops would read null pointers: the fused path
    is refused for fake tensors; the unpack tables made there stay there (real tensors afterwards get real ones)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lioncub import fused
    from lioncub.wire import kernels

    packed = torch.tensor([0b10110001, 0xFF], dtype=torch.uint8)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(packed)
        assert not fused.usable([torch.zeros(4)])
        assert fused.unusable_reason([torch.zeros(4)]) == "fake tensors (FakeTensorMode) have no data for the loops"
        kernels.unpack_pm1(fake, 16, torch.float32)
        kernels.unpack_pm1(fake, 16)
    real = kernels.unpack_pm1(packed, 16, torch.float32)
    assert real.tolist() == [1, -1, -1, -1, 1, 1, -1, 1] + [1] * 8
    assert kernels.unpack_pm1(packed, 16).tolist() == real.tolist()
