"""Reliability (issue 7) on real gloo groups: argument validation, mismatched models named
by rank and parameter, the non-finite policy with NaN on one rank only, the replica
checksum guard, and a killed or stalled worker making the survivors raise in time."""
import datetime
import math
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.flat import LionCub
from lioncub.comm import CollectiveError
from tests.dist import run_workers


def _lin():
    return torch.nn.Linear(3, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_grads_finite_matches_isfinite_at_every_position(dtype):
    """The one-sync min/max check agrees with isfinite().all() for a NaN or ±Inf at any
    position (vector bodies and tails), and huge finite values (whose sum overflows) pass."""
    from lioncub.engine.guard import grads_finite

    big = torch.finfo(dtype).max
    for n in (1, 7, 33, 1000):
        p, q = torch.nn.Parameter(torch.zeros(n, dtype=dtype)), torch.nn.Parameter(torch.zeros(0, dtype=dtype))
        p.grad = torch.full((n,), big, dtype=dtype)
        q.grad = torch.zeros(0, dtype=dtype)
        assert grads_finite([p, q, torch.nn.Parameter(torch.zeros(2))])  # huge, empty, grad None
        for pos in range(n):
            for bad in (math.nan, math.inf, -math.inf):
                p.grad = torch.randn(n).to(dtype)
                p.grad[pos] = bad
                assert not bool(grads_finite([q, p])), (n, pos, bad)


def test_the_cpu_finite_check_is_one_pass_that_leaves_the_gradients_as_they_were():
    """On CPU the check is one multi-tensor op for any tensor count (counted with a dispatch mode; the per-gradient
    min and max it replaced made 3 per tensor), and it leaves every gradient bit for bit as it was (it multiplies by
    a scale of 1: −0 stays −0, a subnormal stays itself), in every dtype and for a non-contiguous gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lioncub.engine.guard import grads_finite

    class Count(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Count.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    params = [torch.nn.Parameter(torch.zeros(7, 5, dtype=dtypes[i % 4])) for i in range(300)]
    for i, p in enumerate(params):
        g = torch.randn(5, 7).to(p.dtype).t()  # (non-contiguous)
        g[0, 0], g[1, 1], g[2, 2] = -0.0, torch.finfo(p.dtype).tiny / 4, torch.finfo(p.dtype).max
        p.grad = g
    before = [p.grad.clone() for p in params]
    with Count():
        finite = grads_finite(params)
    assert bool(finite)
    assert len(Count.ops) <= 5, Count.ops  # 3 here; 901 with a min and max per gradient
    for p, was in zip(params, before):  # (compared as their bits)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[p.dtype.itemsize]
        assert torch.equal(p.grad.view(bits), was.view(bits))


def test_a_gradient_the_cpu_check_cannot_write_takes_the_min_max_fallback():
    """A stride-0 gradient (an expanded tensor: one element seen many times) cannot be written in place, so the
    multi-tensor check raises on it; the per-gradient min and max then decide, NaN and ±Inf still found."""
    from lioncub.engine.guard import grads_finite

    p, q = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))
    q.grad = torch.randn(3)
    p.grad = torch.tensor([2.0]).expand(5)
    assert bool(grads_finite([q, p]))
    for bad in (math.nan, math.inf, -math.inf):
        p.grad = torch.tensor([bad]).expand(5)
        assert not bool(grads_finite([q, p])), bad


# ----------------------------------------------------------------------------- validation, one process
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(lr=-1.0), ValueError, r"lr must be >= 0"),
    (dict(lr="0.1"), TypeError, r"lr must be a real number"),
    (dict(lr=float("nan")), ValueError, r"lr must be >= 0"),
    (dict(betas=(0.9,)), ValueError, r"betas must be a pair"),
    (dict(betas=(1.0, 0.99)), ValueError, r"beta1 must be in \[0, 1\)"),
    (dict(betas=(0.9, -0.1)), ValueError, r"beta2 must be in \[0, 1\)"),
    (dict(weight_decay=-0.1), ValueError, r"weight_decay must be >= 0"),
    (dict(weight_decay=None), TypeError, r"weight_decay must be a real number"),
    (dict(vote="allreduce"), ValueError, r"SignVote.transport must be one of \('sign_allreduce'"),
    (dict(bits=3), ValueError, r"bits must be None or one of \(2, 4, 8\)"),
    (dict(vote="gather", bits=4), ValueError, r"SignVote.bits is the lane width of transport='pbit'"),
    (dict(quantizer="l2"), ValueError, r"SignVote.quantizer must be one of \('sign', 'l1'"),
    (dict(vote="grad", grad_dtype="fp16"), ValueError, r"Mean.dtype must be one of \('fp32', 'bf16'\)"),
    (dict(bucket_mb=0), ValueError, r"bucket_mb must be a number > 0"),
    (dict(bucket_mb="25"), ValueError, r"bucket_mb must be a number > 0"),
    (dict(bucket_mb=True), ValueError, r"bucket_mb must be a number > 0"),
    (dict(nonfinite="ignore"), ValueError,
     r"nonfinite must be one of \('raise', 'skip'\) \(or the older 'skip_step', 'skip_round'\), got 'ignore'"),
    (dict(check_every=-1), ValueError, r"check_every must be an int >= 0"),
    (dict(check_every=2.5), ValueError, r"check_every must be an int >= 0"),
    (dict(momentum_sync="sometimes"), ValueError, r"momentum_sync must be one of"),
    (dict(momentum_sync="all", sync_every=0), ValueError, r"sync_every must be an int >= 1"),
    (dict(momentum_sync="all", sync_dtype="fp8"), ValueError, r"sync_dtype must be one of \('fp32', 'bf16'\)"),
    (dict(momentum_sync="io"), ValueError, r"momentum_sync='io' needs model="),
    (dict(seed="x"), TypeError, r"seed must be an int"),
    (dict(maximize="yes"), TypeError, r"maximize must be a bool"),
    (dict(process_group=object()), ValueError, r"process_group was given but torch.distributed is not"),
])
def test_bad_argument_is_named(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LionCub(_lin().parameters(), **kwargs)


@pytest.mark.parametrize("group, exc, match", [
    (dict(lr=-0.5), ValueError, r"param group 1: lr must be >= 0"),
    (dict(betas=(0.9, 1.5)), ValueError, r"param group 1: betas: beta2 must be in \[0, 1\)"),
    (dict(weight_decay="0.1"), TypeError, r"param group 1: weight_decay must be a real number"),
])
def test_bad_param_group_is_named(group, exc, match):
    a, b = _lin(), _lin()
    with pytest.raises(exc, match=match):
        LionCub([{"params": a.parameters()}, {"params": b.parameters(), **group}], lr=0.1)
    opt = LionCub(a.parameters(), lr=0.1)
    with pytest.raises(exc, match=match):
        opt.add_param_group({"params": b.parameters(), **group})
    assert len(opt.param_groups) == 1  # the bad group was not kept


@pytest.mark.parametrize("param, match", [
    (torch.zeros(3, dtype=torch.complex64, requires_grad=True), r"parameter 0 has dtype torch.complex64"),
    (torch.zeros(3, dtype=torch.long), r"parameter 0 has dtype torch.int64"),
    (torch.zeros(3, dtype=torch.bool), r"parameter 0 has dtype torch.bool"),
    (torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True).requires_grad_(), r"parameter 0 is sparse"),
])
def test_unsupported_parameter_kinds(param, match):
    with pytest.raises(TypeError, match=match):
        LionCub([param])


def test_sparse_gradient_is_refused():
    emb = torch.nn.Embedding(5, 2, sparse=True)
    opt = LionCub(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match=r"parameter 0 has a sparse gradient.*sparse=False"):
        opt.step()


# ----------------------------------------------------------------------------- on a 4-rank group
def _net(out=2, extra_bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, out, bias=extra_bias)).to(dtype)


def _backward(model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    model.zero_grad()
    model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return type(exc).__name__, str(exc)
    return None


def _on_group(rank, world):
    out = {}
    p = _net().parameters
    out["pbit2"] = _error(lambda: LionCub(p(), vote="pbit", bits=2))  # 4 voters overflow 2-bit lanes
    out["pbit2_l1"] = _error(lambda: LionCub(p(), vote="pbit", bits=2, quantizer="l1"))
    out["pbit4_l1"] = _error(lambda: LionCub(p(), vote="pbit", bits=4, quantizer="l1"))  # valid
    # models that differ on one rank only: every rank raises, naming that rank
    shape = _net(out=5 if rank == 2 else 2)
    out["shape"] = _error(lambda: LionCub(shape.parameters(), model=shape))
    count = _net(extra_bias=rank != 3)
    out["count"] = _error(lambda: LionCub(count.parameters()))
    dtype = _net(dtype=torch.float64 if rank == 1 else torch.float32)
    out["dtype"] = _error(lambda: LionCub(dtype.parameters()))

    # NaN on rank 2 only, nonfinite='raise': all ranks raise at the same step
    model = _net()
    opt = LionCub(model.parameters(), lr=0.01, model=model, nonfinite="raise")
    for step in range(3):
        _backward(model, rank, step)
        if step == 2 and rank == 2:
            model[2].weight.grad[0, 1] = float("nan")
        err = _error(opt.step)
    out["raise"] = (err, opt.steps)

    # Inf on rank 1 only, nonfinite='skip_step': all ranks skip that step, then train on
    model = _net()
    opt = LionCub(model.parameters(), lr=0.01, vote="onebit", nonfinite="skip_step")
    skipped_ok = True
    for step in range(5):
        _backward(model, rank, step)
        if step == 2 and rank == 1:
            model[0].bias.grad[1] = -math.inf
        before = [(q.detach().clone(), opt.state[q].get("exp_avg", q).clone()) for q in model.parameters()]
        opt.step()
        if step == 2:  # parameters and momenta untouched on every rank
            skipped_ok = all(torch.equal(q, q0) and torch.equal(opt.state[q]["exp_avg"], m0)
                             for q, (q0, m0) in zip(model.parameters(), before))
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    out["skip"] = (skipped_ok, opt.skipped_steps, opt.steps, all(torch.equal(e, flat) for e in everyone),
                   bool(torch.isfinite(flat).all()))

    # replica guard: no false alarm while replicas agree; names the parameter when one drifts
    model = _net()
    opt = LionCub(model.parameters(), lr=0.01, model=model, check_every=2)
    n_coll = []
    for step in range(3):  # the parameters after step 2 are checked at the start of the third step()
        _backward(model, rank, step)
        opt.step()
        n_coll.append(opt.last_step_stats.n_collectives)
    if rank == 3:
        with torch.no_grad():  # the smallest possible drift: one ulp of one element
            model[0].bias[1] = torch.nextafter(model[0].bias[1], torch.tensor(math.inf))
    _backward(model, rank, 3)
    opt.step()  # (after 3 steps: no check)
    _backward(model, rank, 4)
    out["replicas"] = (n_coll, _error(opt.step))  # after 4: checked, with this step's agreement
    return out


@pytest.mark.slow
def test_validation_nonfinite_and_replica_guard_on_four_ranks():
    res = run_workers(_on_group, 4)
    for r, out in enumerate(res):
        assert out["pbit2"][0] == "ValueError" and "bits=2 lanes overflow with 4 workers" in out["pbit2"][1]
        assert out["pbit2_l1"][0] == "ValueError" and "leave no quantization level for 4 workers" in out["pbit2_l1"][1]
        assert out["pbit4_l1"] is None
        kind, msg = out["shape"]
        assert kind == "ValueError"
        assert "rank 2 has parameter 2 ('2.weight') of shape (5, 3) float32, rank 0 has shape (2, 3)" in msg
        kind, msg = out["count"]
        assert kind == "ValueError" and "rank 3 has 3 parameters, rank 0 has 4" in msg
        kind, msg = out["dtype"]
        assert kind == "ValueError" and "rank 1 has parameter 0 of shape (3, 4) float64, rank 0 has shape (3, 4) float32" in msg
        (kind, msg), steps = out["raise"]
        assert kind == "FloatingPointError" and "non-finite gradient on 1 rank(s) at step 2" in msg
        assert steps == 2  # the failed step did not count
        if r == 2:
            assert "this rank holds a non-finite gradient in parameter 2 ('2.weight'" in msg
        else:
            assert "this rank's gradients are finite" in msg
        assert out["skip"] == (True, 1, 4, True, True)
        n_coll, err = out["replicas"]
        assert n_coll[1] == n_coll[0] and n_coll[2] == n_coll[0] + 1  # the check of step 2: one all-gather more
        assert err is not None and err[0] == "RuntimeError"
        assert ("replicas diverged at step 4: parameter 1 ('0.bias', shape (3,)) on rank(s) [3] "
                "differs from rank 0") in err[1]


# ----------------------------------------------------------------------------- dead or stalled worker
GROUP_TIMEOUT_S = 3.0
HANG_GUARD_S = 150


def _train_until_failure(rank, world, mode):
    # the process group's timeout bounds every collective; a sub-group carries its own
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    model = _net()
    dist.barrier()  # default group (long timeout): a slow spawn on a loaded host is not a stall
    opt = LionCub(model.parameters(), lr=0.01, vote="onebit", process_group=group)
    for step in range(6):
        _backward(model, rank, step)
        dist.barrier()  # every rank enters the step together; only the injected failure is late
        if step == 3 and rank == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(GROUP_TIMEOUT_S + 2)  # stall past the survivors' timeout, then vanish
            os._exit(0)
        t0 = time.monotonic()
        try:
            opt.step()
        except CollectiveError as exc:
            return step, time.monotonic() - t0, str(exc)
    return None


@pytest.mark.parametrize("mode", ["kill", pytest.param("stall", marks=pytest.mark.slow)])  # stall: ~9 s of timeout
def test_dead_or_stalled_worker_makes_survivors_raise_in_time(mode):
    t0 = time.monotonic()
    # hang guard for the whole run (spawn included; ~10 s idle, far more on a loaded host)
    res = run_workers(_train_until_failure, 3, mode, allow_exit=(1,), deadline_s=HANG_GUARD_S)
    assert time.monotonic() - t0 < HANG_GUARD_S
    assert res[1] is None
    for r in (0, 2):
        assert res[r] is not None, f"rank {r} never noticed the failure"
        step, waited, msg = res[r]
        assert step == 3
        assert waited < GROUP_TIMEOUT_S + 2.0  # raised within the group's timeout (+ slack)
        assert msg.startswith(f"all_reduce of 5 bytes (5 x torch.uint8) at optimizer step 3 failed on rank {r}")
        if mode == "stall":
            assert waited >= GROUP_TIMEOUT_S - 0.5  # it really waited for the timeout
            assert "Timed out" in msg


def test_the_device_finite_check_launches_a_few_kernels_for_300_tensors():
    """Off the CPU the check is one multi-tensor ∞-norm and a stack per dtype, not a kernel per tensor
    (counted on ``meta`` with a dispatch mode: every ATen op is a launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lioncub.engine.guard import grads_finite

    class Count(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:  # a view (detach) is metadata, not a launch
                Count.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    params = [torch.nn.Parameter(torch.empty(5, 3, device="meta", dtype=torch.float32 if i % 3 else torch.bfloat16))
              for i in range(300)]
    for p in params:
        p.grad = torch.empty_like(p)
    with Count():
        grads_finite(params)
    assert len(Count.ops) <= 30, Count.ops  # 15 here (isfinite is 5 ops on meta); 307 before: a cast per tensor
