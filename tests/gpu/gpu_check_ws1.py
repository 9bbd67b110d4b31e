"""The world-size-1 check of ``make gpu-check`` (tests/gpu/gpu_check.py):

* ``nccl_ws1_calls`` — in a world-size-1 NCCL group (where LionCub itself issues no
  collective), the library's collectives called directly on CUDA tensors, under the device
  audit: every vote method's encode → ``exchange`` → decode (against its ``reference``), the
  ``lioncub.comm`` wrappers, ``guard.check_same_params`` / ``check_replicas`` (with
  ``world_size=2`` passed, so they take their collective path on the one rank),
  ``guard.grads_finite`` (True, then False for a NaN) and ``cost.calibrate(device=cuda)`` (run
  with ``torch.distributed.get_world_size`` reading 2: at one rank it returns (0, 0) without a
  collective). Fails if a call raises, the audit records a violation, or a value is wrong.
"""
from __future__ import annotations

import contextlib
import functools
import traceback

from gpu_check_paths import _audit_class, _device, _err, _name, _ws1_group


@contextlib.contextmanager
def _world_size_reads(n: int):
    """``torch.distributed.get_world_size()`` returns ``n`` inside the block (the collectives
    still run on the real group): lets a function that returns early at one rank run its
    collectives in a world-size-1 group."""
    import torch.distributed as dist
    real = dist.get_world_size
    dist.get_world_size = lambda group=None: n
    try:
        yield
    finally:
        dist.get_world_size = real


WS1_VOTES = [("sign_allreduce", None, None), ("gather", None, None), ("onebit", None, None), ("pbit", None, None),
             ("pbit", 2, None), ("pbit", 4, None), ("pbit", 8, None), ("pbit", 4, "sign"), ("pbit", 8, "l1")]


def _ws1_vote(dev, vote, bits, q) -> dict:
    """One vote method at world size 1: encode → exchange → decode of 1001 elements (zeros
    every 7th: ties), both step parities, against the method's own reference."""
    import torch
    from lioncub import comm, fused, votes
    method = votes.make(vote, 1, bits, q)
    n = 1001
    c = torch.randn(n, generator=torch.Generator().manual_seed(5))
    c[::7] = 0.0
    c = c.to(dev)
    stats = comm.CommStats()
    out = {}
    for step in (0, 1):
        nb = method.part_nbytes(n)
        msg = torch.zeros(method.message_nbytes(nb), dtype=torch.uint8, device=dev)
        method.encode(c, msg[:nb], step, None, use_fused=fused.usable([c]))
        voted = method.exchange(msg, nb, step, None, stats)
        u = method.decode(voted, 0, n, torch.empty(n, device=dev))
        want = method.reference([c], method.parity(step))
        out[f"step{step}"] = dict(voted_device=str(voted.device), voted_dtype=str(voted.dtype),
                                  u_device=str(u.device), equal=bool(torch.equal(u.cpu().long(), want.cpu().long())))
    ok = all(v["equal"] and v["voted_device"] == str(dev) and v["u_device"] == str(dev) for v in out.values())
    return dict(out, ok=ok and stats.n_collectives > 0, collectives_counted=stats.n_collectives)


def _ws1_comm(dev) -> dict:
    """The lioncub.comm wrappers LionCub, the guards and the harness use, on device tensors."""
    import torch
    from lioncub import comm
    t = torch.arange(10, dtype=torch.float32, device=dev)
    got = {
        "all_reduce float32 sum": comm.all_reduce(t.clone()),
        "all_reduce float32 max": comm.all_reduce(t.clone(), op="max"),
        "all_reduce bfloat16 sum": comm.all_reduce(t.to(torch.bfloat16)).float(),
        "all_reduce uint8 sum": comm.all_reduce(t.to(torch.uint8)).float(),
        "all_reduce int8 sum": comm.all_reduce(t.to(torch.int8)).float(),
        "all_gather uint8": comm.all_gather(t.to(torch.uint8)).reshape(-1).float(),
        "all_to_all uint8": comm.all_to_all(t.to(torch.uint8)).float(),
        "broadcast float32": comm.broadcast(t.clone()),
    }
    out = {k: dict(ok=v.device == dev and torch.equal(v.cpu(), t.cpu())) for k, v in got.items()}
    flat = [t.clone(), t[:3].clone().to(torch.bfloat16)]
    comm.broadcast_from_first(flat)
    out["broadcast_from_first"] = dict(ok=torch.equal(flat[0].cpu(), t.cpu()))
    out["all_gather_object"] = dict(ok=comm.all_gather_object({"a": [1, 2]}, device=dev) == [{"a": [1, 2]}])
    out["broadcast_object"] = dict(ok=comm.broadcast_object({"b": 3}, device=dev) == {"b": 3})
    comm.barrier(None, dev)
    out["barrier"] = dict(ok=True)
    return dict(out, ok=all(v["ok"] for v in out.values()))


def _ws1_guard(dev) -> dict:
    import torch
    from lioncub.engine import guard
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(dev)
    params = list(model.parameters())
    names = guard.param_names(model, params)
    guard.check_same_params(params, None, 1, names=names)
    guard.check_same_params(params, None, 2, names=names)  # 2: its gather and comparison, on the one rank
    guard.check_replicas(params, None, 2, step=0, names=names)
    for p in params:
        p.grad = torch.ones_like(p)
    finite = guard.grads_finite(params)
    on_device = isinstance(finite, torch.Tensor) and finite.device == dev
    params[1].grad[0] = float("nan")
    nan = guard.grads_finite(params)
    return dict(ok=bool(finite) is True and bool(nan) is False and (on_device or dev.type == "cpu"),
                finite_flag_on_device=on_device, all_finite=bool(finite), with_nan=bool(nan))


def _ws1_calibrate(dev, dry_run: bool) -> dict:
    import math
    from lioncub.engine import cost
    sizes = (1 << 10, 1 << 14) if dry_run else cost.DEFAULT_PROBE_SIZES
    with _world_size_reads(2):  # at one rank calibrate returns (0, 0) before its first collective
        alpha, beta = cost.calibrate(device=dev, sizes=sizes)
    return dict(ok=all(math.isfinite(x) and x > 0 for x in (alpha, beta)), alpha=alpha, beta=beta)


def check_nccl_ws1_calls(device: str, dry_run: bool = False) -> dict:
    """The library's collectives called directly at world size 1, each under the device audit."""
    dev = _device(device)
    Audit = _audit_class()
    calls = [(f"vote {_name(v, b, q)}", functools.partial(_ws1_vote, dev, v, b, q)) for v, b, q in WS1_VOTES]
    calls += [("comm", functools.partial(_ws1_comm, dev)), ("guard", functools.partial(_ws1_guard, dev)),
              ("cost.calibrate", functools.partial(_ws1_calibrate, dev, dry_run))]
    out = {}
    with _ws1_group(device) as backend:
        for name, call in calls:
            audit = Audit(dev)
            try:
                with audit, audit.phase(name):
                    res = call()
            except Exception as exc:  # noqa: BLE001 - a call that raises fails the check
                res = dict(ok=False, error=_err(exc), where=traceback.format_exc().strip().splitlines()[-8:])
            res["collectives_seen"] = len(audit.collectives)
            if audit.violations:
                res.update(ok=False, violations=audit.violations[:8])
            if not audit.collectives:  # each call communicates (guard: its two gathers); none seen: not checked
                res.update(ok=False, error=res.get("error") or "the audit saw no collective")
            out[name] = res
    return dict(ok=all(v["ok"] for v in out.values()), backend=backend, device=str(dev), calls=out)


# ----------------------------------------------------------------------------- every path, two ranks
