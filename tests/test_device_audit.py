"""The device audit (issue 30): every optimizer path with its parameters on ``meta`` in a
2-rank fake process group, every collective and host sync recorded (lioncub.testing.audit).

The paths run in one subprocess (the fake group is process-global; the rest of the suite
must not see an initialised default group). Then, per path: no collective tensor off the
device, no dtype or reduce op NCCL lacks, no library draw from the global RNG, no host sync
inside backward, and at most the path's budget of host syncs in any one step. A second group
of tests shows the audit itself catches each kind of violation."""
from __future__ import annotations
from tests import flat

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit") / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "device_audit.py"), "--out", str(out)],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["path"]: r for r in json.loads(out.read_text())}


def _paths():
    sys.path.insert(0, str(ROOT / "src"))
    from lioncub.testing.paths import META_SKIP, PATHS, SYNC_BUDGET
    return [n for n in PATHS if n not in META_SKIP], SYNC_BUDGET


NAMES, BUDGET = _paths()


@pytest.mark.parametrize("name", NAMES)
def test_path_keeps_every_collective_on_the_device_within_its_sync_budget(rows, name):
    row = rows[name]
    assert row["error"] is None, row
    assert row["collectives"] > 0, row  # the path really communicated
    assert row["violations"] == 0, row["violation_lines"]
    assert row["syncs_in_backward"] == 0, row
    assert row["max_syncs_per_step"] <= BUDGET[name], row["worst_step_syncs"]


def test_every_constructor_option_has_an_audited_path():
    """An option added to LionCub, LocalCub or NodeCub (or a state-keeping option of NodeCub's vote)
    that no audited path sets fails here until a path sets it (or NOT_PATH_CHANGING says why it
    need not)."""
    from lioncub.testing.paths import uncovered_options

    assert uncovered_options() == {"LionCub": set(), "LocalCub": set(), "NodeCub": set(), "NodeCub vote_args": set()}


def test_every_lioncub_step_reads_the_host_once(rows):
    """The target: one host read per LionCub step (its agreement), for every vote and
    quantizer, with overlap, auto, check_every, momentum sync, resume and the non-finite branch."""
    names = [n for n in NAMES if n.startswith("lioncub") and n != "lioncub momentum_sync adaptive"]
    assert len(names) >= 20
    for name in names:
        assert rows[name]["max_syncs_per_step"] == 1, rows[name]["worst_step_syncs"]
        (read,) = rows[name]["worst_step_syncs"]
        assert read.startswith("copy to cpu at guard.py:") and read.endswith(" _verdict"), read  # the agreement's verdict


_CATCHES = r'''
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from lioncub.testing.audit import DeviceAudit
from lioncub import quantize
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
meta = torch.device("meta")
out = {}
def run(key, fn, drive=None):
    a = DeviceAudit(meta, drive=drive)
    try:
        with a, a.phase("step 0"):
            fn()
    except Exception as e:
        out[key + " error"] = type(e).__name__
    out[key] = a.violations
    out[key + " syncs"] = a.syncs_per_phase()
    out[key + " backward"] = len(a.syncs_in_backward())
    out[key + " dtypes"] = [d for c in a.collectives for _, d in c.tensors]
    out[key + " copies"] = [c.name for c in a.copies]
run("cpu tensor", lambda: dist.all_reduce(torch.zeros(3)))
run("band", lambda: dist.all_reduce(torch.zeros(3, dtype=torch.uint8, device=meta), op=dist.ReduceOp.BAND))
run("bool", lambda: dist.all_reduce(torch.zeros(3, dtype=torch.bool, device=meta)))
run("ok", lambda: dist.all_reduce(torch.zeros(3, dtype=torch.uint8, device=meta), op=dist.ReduceOp.MAX))
run("item", lambda: torch.ones(2, device=meta).sum().item())
run("tolist", lambda: torch.ones(2, device=meta).tolist())
run("h2d", lambda: torch.tensor([1.0, 2.0]).to(meta))
host = torch.zeros(3)  # (LocalCub's host state: pinned where the parameters are on CUDA; meta takes non_blocking at its word)
run("into host, non_blocking", lambda: host.copy_(torch.ones(3, device=meta), non_blocking=True))
run("into host, blocking", lambda: host.copy_(torch.ones(3, device=meta)))
run("to cpu, non_blocking", lambda: torch.ones(3, device=meta).to("cpu", non_blocking=True))
run("from host, non_blocking", lambda: host.to(meta, non_blocking=True))
ones = lambda phase, t: torch.ones(t.shape, dtype=t.dtype)  # a norm of 1: the draw happens (0 skips it)
run("global rng", lambda: quantize(torch.ones(8, device=meta), "linf", bits=4), drive=ones)
run("barrier in step", lambda: dist.barrier())
def backward_item():
    w = torch.ones(3, device=meta, requires_grad=True)
    w.register_post_accumulate_grad_hook(lambda p: p.grad.sum().item())
    (w * 2).sum().backward()
run("in backward", backward_item)
from lioncub.engine import guard
w = torch.nn.Parameter(torch.zeros(3, device=meta)); w.grad = torch.zeros(3, device=meta)
run("agree 255", lambda: guard.agree([w], None, 255, meta))
run("agree 256", lambda: guard.agree([w], None, 256, meta))
print("JSON" + __import__("json").dumps(out))
'''


def test_the_audit_catches_each_kind_of_violation():
    proc = subprocess.run([sys.executable, "-c", _CATCHES], env=ENV, capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(line[0][4:])
    assert any("cpu tensor" in v for v in out["cpu tensor"]), out
    assert any("reduce op 5" in v for v in out["band"]), out
    assert any("dtype torch.bool" in v for v in out["bool"]), out
    assert out["ok"] == [] and out["ok syncs"] == {}, out
    assert out["item syncs"] == {"step 0": 1} and out["tolist syncs"] == {"step 0": 1}, out
    assert out["h2d syncs"] == {"step 0": 1}, out
    # a non_blocking copy_ into (pinned) host memory or from it waits for nothing: a copy, not a sync; a blocking one,
    # or a .to("cpu") whose result the host is about to read, is a sync
    assert out["into host, non_blocking syncs"] == {} and out["into host, non_blocking copies"] == ["to host"], out
    assert out["from host, non_blocking syncs"] == {} and out["from host, non_blocking copies"] == ["from host"], out
    assert out["into host, blocking syncs"] == {"step 0": 1} and out["to cpu, non_blocking syncs"] == {"step 0": 1}, out
    assert any("global RNG" in v for v in out["global rng"]), out
    assert any("barrier inside a step" in v for v in out["barrier in step"]), out
    assert out["in backward backward"] == 1, out
    # the agreement's counts are sums over ranks: uint8 up to 255 ranks, int32 past (no wrap)
    assert out["agree 255 dtypes"] == ["uint8"] and out["agree 256 dtypes"] == ["int32"], out


def test_one_device_per_optimizer_and_the_error_names_the_parameter():
    import torch

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, device="meta"))
    for make in (lambda ps: flat.LionCub(ps, lr=1e-3), lambda ps: flat.LocalCub(ps, lr=1e-3)):
        with pytest.raises(ValueError, match=r"parameter 1 is on meta but parameter 0 is on cpu"):
            make([a, b])
    assert flat.LionCub([b], lr=1e-3).device == torch.device("meta")


def test_timing_off_reports_zero_times_and_the_same_bytes():
    """timing=False (CUDA's default) leaves every time at 0; CPU's default measures them. The
    bytes do not depend on it: none in a world of one (no process group, no vote)."""
    import torch

    for timing, timed in ((False, False), (None, True)):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = flat.LionCub(model.parameters(), lr=1e-3, timing=timing)
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        s = opt.last_step_stats
        times = [s.t_quantize_pack, s.t_collective, s.t_unpack_vote, s.t_apply]
        assert (sum(times) > 0) is timed, (timing, times)
        assert (s.bytes_sent, s.n_collectives) == (0, 0), (timing, s.bytes_sent, s.n_collectives)
    with pytest.raises(TypeError, match="timing must be None, True or False"):
        flat.LionCub(model.parameters(), timing="yes")


def test_a_generator_state_of_another_kind_is_refused():
    import torch

    from lioncub import comm

    gen = comm.make_generator(torch.device("cpu"), 0)
    with pytest.raises(ValueError, match="is not a cpu generator's"):
        comm.restore_generator(gen, torch.zeros(16, dtype=torch.uint8))  # a CUDA generator's 16 bytes
    other = comm.make_generator(torch.device("cpu"), 5)
    comm.restore_generator(gen, other.get_state())
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=other))
