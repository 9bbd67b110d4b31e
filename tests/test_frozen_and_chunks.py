"""What grows with the model, bounded: frozen parameters never travel; the set-up broadcast goes a chunk at a time."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lioncub import chunks, comm
from tests.flat import LionCub
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
        # chunks.plan_chunks of 5: 3 | the 12 in slices 5, 5, 2 | the empty tensor (nothing sent) | the transposed
        # (non-contiguous) 10 whole | the 7 in slices 5, 2 | 2
        assert sizes == [3, 5, 5, 2, 10, 5, 2, 2], sizes


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


def _round_worker(rank, world, kw, chunk, block=None):
    from tests.flat import LocalCub
    from lioncub.optim import rounds

    if block is not None:
        rounds.SCALE_BLOCK = block  # (this worker process only)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = LocalCub(model.parameters(), lr=0.01, local_steps=2, inner="adamw", **kw)
    if chunk is not None:
        opt.round_chunk = chunk
    exchanges, starts = [], []
    for step in range(8):
        g = torch.Generator().manual_seed(10 * rank + step)
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if opt.synced:
            exchanges.append(opt.last_round_stats.n_collectives)
    if kw.get("delay"):
        opt.flush()
    starts = [opt.state[p]["start"].clone() for p in model.parameters()]
    residuals = [opt.state[p]["residual"].clone() for p in model.parameters()] if kw.get("error_feedback") else []
    plan = [[tuple(pc) for pc in pieces] for pieces in opt._plan()]
    return [p.detach().clone() for p in model.parameters()] + starts + residuals, exchanges, plan


ROUND_KINDS = [dict(vote="grad"), dict(vote="onebit", error_feedback=True),
               dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True),
               dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True, delay=1),
               dict(vote="sign_allreduce", error_feedback=True, delay=1)]
ROUND_IDS = ["fp32-mean", "onebit-ef", "lane-mean", "lane-mean-streaming", "sign-allreduce-streaming"]


@pytest.mark.parametrize("kw", ROUND_KINDS, ids=ROUND_IDS)
def test_a_round_in_chunks_equals_the_round_whole(kw):
    whole = run_workers(_round_worker, 2, kw, None)
    chunked = run_workers(_round_worker, 2, kw, 130)  # 128 | 16 + 64 + 4 elements: two chunks
    for (t_whole, n_whole, _), (t_chunked, n_chunked, plan) in zip(whole, chunked):
        assert plan == [[(0, 0, 128)], [(1, 0, 16), (2, 0, 64), (3, 0, 4)]]
        assert all(torch.equal(a, b) for a, b in zip(t_whole, t_chunked))
        assert all(c > w for c, w in zip(n_chunked, n_whole)), (n_chunked, n_whole)  # more, smaller exchanges


@pytest.mark.parametrize("kw", ROUND_KINDS, ids=ROUND_IDS)
def test_a_tensor_cut_in_slices_gets_the_round_of_the_tensor_whole(kw):
    """A tensor larger than a chunk travels in slices cut on the scale's blocks: its per-tensor scale (the lane
    mean's shared unit, C(v)'s magnitude) is still the whole tensor's, so parameters, θ_s and residuals equal the
    round without chunks bit for bit (blocks of 32 elements here: the 128-element weight has four)."""
    whole = run_workers(_round_worker, 2, kw, None, 32)
    sliced = run_workers(_round_worker, 2, kw, 70, 32)  # 64 + 64 | 16 + 4 | 64: the weight in two slices
    for (t_whole, _, _), (t_sliced, _, plan) in zip(whole, sliced):
        assert plan == [[(0, 0, 64)], [(0, 64, 128)], [(1, 0, 16)], [(2, 0, 64), (3, 0, 4)]]
        assert all(torch.equal(a, b) for a, b in zip(t_whole, t_sliced))


def test_plan_chunks_cuts_large_tensors_on_aligned_slices_and_keeps_the_rest_whole():
    def plan(*args, **kw):
        return [[tuple(pc) for pc in pieces] for pieces in chunks.plan_chunks(*args, **kw)]

    assert plan([3, 10, 2, 2, 0, 9], 5, align=4, uncut=frozenset({5})) == [
        [(0, 0, 3)], [(1, 0, 4)], [(1, 4, 8)], [(1, 8, 10)], [(2, 0, 2), (3, 0, 2), (4, 0, 0)], [(5, 0, 9)]]
    assert plan([3, 10], 5) == [[(0, 0, 3)], [(1, 0, 5)], [(1, 5, 10)]]  # align 1: cut at the chunk
    assert plan([3, 10], 2, align=4) == [[(0, 0, 3)], [(1, 0, 4)], [(1, 4, 8)], [(1, 8, 10)]]  # slices >= align
    assert plan([], 5) == [[]] and chunks.runs([], 5) == []
    assert chunks.runs([3, 10, 2, 2, 0, 9], 5) == [[0], [1], [2, 3, 4], [5]]  # runs: the same, nothing cut
    assert chunks.chunk_cap(10 ** 9, 1 << 22) == 1 << 22 and chunks.chunk_cap(32 * 2 ** 20, 1 << 22) == 2 ** 21
    assert chunks.chunk_cap(1000, 1 << 22) == 1 << 20 and chunks.chunk_cap(1000, 9) == 9


def test_abs_means_of_slices_equal_the_whole_and_one_block_is_the_plain_mean(monkeypatch):
    from lioncub.optim import rounds

    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 1e3
    one = rounds.abs_means([[rounds.block_sums(x)]], [1000], "cpu")
    assert one.dtype == torch.float64 and torch.equal(one, x.abs().mean().double().reshape(1))
    monkeypatch.setattr(rounds, "SCALE_BLOCK", 100)
    whole = rounds.abs_means([[rounds.block_sums(x)]], [1000], "cpu")
    sliced = rounds.abs_means([[rounds.block_sums(x[:300]), rounds.block_sums(x[300:700]),
                                rounds.block_sums(x[700:])]], [1000], "cpu")
    assert torch.equal(whole, sliced)
    assert torch.allclose(whole, x.double().abs().mean().reshape(1), rtol=1e-6, atol=0)
    assert torch.equal(rounds.abs_means([[rounds.block_sums(x[:0])]], [0], "cpu"), torch.zeros(1, dtype=torch.float64))


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
    from lioncub import node_groups
    from tests.flat import NodeCub
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
        if step == 1 and rank % 2:  # one rank of each node without the sliced weight's gradient: it counts as 0
            model[0].weight.grad = None
        opt.step()
        opt.zero_grad()
        collectives += opt.last_intra_stats.n_collectives
    return [p.detach().clone() for p in model.parameters()], collectives


def test_nodecub_in_node_collectives_in_chunks_equal_them_whole():
    whole = run_workers(_node_worker, 4, None)
    chunked = run_workers(_node_worker, 4, 70)  # 128 in slices of 70 + 58 | 16 | 64 + 4
    for (p_whole, n_whole), (p_chunked, n_chunked) in zip(whole, chunked):
        assert all(torch.equal(a, b) for a, b in zip(p_whole, p_chunked))
        assert n_chunked > n_whole, (n_chunked, n_whole)


def _auto_worker(rank, world):
    from lioncub import node_groups
    from tests.flat import NodeCub

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
        params = [nn.Parameter(torch.randn(n)) for n in (7, 30, 2, 11)] + [nn.Parameter(torch.randn(4, 5).t())]
        opt = Lion(params, lr=0.1, weight_decay=0.1, foreach=True)
        for step in range(3):
            for k, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + k))
            opt.step()
        runs = lion_module._chunks(params, [p.grad for p in params], [opt.state[p]["exp_avg"] for p in params])
        return [p.detach().clone() for p in params], runs

    (whole, _), (chunked, runs) = run(None), run(9)
    # 7 | 30 in slices of 9 | 2 | 11 in slices | the transposed 4 x 5 whole (not contiguous)
    assert runs == [[(0, None)], [(1, slice(0, 9))], [(1, slice(9, 18))], [(1, slice(18, 27))], [(1, slice(27, 30))],
                    [(2, None)], [(3, slice(0, 9))], [(3, slice(9, 11))], [(4, None)]]
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
