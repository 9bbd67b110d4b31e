"""LionCub on FSDP2 parameters (DTensors sharded inside a replica, voted across replicas), on real gloo ranks.

The reference holds the whole model on every rank, each parameter as its FSDP2 row chunks (what a
per-tensor scale, e.g. error feedback's, is taken over: each rank's local shard): its gradient is the
sharded run's own (each rank's shard group's mean, gathered whole), and a plain LionCub votes it
over the replicas' group. Every step, every sharded parameter gathered whole must equal the
reference bit for bit.

That reference is the library's own LionCub / LocalCub: a check of the sharding (local shards, per-shard scales,
the replicas' group), blind to a fault in the step or vote math both sides share (ties broken the wrong way pass
it). tests/test_sharded_reference.py checks 2 x 2 runs against hand-written Lion and vote math, and LocalCub's
scatter mean (``vote='onebit', aggregate='mean'``), which has no whole-model reference here (its owners' spans
are of each shard's message), against a per-shard float64 one."""
from __future__ import annotations

import copy


import pytest
import torch
import torch.nn as nn

from tests.flat import LionCub
from tests.dist import run_workers

STEPS = 4


def _model() -> nn.Module:
    # rows 10, 5 and 1: uneven shards over 3 or 4 ranks, and empty ones (the last layer's on every rank but
    # the first of its shard group; 5 rows over 4 shards leave one too)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.Tanh(), nn.Linear(5, 1))


def _shard(model: nn.Module, mesh, **kw) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def _bf16_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def _mesh(replicas: int, shards: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _train(rank, model, opt, ref, ref_opt, steps, first=0) -> list[bool]:
    """``steps`` steps of both; per step whether every sharded parameter equals the reference."""
    same = []
    for step in range(first, first + steps):
        x, y = _batch(rank, step)
        ((model(x) - y) ** 2).mean().backward()
        if ref is not None:
            for pieces, p in zip(ref, model.parameters()):
                for piece, g in zip(pieces, _chunks(p.grad.full_tensor(), p)):  # the shard group's mean, whole
                    piece.grad = g.clone()
            ref_opt.step()
            ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        if ref is not None:
            same.append(all(torch.equal(p.full_tensor(), torch.cat([x.detach() for x in pieces]))
                            for p, pieces in zip(model.parameters(), ref)))
    return same


def _chunks(t, p) -> list:
    """``t``'s FSDP2 row chunks for parameter ``p`` (``torch.chunk`` over the shard mesh; no empty ones)."""
    return list(t.chunk(p.device_mesh.size(), dim=0))


def _reference(model, sharded) -> list[list[nn.Parameter]]:
    """The whole ``model`` as the row chunks of ``sharded``'s parameters, one parameter each."""
    return [[nn.Parameter(x.detach().clone()) for x in _chunks(full.detach(), p)]
            for full, p in zip(model.parameters(), sharded.parameters())]


def _replicas_identical(tensors, group) -> bool:
    import torch.distributed as dist

    for p in tensors:
        mine = p._local_tensor.detach().reshape(-1).clone()
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        if not all(torch.equal(e, mine) for e in everyone):
            return False
    return True


def _vote_worker(rank, world, replicas, shards, runs):
    mesh = _mesh(replicas, shards)
    out = {}
    for name, kw in runs:
        kw = dict(kw)
        mixed = kw.pop("bf16_compute", False)  # FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 reduce
        model = _shard(_model(), mesh["shard"], **(dict(mp_policy=_bf16_policy()) if mixed else {}))
        ref = _reference(_model(), model)
        opt = LionCub(model.parameters(), lr=0.02, weight_decay=0.1, **kw)  # the replicas' group inferred
        kw.pop("overlap", None)  # (the reference's gradients are set by hand: no backward hooks)
        ref_opt = LionCub([x for pieces in ref for x in pieces], lr=0.02, weight_decay=0.1,
                          process_group=mesh.get_group("replicate"), **kw)
        same = _train(rank, model, opt, ref, ref_opt, STEPS)
        moved = not torch.equal(next(model.parameters()).full_tensor(), next(_model().parameters()))
        if opt.driver is not None:  # overlap: FSDP2's hooks launched every bucket's vote during backward
            x, y = _batch(rank, STEPS)
            ((model(x) - y) ** 2).mean().backward()
            moved = moved and len(opt.driver._pending) == len(opt.buckets) > 1
            opt.step()
            opt.zero_grad()
        opt.state_dict()  # every state entry is a parameter's
        if name == "momentum_sync":  # STEPS steps, synced every 2: the replicas' momenta are one
            momenta = [opt.state[p]["exp_avg"] for p in model.parameters()]
            moved = moved and _replicas_identical(momenta, mesh.get_group("replicate"))
        out[name] = (same, moved, opt.world_size, _replicas_identical(model.parameters(),
                                                                      mesh.get_group("replicate")))
    return out


VOTES = [("pbit", dict(vote="pbit")), ("onebit", dict(vote="onebit")),
         ("sign_allreduce", dict(vote="sign_allreduce")), ("grad", dict(vote="grad")),
         ("onebit_worker_ef", dict(vote="onebit", error_feedback="worker")),
         ("fused_off", dict(vote="onebit", fused=False)), 
         ("pbit_l1", dict(vote="pbit", quantizer="l1", bucket_mb=1e-6)),  # a scale per bucket: one shard each
         ("server_ef", dict(vote="onebit", error_feedback="server")), ("bf16", dict(vote="pbit", bf16_compute=True)),
         ("mean", dict(vote="onebit", aggregate="mean", bucket_mb=1e-6, message_mb=1e-6)),
         ("overlap", dict(vote="onebit", overlap=True, bucket_mb=1e-4)),  # votes launched from FSDP2's hooks
         ("momentum_sync", dict(vote="onebit", momentum_sync="all", sync_every=2))]


@pytest.mark.parametrize("replicas,shards,runs", [
    (2, 2, VOTES),
    (2, 1, VOTES[:2] + [v for v in VOTES if v[0] == "overlap"]),
    (1, 4, VOTES[:1]),  # no replicas: Lion on each shard
    (3, 2, VOTES[:3]),
])
def test_each_step_equals_the_whole_model_reference(replicas, shards, runs):
    results = run_workers(_vote_worker, replicas * shards, replicas, shards, runs)
    for rank, out in enumerate(results):
        for name, (same, moved, voters, identical) in out.items():
            assert same == [True] * STEPS, (rank, name, same)
            assert moved, (rank, name)
            assert voters == replicas, (rank, name)
            assert identical, (rank, name)


def _local_worker(rank, world, replicas, shards, runs):
    from tests.flat import LocalCub

    mesh = _mesh(replicas, shards)
    out = {}
    for name, kw in runs:
        kw = dict(kw)
        chunks = kw.pop("chunks", None)
        if chunks is not None:  # (this worker process only) small blocks, on both sides
            from lioncub import lion
            from lioncub.optim import rounds
            rounds.SCALE_BLOCK, lion.FOREACH_CHUNK = chunks["block"], chunks["foreach"]
        model = _shard(_model(), mesh["shard"])
        ref = _reference(_model(), model)
        opt = LocalCub(model.parameters(), lr=0.02, weight_decay=0.1, local_steps=2, **kw)
        if chunks is not None:  # the shards' rounds in chunks and slices; the reference's whole
            opt.round_chunk = chunks["round"]
        ref_opt = LocalCub([x for pieces in ref for x in pieces], lr=0.02, weight_decay=0.1, local_steps=2,
                           process_group=mesh.get_group("replicate"), **kw)
        same = _train(rank, model, opt, ref, ref_opt, 2 * STEPS - 1)
        own = copy.deepcopy((model.state_dict(), opt.state_dict()))  # inside a round: each rank's own
        model2 = _shard(_model(), mesh["shard"])
        opt2 = LocalCub(model2.parameters(), lr=0.02, weight_decay=0.1, local_steps=2, **kw)
        opt2.round_chunk = opt.round_chunk
        model2.load_state_dict(own[0])
        opt2.load_state_dict(own[1])
        same += _train(rank, model, opt, ref, ref_opt, 1, first=2 * STEPS - 1)
        _train(rank, model2, opt2, None, None, 1, first=2 * STEPS - 1)
        resumed = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(),
                                                                                   model2.parameters()))
        replicas_group = mesh.get_group("replicate")
        out[name] = (same, opt.world_size, opt.rounds, _replicas_identical(model.parameters(), replicas_group),
                     resumed)
    return out


LOCAL_RUNS = [("onebit", dict(vote="onebit")), ("grad_adamw", dict(vote="grad", inner="adamw", outer="nesterov",
                                                                   outer_lr=0.7)),
              ("lane_mean_ef", dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True)),
              ("streaming", dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", delay=1)),
              # the first weight's local shard (30 or 60 elements) in slices of 8 for the round and the inner Lion's
              # multi-tensor step on DTensors' local tensors in slices of 7
              ("lane_mean_ef_chunks", dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True,
                                           chunks=dict(block=8, round=10, foreach=7)))]


@pytest.mark.parametrize("replicas,shards", [(2, 2)])
def test_localcub_rounds_on_shards_equal_the_whole_model_reference(replicas, shards):
    results = run_workers(_local_worker, replicas * shards, replicas, shards, LOCAL_RUNS)
    for rank, out in enumerate(results):
        for name, (same, voters, rounds, identical, resumed) in out.items():
            assert same == [True] * (2 * STEPS), (rank, name, same)
            streaming = name == "streaming"  # a round's outer step lands a round late; replicas keep their own
            assert voters == replicas and rounds == STEPS - streaming, (rank, name, voters, rounds)
            assert identical != streaming, (rank, name)
            assert resumed, (rank, name)


def _skip_worker(rank, world):
    mesh = _mesh(2, 2)
    model = _shard(_model(), mesh["shard"])
    opt = LionCub(model.parameters(), lr=0.02, vote="onebit", nonfinite="skip")
    unchanged = []
    for step in range(3):
        x, y = _batch(rank, step)
        ((model(x) - y) ** 2).mean().backward()
        if step == 1 and rank == 1:  # one rank's slice of one parameter: the whole model skips the step
            next(model.parameters()).grad._local_tensor[0, 0] = float("nan")
        before = [p._local_tensor.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        unchanged.append(all(torch.equal(b, p._local_tensor) for b, p in zip(before, model.parameters())))
    return unchanged, opt.skipped_steps, opt.steps


def test_a_non_finite_slice_skips_the_step_on_every_rank():
    for unchanged, skipped, steps in run_workers(_skip_worker, 4):
        assert unchanged == [False, True, False] and skipped == 1 and steps == 2


def _refusal_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(2, 2)
    out = {}

    def refused(build):
        try:
            build()
        except ValueError as exc:
            return str(exc)
        return None

    native = _shard(_model(), mesh)  # a 2-D mesh: FSDP2's own HSDP
    out["native"] = refused(lambda: LionCub(native.parameters()))
    sharded = _shard(_model(), mesh["shard"])
    plain = nn.Parameter(torch.zeros(3))
    out["mixed"] = refused(lambda: LionCub(list(sharded.parameters()) + [plain]))
    tp = nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh["shard"], [Shard(1)]))
    out["shard1"] = refused(lambda: LionCub([tp]))
    out["io"] = refused(lambda: LionCub(sharded.parameters(), momentum_sync="io", model=sharded))
    from lioncub import node_groups
    from tests.flat import NodeCub

    out["nodecub"] = refused(lambda: NodeCub(sharded.parameters(), layout=node_groups(2)))
    from tests.flat import LocalCub

    local = LocalCub(sharded.parameters(), local_steps=2)
    out["localcub_dcp"] = refused(lambda: local.load_state_dict({"state": {}, "param_groups": local.param_groups}))
    out["group"] = refused(lambda: LionCub(sharded.parameters(), process_group=mesh.get_group("shard")))
    dist.barrier()
    return out


def test_refusals_name_the_argument_in_one_line():
    out = run_workers(_refusal_worker, 4)[0]
    assert out["native"].startswith("params: parameter 0 is placed (Replicate(), Shard(dim=0)) on a 2-D mesh")
    assert "fully_shard(module, mesh=mesh['shard'])" in out["native"]
    assert out["mixed"].startswith("params: LionCub takes FSDP2 (DTensor) parameters or plain ones, not both: "
                                   "parameter 6 is a plain tensor, parameter 0 a DTensor")
    assert out["shard1"].startswith("params: parameter 0 is placed (Shard(dim=1)); LionCub takes FSDP2's")
    assert out["io"].startswith("momentum_sync: 'io' selects parameters by name")
    assert out["group"].startswith("process_group: the replicas' group [")
    assert out["nodecub"] == ("params: parameter 0 is an FSDP2 (DTensor) parameter; NodeCub takes plain parameters "
                              "(LionCub and LocalCub take FSDP2's shards and vote them across replicas)")
    assert out["localcub_dcp"] == ("state_dict has no 'local' entry (torch.distributed.checkpoint drops it): LocalCub "
                                   "keeps its inner optimizer and counters there; save and load each rank's "
                                   "opt.state_dict() with torch.save")
    for msg in out.values():
        assert "\n" not in msg


def _dcp_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _mesh(2, 2)

    def build():
        model = _shard(_model(), mesh["shard"])
        return model, LionCub(model.parameters(), lr=0.02, vote="onebit")

    model, opt = build()
    _train(rank, model, opt, None, None, 3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved_momenta = [opt.state[p]["exp_avg"].full_tensor() for p in model.parameters()]
    own = copy.deepcopy((model.state_dict(), opt.state_dict()))  # each rank's own, as torch.save keeps it
    _train(rank, model, opt, None, None, 3, first=3)
    want = [p.full_tensor() for p in model.parameters()]
    m_want = [opt.state[p]["exp_avg"].full_tensor() for p in model.parameters()]

    model2, opt2 = build()  # fresh: other momenta (none), step count 0, other parameters after a step
    _train(rank, model2, opt2, None, None, 1, first=50)
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps_after_load = opt2.steps
    _train(rank, model2, opt2, None, None, 3, first=3)
    got = [p.full_tensor() for p in model2.parameters()]
    m_got = [opt2.state[p]["exp_avg"].full_tensor() for p in model2.parameters()]
    model3, opt3 = build()  # each rank's own state dict, envelope and all
    model3.load_state_dict(own[0])
    opt3.load_state_dict(own[1])
    _train(rank, model3, opt3, None, None, 3, first=3)
    own_same = all(torch.equal(a, b.full_tensor()) for a, b in zip(want, model3.parameters()))
    server = _shard(_model(), mesh["shard"])  # the chunk owners' residuals cannot go through DCP
    server_opt = LionCub(server.parameters(), vote="onebit", error_feedback="server")
    try:
        server_opt.load_state_dict({"state": {}, "param_groups": server_opt.state_dict()["param_groups"]})
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return (steps_after_load, all(torch.equal(a, b) for a, b in zip(want, got)) and own_same and refused == (
        "state_dict: error_feedback='server' keeps the chunk owners' residuals outside the parameters' state, "
        "which torch.distributed.checkpoint does not save; save each rank's opt.state_dict() with torch.save "
        "instead"),
            all(torch.equal(a, b) for a, b in zip(m_want, m_got)),
            type(opt2.state[next(model2.parameters())]["exp_avg"]).__name__, saved_momenta)


def _reshard_worker(rank, world, path, replicas, shards):
    """Load the 2 x 2 checkpoint on ``replicas x shards`` ranks: this replica's momenta, whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _mesh(replicas, shards)
    model = _shard(_model(), mesh["shard"])
    opt = LionCub(model.parameters(), lr=0.02, vote="onebit")
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except BaseException as exc:  # noqa: BLE001 - torch.distributed.checkpoint raises CheckpointException
        return str(exc)
    return opt.steps, [opt.state[p]["exp_avg"].full_tensor() for p in model.parameters()]


def test_dcp_round_trip_is_bit_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_workers(_dcp_worker, 4, path)
    for steps, params_same, momenta_same, kind, _ in results:
        assert steps == 3
        assert params_same and momenta_same
        assert kind == "DTensor"
    by_replica = [results[0][4], results[2][4]]  # ranks 0 and 2: shard 0 of replicas 0 and 1
    assert not all(torch.equal(a, b) for a, b in zip(*by_replica))  # the replicas' momenta differ: both kept
    # two shards -> one: each replica keeps its own momenta, whole
    for rank, (steps, momenta) in enumerate(run_workers(_reshard_worker, 2, path, 2, 1)):
        assert steps == 3
        assert all(torch.equal(a, b) for a, b in zip(momenta, by_replica[rank]))
    # two replicas -> one: the saved state is every replica's; torch.distributed.checkpoint refuses the shape
    refused = run_workers(_reshard_worker, 2, path, 1, 2)[0]
    assert isinstance(refused, str) and "size" in refused.lower(), refused
