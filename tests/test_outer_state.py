"""LocalCub's outer state on the host (``outer_state='host'``, issue 68): every round bit for bit the device
state's, on real gloo ranks (replicated, FSDP2 2 x 2, torchft), resumed mid-round too; and the device audit of the
host paths.

On the CPU the host and the device are the same memory, but the host state is still tensors of their own that a
round reads and writes only through device copies (``Rounds._held``, ``_keep``, ``_store``), so a round that reads
a stale copy, or leaves a changed one unwritten, differs from the device run here. What the CPU cannot show (a
collective on a host tensor, a host sync per step, state left on the device) the audit shows, with the
parameters on ``meta`` and the outer state on the CPU."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from tests.flat import LocalCub
from lioncub.engine.shards import local_of
from tests.dist import run_workers

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_AT, NAN_AT = 12, 6, 4
"""Steps run; the step after which a checkpoint is taken (inside a round, a round or a fragment in flight); the step
whose gradient is NaN on rank 1 with ``nonfinite='skip'``."""
ROUND_CHUNK, SCALE_BLOCK = 10, 8
"""A round in chunks of 10 elements, tensors in slices of 8 (each worker process only): the second pass makes each
chunk's Δ again from the state, so a stale or unwritten copy cannot hide in one kept chunk."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4), nn.Tanh(), nn.Linear(4, 1))
    model[2].weight = nn.Parameter(model[2].weight.detach().t().contiguous().t())  # strided: never cut
    return model


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def _step(model, opt, rank: int, step: int, batch=_batch) -> None:
    x, y = batch(rank, step)
    ((model(x) - y) ** 2).mean().backward()
    if opt.nonfinite == "skip" and step == NAN_AT and rank == 1:  # (FSDP2: rank 1's slice of the first weight)
        local_of(next(model.parameters()).grad).view(-1)[0] = float("nan")
    opt.step()
    opt.zero_grad()


def _outer(opt, residuals: bool) -> list[torch.Tensor]:
    """Every tensor of the outer state: each parameter's entries by key (e_i only with ``residuals``), and (with
    ``residuals``) the owner residuals."""
    out = [t for p in opt.params for key, t in sorted(opt.local_state[p].items()) if residuals or key != "residual"]
    return out + ([opt.owner_residuals[k] for k in sorted(opt.owner_residuals)] if residuals else [])


def _landed(opt) -> bool:
    """Whether no exchange has yet to write a residual: a fragment's waits for its verdict before its launch keeps e_i,
    and a scatter mean in flight keeps its owner residual when its all-to-all is in; each at the first inner step
    that finds its collective complete, which depends on each run's timing (not on its values)."""
    return opt._agreeing is None and (opt._pending is None or all(agreement.d is not None for agreement in opt._pending))


def _same(a, b) -> bool:
    """The parameters and the whole outer state bit for bit (the residuals where neither run has one to write)."""
    landed = _landed(a) and _landed(b)
    x, y = _outer(a, landed), _outer(b, landed)
    return len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y)) and \
        all(torch.equal(p, q) for p, q in zip(a.params, b.params))


def _runs(rank, make, runs, batch=_batch):
    """Per run: the device run, the host run, and from :data:`SAVE_AT` on three more resumed from their checkpoints
    (the host run's with host state, the device run's with host state, the host run's with device state), side by side
    on the same batches; whether each equals the device run after every step (and after ``flush`` and inside
    ``agreed``), how many of those comparisons had every residual in them, the runs compared, rounds and skips."""
    from lioncub.optim import rounds
    rounds.SCALE_BLOCK = SCALE_BLOCK
    out = {}
    for name, kw in runs:
        pairs = [make(kw, "device"), make(kw, "host")]
        for _, opt in pairs:
            opt.round_chunk = ROUND_CHUNK
        same, whole = [], 0
        for step in range(STEPS):
            for model, opt in pairs:
                _step(model, opt, rank, step, batch)
            if step == SAVE_AT:  # mid-round: each rank's own parameters, a round in flight (the save lands it)
                device, host = [copy.deepcopy((model.state_dict(), opt.state_dict())) for model, opt in pairs]
                for (model_sd, opt_sd), where in ((host, "host"), (device, "host"), (host, "device")):
                    model, opt = make(kw, where)
                    opt.round_chunk = ROUND_CHUNK
                    model.load_state_dict(model_sd)
                    opt.load_state_dict(opt_sd)
                    pairs.append((model, opt))
            same.append(all(_same(pairs[0][1], opt) for _, opt in pairs[1:]))
            whole += all(_landed(opt) for _, opt in pairs)
        if kw.get("delay"):
            for _, opt in pairs:
                opt.flush()
            same.append(all(_same(pairs[0][1], opt) for _, opt in pairs[1:]))
            whole += all(_landed(opt) for _, opt in pairs)
            (_, device), (_, host) = pairs[:2]
            with device.agreed(), host.agreed():  # θ_s in the parameters, theirs back after
                same.append(all(torch.equal(a, b) for a, b in zip(device.params, host.params)))
            same.append(_same(device, host))
        out[name] = (same, whole, len(pairs), pairs[0][1].rounds, pairs[1][1].rounds, pairs[1][1].skipped_rounds)
    return out


def _replicated_worker(rank, world, runs):
    def make(kw, where):
        model = _model()
        return model, LocalCub(model.parameters(), lr=0.02, weight_decay=0.1, outer_state=where,
                               **{"local_steps": 2, **kw})
    return _runs(rank, make, runs)


MEAN8 = dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True)
SCATTER4 = dict(vote="onebit", aggregate="mean", bits=4, error_feedback=True)
NESTEROV = dict(outer="nesterov", outer_lr=0.7)
REPLICATED = [
    ("blocking", dict(vote="onebit", error_feedback=True, check_every=1, **NESTEROV)),
    ("lane_mean_skip", dict(MEAN8, nonfinite="skip")),
    ("scatter_mean", dict(SCATTER4, outer="lion", outer_lr=0.5)),
    ("delay1_lane_mean_skip_check", dict(MEAN8, delay=1, nonfinite="skip", check_every=1, **NESTEROV)),
    ("delay1_scatter_mean", dict(SCATTER4, delay=1, **NESTEROV)),
    ("fragments", dict(SCATTER4, delay=1, fragments=2, local_steps=4, **NESTEROV)),
    ("fragments_eager", dict(SCATTER4, delay=1, fragments=2, local_steps=4, eager=True, **NESTEROV)),
]


def _check(results, runs):
    for rank, out in enumerate(results):
        for name, kw in runs:
            same, whole, compared, rounds, host_rounds, skipped = out[name]
            assert same == [True] * len(same) and len(same) >= STEPS, (rank, name, same)
            assert whole >= 3, (rank, name, whole)  # with every residual in: the first step, the save, flush...
            assert compared == 5 and rounds == host_rounds > 0, (rank, name, compared, rounds, host_rounds)
            assert skipped == (kw.get("nonfinite") == "skip"), (rank, name, skipped)


def test_host_state_rounds_equal_device_state_rounds_replicated():
    """Blocking (1-bit vote with error feedback, Nesterov, replica checks), the lane mean with a NaN round skipped,
    the 4-bit scatter mean (its owner residuals on the host), streamed (a NaN, θ_s checked every round), streamed in
    fragments, with eager stand-ins: every step, flush and agreed() bit for bit; resumed mid-round from a host
    checkpoint and from a device one, into host state and device state."""
    _check(run_workers(_replicated_worker, 2, REPLICATED), REPLICATED)


def _sharded_worker(rank, world, runs):
    from tests.test_sharded import _batch as batch
    from tests.test_sharded import _mesh, _shard
    from tests.test_sharded import _model as model_of

    mesh = _mesh(2, 2)

    def make(kw, where):
        model = _shard(model_of(), mesh["shard"])
        return model, LocalCub(model.parameters(), lr=0.02, weight_decay=0.1, outer_state=where,
                               **{"local_steps": 2, **kw})
    return _runs(rank, make, runs, batch)


SHARDED = [
    ("lane_mean_skip", dict(MEAN8, nonfinite="skip")),
    ("delay1_scatter_mean_check", dict(SCATTER4, delay=1, check_every=1, **NESTEROV)),
    ("fragments", dict(SCATTER4, delay=1, fragments=2, local_steps=4, **NESTEROV)),
]


def test_host_state_rounds_equal_device_state_rounds_on_fsdp2_shards():
    """FSDP2 2 x 2, the shards' outer state on the host (on a GPU plain tensors beside the DTensor parameters; on this
    CPU mesh DTensors like them): the lane mean with a skipped round, the streamed scatter mean with θ_s checked,
    fragments; mid-round resumes as above."""
    _check(run_workers(_sharded_worker, 4, SHARDED), SHARDED)


def test_outer_state_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^Options.outer_state must be one of \('device', 'host'\), got 'gpu'$"):
        LocalCub(_model().parameters(), outer_state="gpu")


# ---------------------------------------------------------------------------------------------- torchft
@pytest.mark.slow
def test_torchft_rounds_with_host_state_equal_localcub_on_a_plain_group(tmp_path):
    """Three torchft replicas keeping their outer state on the host, rounds in chunks: every round bit for bit the
    plain group's LocalCub with its state on the device (tests/test_ft.py's no-failure run)."""
    from tests.test_ft import CHUNKS, rounds_of, run_three

    args = ("--steps", "20", "--H", "4", "--vote", "mean8")
    ft = [rounds_of(p) for p in run_three(tmp_path, "ft", *args, *CHUNKS, "--outer-state", "host")]
    plain = [rounds_of(p) for p in run_three(tmp_path, "plain", *args, *CHUNKS[2:])]
    assert sorted(plain[0]) == list(range(1, 6))
    for r in range(3):
        assert sorted(ft[r]) == sorted(plain[0])
        assert all(ft[r][k]["digest"] == plain[r][k]["digest"] == plain[0][k]["digest"] for k in plain[0]), r


@pytest.mark.slow
def test_a_replica_heals_into_host_state(tmp_path):
    """A replica killed during its inner steps and restarted is healed from a survivor's host state into its own
    (tests/test_ft.py's kill), and is bit-identical to the survivors from its first commit on."""
    from tests.test_ft import KILLED, assert_rejoined, assert_survivors_identical, run_faulted

    logs = run_faulted(tmp_path, 60, "--fault", f"2:{KILLED}:inner", restart=2, setting=("--outer-state", "host"))
    assert_survivors_identical(logs, rounds=60)
    assert_rejoined(logs)


# ---------------------------------------------------------------------------------------------- the audit
_AUDIT = r'''
import functools, json, sys, torch
sys.path.insert(0, sys.argv[1])
from device_audit import init_fake
import lioncub as lc
from tests import flat
from lioncub.testing.audit import DeviceAudit
from lioncub.testing.paths import PATHS, _model, _to_cpu, _train
init_fake()
meta = torch.device("meta")

def audited(fn):
    a = DeviceAudit(meta)
    error = None
    try:
        with a:
            fn(meta, a)
    except Exception as exc:
        error = repr(exc)
    steps = lambda phases: sorted({p for p in phases if p.startswith("step")}, key=lambda p: int(p.split()[1]))
    return dict(error=error, violations=a.violations, collectives=len(a.collectives), syncs=a.syncs_per_phase(),
                copies=steps(c.phase for c in a.copies), all_steps=steps(a.syncs_per_phase()))

out = {}
for name, fn in PATHS.items():
    if "host state" in name:  # and its twin, the same path with the state on the device
        twin = functools.partial(fn.func, **{k: v for k, v in fn.keywords.items() if k != "outer_state"})
        every = fn.keywords.get("local_steps", 2) // fn.keywords.get("fragments", 1)  # steps between round ends
        out[name] = dict(host=audited(fn), device=audited(twin), every=every)

where = {}
def placed(meta_, a):  # where the outer state lives: made, after rounds, after a load of a CPU checkpoint
    kw = dict(local_steps=2, vote="onebit", aggregate="mean", bits=4, error_feedback=True, delay=1, outer="nesterov",
              outer_state="host")
    model = _model(meta)
    opt = flat.LocalCub(model.parameters(), lr=1e-3, **kw)
    devices = lambda o: sorted({str(t.device) for p in o.params for t in o.local_state[p].values()}
                               | {str(t.device) for t in o.owner_residuals.values()})
    where["made"] = devices(opt)
    _train(opt, model, meta, a, 3)
    where["stepped"] = devices(opt)
    saved = _to_cpu(opt.state_dict())
    opt2 = flat.LocalCub(model.parameters(), lr=1e-3, **kw)
    opt2.load_state_dict(saved)
    where["loaded"] = devices(opt2)
    _train(opt2, model, meta, a, 2, first=3)
    where["stepped after the load"] = devices(opt2)
out["placed"] = dict(audit=audited(placed), where=where)
print("JSON" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def audit_rows():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _AUDIT, str(ROOT / "bench")], env=env, capture_output=True,
                          text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")]
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line[0][4:])


def steps(syncs: dict) -> dict:
    """The syncs of the steps and backwards (set-up and a load copy the state to the host once: blocking)."""
    return {k: n for k, n in syncs.items() if k.startswith(("step", "backward"))}


def test_host_state_paths_put_no_host_tensor_in_a_collective_and_add_no_host_sync(audit_rows):
    """Each host-state path of lioncub.testing.paths on ``meta`` (blocking; scatter mean in fragments; streamed lane
    mean with a skip and replica checks; a resume; FSDP2): no violation (a CPU tensor in a collective is one), the
    same host syncs in every step as the same path with its state on the device, and its copies to and from the
    host (non_blocking: none waits) in every step that ends a round (or a fragment's), after the resume too, and in
    no other step."""
    names = [n for n in audit_rows if n != "placed"]
    assert len(names) >= 5, names
    for name in names:
        host, device = audit_rows[name]["host"], audit_rows[name]["device"]
        assert host["error"] is None and device["error"] is None, (name, host["error"], device["error"])
        assert host["violations"] == [] and host["collectives"] == device["collectives"] > 0, (name, host)
        assert steps(host["syncs"]) == steps(device["syncs"]), (name, host["syncs"], device["syncs"])
        assert device["copies"] == [], (name, device["copies"])
        every = audit_rows[name]["every"]
        ends = [s for s in host["all_steps"] if (int(s.split()[1]) + 1) % every == 0]
        assert host["copies"] == ends and len(ends) >= 2, (name, host["copies"], ends)


def test_host_state_stays_on_the_host_when_made_stepped_and_loaded(audit_rows):
    """Parameters on ``meta``: the outer state (and the owner residuals) on the CPU when made, after rounds, after
    ``load_state_dict`` of a CPU checkpoint (torch's would cast it onto the parameters' device) and after more
    rounds."""
    placed = audit_rows["placed"]
    assert placed["audit"]["error"] is None and placed["audit"]["violations"] == [], placed["audit"]
    assert placed["where"] == {k: ["cpu"] for k in ("made", "stepped", "loaded", "stepped after the load")}, placed


@pytest.mark.parametrize("outer_state", ["device", "host"])
def test_a_bf16_model_resumes_bit_exact_with_its_fp32_outer_state(outer_state):
    """bf16 parameters, fp32 residual and Nesterov momentum: a resume keeps them fp32 and continues as the
    uninterrupted run, bit for bit (torch's own load casts state to the parameter's dtype: the residual and the
    momentum would come back bf16, and the resumed run would drift)."""
    def build():
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(37, 5).bfloat16()), nn.Parameter(torch.randn(11).bfloat16())]
        return params, LocalCub(params, lr=1e-2, local_steps=2, inner=lambda groups: torch.optim.SGD(groups),
                                vote="onebit", error_feedback=True, outer="nesterov", outer_lr=0.7,
                                outer_state=outer_state)

    def steps(params, opt, first, last):
        for t in range(first, last):
            g = torch.Generator().manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).bfloat16()
            opt.step()

    params, opt = build()
    steps(params, opt, 0, 5)  # two rounds and a step into the third
    saved = copy.deepcopy(opt.state_dict())
    steps(params, opt, 5, 10)
    again, opt2 = build()
    opt2.load_state_dict(saved)
    for p in again:
        assert opt2.state[p]["residual"].dtype == opt2.state[p]["outer_m"].dtype == torch.float32
    steps(again, opt2, 5, 10)
    assert all(torch.equal(a, b) for a, b in zip(params, again))
