"""tests/gpu/gpu_check.py (``make gpu-check``) checked without a GPU.

Its ``--dry-run`` runs the same code on CPU tensors with plain gloo and Triton's interpreter:
every optimizer path of :data:`lioncub.testing.paths.PATHS` on two ranks under the device
audit, and the world-size-1 calls, must pass; deliberately broken paths (``--inject``) must be
reported as failed, with exit code 1, without hanging; a check that cannot run in the time
budget is a failure; tests/gpu/gpu_check.sh kills the whole process tree at its time limit. The
full dry run (every check, tests/test_triton.py included) is marked slow."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu" / "gpu_check.py"
ENV = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1"}


def _paths() -> list:
    sys.path.insert(0, str(ROOT / "src"))
    from lioncub.testing.paths import PATHS
    return list(PATHS)


PATHS = _paths()


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dry_run(out: Path, *args, timeout: float = 300):
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    report_file = out / "gpu_check.json"
    assert report_file.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return r, json.loads(report_file.read_text())


@pytest.mark.slow
def test_dry_run_passes_every_path_on_two_ranks_and_the_ws1_calls(tmp_path):
    """Every path of PATHS, the DDP hook ones included, on 2 gloo ranks under the audit: no
    error, no violation, collectives seen, both replicas' parameters bit-identical; and every
    world-size-1 call (vote exchanges, comm, guards, calibrate) without a violation. ~15 s."""
    r, report = _dry_run(tmp_path, "--checks", "nccl_ws1_calls,device_paths_two_ranks")
    check = report["checks"]["device_paths_two_ranks"]
    assert {n: check["paths"][n]["problems"] for n in check["failed"]} == {}, r.stdout[-4000:]
    assert check["passed"] == PATHS and check["paths_run"] == len(PATHS)
    assert check["mode"] == "cpu" and check["world_size"] == 2 and check["groups_started"] == 1
    for name in PATHS:
        rows = check["paths"][name]["ranks"]
        assert [row["rank"] for row in rows] == [0, 1]
        assert all(row["collectives"] > 0 and row["models"] >= 1 and row["violations"] == 0 for row in rows), name
        assert rows[0]["checksum"] == rows[1]["checksum"], name
    ws1 = report["checks"]["nccl_ws1_calls"]
    assert ws1["ok"], json.dumps(ws1)[:4000]
    assert {"vote sign_allreduce", "vote gather", "vote onebit", "vote pbit", "vote pbit-8-l1", "comm", "guard",
            "cost.calibrate"} <= set(ws1["calls"])
    assert ws1["calls"]["cost.calibrate"]["collectives_seen"] > 0  # calibrate really probed at one rank
    assert r.returncode == 0 and report["result"] == "pass", r.stdout[-3000:]
    assert report["subset"] == ["nccl_ws1_calls", "device_paths_two_ranks"]


@pytest.mark.slow  # ~10 s, a whole dry run: .ci/run runs it after the suite
def test_a_broken_path_is_a_failure_and_exit_code_1(tmp_path):
    """Injected paths: a collective on a tensor off the parameters' device, rank 1 raising while
    rank 0 waits in a collective (killed at once, the rest run in a fresh group: no hang), and
    replicas made to differ. Each is reported failed; the real paths around them pass."""
    t0 = time.monotonic()
    r, report = _dry_run(tmp_path, "--checks", "device_paths_two_ranks", "--only", "lioncub pbit",
                         "--only", "ddp hook*", "--inject", "off-device,rank1-raises,replicas-differ")
    assert time.monotonic() - t0 < 60
    assert r.returncode == 1 and report["result"] == "fail"
    assert "FAILED: device_paths_two_ranks" in r.stdout
    check = report["checks"]["device_paths_two_ranks"]
    assert check["ok"] is False
    assert check["passed"] == ["lioncub pbit", "ddp hook pbit", "ddp hook onebit"]
    assert check["failed"] == ["inject off-device", "inject rank1-raises", "inject replicas-differ"]
    paths = check["paths"]
    assert any("got a meta tensor" in p and "not cpu" in p for p in paths["inject off-device"]["problems"])
    first = paths["inject rank1-raises"]["errors"][0]  # the cause first, not rank 0's broken connection
    assert first["rank"] == 1 and "injected: rank 1 fails" in first["error"]
    assert any("replicas differ" in p for p in paths["inject replicas-differ"]["problems"])
    assert check["groups_started"] == 2  # one fresh group after the rank that raised


def test_judge_counts_syncs_backward_syncs_collectives_and_checksums():
    """The verdict on one path's rows (the CPU dry run records no host syncs: judged here)."""
    _module()  # puts tests/gpu/ on sys.path
    judge = importlib.import_module("gpu_check_paths")._judge
    row = dict(rank=0, violations=0, violation_lines=[], syncs_in_backward=0, backward_syncs=[],
               max_syncs_per_step=1, worst_step="step 0", worst_step_syncs=["item at x.py:1 f"], collectives=3,
               models=1, checksum="ab")
    assert judge([row, dict(row, rank=1)], 1) == []
    assert "2 host syncs in step 0 (budget 1)" in judge([row, dict(row, rank=1, max_syncs_per_step=2)], 1)[0]
    assert "inside backward" in judge([dict(row, syncs_in_backward=1), dict(row, rank=1)], 1)[0]
    assert "violation" in judge([dict(row, violations=1, violation_lines=["v"]), dict(row, rank=1)], 1)[0]
    assert "no collective" in judge([dict(row, collectives=0), dict(row, rank=1)], 1)[0]
    assert "no model" in judge([dict(row, models=0), dict(row, rank=1)], 1)[0]
    assert "replicas differ" in judge([row, dict(row, rank=1, checksum="cd")], 1)[0]


def test_a_check_without_time_left_is_a_failure(tmp_path):
    r, report = _dry_run(tmp_path, "--checks", "backend,lion_cuda_vs_cpu", "--budget-s", "0", timeout=120)
    assert r.returncode == 1 and report["result"] == "fail"
    assert all(not c["ok"] and "not run" in c["error"] for c in report["checks"].values())
    assert set(report["checks"]) == {"backend", "lion_cuda_vs_cpu"}


def _session_members(sid: int) -> list:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid:  # after "pid (comm)": state ppid pgrp session
            out.append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow  # ~10 s waiting out a time limit: .ci/run runs it after the suite
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_the_shell_kills_the_whole_process_tree_at_its_limit(tmp_path):
    """GPU_CHECK_LIMIT_S=8 against a run that stalls (two spawned ranks asleep in an injected
    path): exit 124, the log says so, and no process of the run is left (python, its ranks)."""
    env = dict(ENV, GPU_CHECK_LIMIT_S="8")
    proc = subprocess.Popen(["bash", str(SCRIPT.with_name("gpu_check.sh")), str(tmp_path), "--dry-run",
                             "--checks", "device_paths_two_ranks", "--only", "demo", "--inject", "hang",
                             "--budget-s", "200"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ranks_seen = False  # the ranks were alive in the run's session before the limit
    try:
        t0 = time.monotonic()
        while proc.poll() is None and not ranks_seen and time.monotonic() - t0 < 30:
            ranks_seen = any(b"spawn_main" in _cmdline(pid) for pid in _session_members(proc.pid))
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert ranks_seen and proc.returncode in (124, 137), out[-3000:]
    assert "TIMED OUT after 8 s" in out and "TIMED OUT" in (tmp_path / "gpu_check.log").read_text()
    deadline = time.monotonic() + 10
    while _session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _session_members(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert left == [], f"processes of the run outlived its time limit: {left}"
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["result"] != "pass"


@pytest.mark.slow  # ~30 s alone (tests/test_triton.py runs inside it), more on a loaded machine
def test_full_dry_run_passes(tmp_path):
    r, report = _dry_run(tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:]
    assert report["result"] == "pass" and report["subset"] is None
    assert list(report["checks"]) == list(_module().CHECKS) and all(c["ok"] for c in report["checks"].values())
    assert report["checks"]["device_paths_two_ranks"]["passed"] == PATHS
    assert all(c["ok"] for c in report["gloo_cuda_collectives"].values())
    assert "refused" not in json.dumps(report)


def test_exact_votes_allow_no_differing_element_and_the_l1_vote_its_tolerance():
    import torch
    gc = _module()
    want = [torch.arange(2000, dtype=torch.float32), torch.ones(2000)]  # p, m: 1 of 2000 elements is 0.05%
    got = [want[0].clone(), want[1].clone()]
    got[0][3] = torch.nextafter(got[0][3], torch.tensor(100.0))  # one element of p, one ulp away
    assert gc._compare(got, want, 4)["ok"] and not gc._compare(got, want, 4)["exact"]  # within the tolerance
    assert not gc._compare(got, want, 4, exact_only=True)["ok"]
    assert gc._compare(want, want, 4, exact_only=True)["ok"]
    assert [gc._exact(*v) for v in gc.VOTES] == [q is None for _, _, q in gc.VOTES]
    assert sum(not gc._exact(*v) for v in gc.VOTES) == 2  # pbit 4 and 8 with the L1 quantizer


def test_the_bandwidth_floor_can_fail():
    sys.path.insert(0, str(SCRIPT.parent))
    from gpu_check_bandwidth import FLOOR, judge
    rows = [dict(kernel="encode", of_copy=0.8), dict(kernel="apply", of_copy=FLOOR / 2)]
    assert judge(rows) == dict(ok=False, floor=FLOOR, below_floor=["apply"])
    assert judge(rows[:1])["ok"] and not judge([])["ok"]
    assert not judge([dict(kernel="nan", of_copy=float("nan"))])["ok"]


def test_the_long_checks_caps_fit_the_budget_and_the_callers_pythonpath_is_kept(tmp_path, monkeypatch):
    gc = _module()
    assert sum(gc.CAPS.values()) <= 0.9 and set(gc.CAPS) <= set(gc.CHECKS)
    seen = {}

    def run(cmd, **kw):  # the kernel runner's subprocess the check starts: its command, environment and time limit
        seen.update(cmd=cmd, env=kw["env"], timeout=kw["timeout"])
        report = dict(passed=["test_x"], failed={}, skipped={}, not_run=[])
        return subprocess.CompletedProcess(cmd, 0, json.dumps(report) + "\n", "")

    monkeypatch.setenv("PYTHONPATH", "/users/own/path")
    monkeypatch.setattr(gc.subprocess, "run", run)
    gc._DEADLINE[0], gc._BUDGET[0] = time.monotonic() + 200, 200.0
    assert gc.check_kernels_vs_cpu_reference("cpu")["ok"]
    assert "pytest" not in " ".join(seen["cmd"]) and seen["cmd"][-1].endswith("kernel_runner.py")  # no pytest needed
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[-1] == "/users/own/path"
    assert seen["env"]["PYTHONPATH"].split(os.pathsep)[0].endswith("src")
    assert seen["timeout"] <= gc.CAPS["kernels_vs_cpu_reference"] * 200 + 1e-9
