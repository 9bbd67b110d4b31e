"""The route to the Triton kernels: every launch under its tensors' device, fused's switch sending CUDA tensors to
them, LionCub steps through them equal to the C loops, the sm_90 compile, gpu-check without CUDA and the kernel
tests run without pytest. The kernels' own exact tests: tests/test_triton_encode.py (the message side) and
tests/test_triton_apply.py (the update side); tests/triton_cases.py sets up the interpreter they all run in."""
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from unittest import mock

from tests import triton_cases  # before torch, triton and lioncub: it sets up the interpreter
from tests.triton_cases import (DEVICE, ROOT, _apply_case, _d, _flag, _flat_c, _reference, _same, pytest, skip,
                                tk)
from tests.kernel_data import kernel_tensors as _tensors

import torch  # noqa: E402

from lioncub import fused  # noqa: E402
from lioncub.wire import kernels  # noqa: E402

_interpreter = triton_cases.interpreter  # pytest's autouse fixture: the interpreter around each test here
_KERNELS = ("_encode_kernel", "_quantize_lanes_kernel", "_apply_kernel")


def test_every_launch_runs_under_its_tensors_device():
    """Each kernel launch happens inside ``torch.cuda.device(<the tensors' device>)`` for CUDA
    tensors (Triton launches on the current device) and, for CPU tensors (the interpreter),
    without touching ``torch.cuda.device`` at all."""
    guard = tk._device_guard(torch.device("cuda", 1))  # built, not entered: no CUDA needed
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(tk._device_guard(torch.device("cpu")), contextlib.nullcontext)
    cuda_device, active, launches = torch.cuda.device, [], []

    class Recorder:
        def __init__(self, device):
            self.inner, self.device = cuda_device(device), torch.device(device)

        def __enter__(self):
            self.inner.__enter__()
            active.append(self.device)

        def __exit__(self, *exc):
            active.pop()
            return self.inner.__exit__(*exc)

    class Kernel:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **meta):
                devices = {a.device for a in args if isinstance(a, torch.Tensor)}
                launches.append((self.name, list(active), devices))
                return self.kernel[grid](*args, **meta)
            return launch

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(torch.cuda, "device", Recorder))
        for name in _KERNELS:
            patches.enter_context(mock.patch.object(tk, name, Kernel(name, getattr(tk, name))))
        _launch_every_kernel()
    assert {name for name, _, _ in launches} == set(_KERNELS)
    # encode: one per call (3 calls: lanes, signs, c); apply: one per call (3 calls); quantize_lanes: one for c
    assert len(launches) == 3 + 3 + 1
    device = torch.device(DEVICE) if DEVICE == "cpu" else torch.device(DEVICE, torch.cuda.current_device())
    for name, entered, devices in launches:
        assert devices == {device}, (name, devices)
        assert entered == ([device] if device.type == "cuda" else []), (name, entered)


def _launch_every_kernel():
    sizes = [5, 0, 11]
    n = sum(sizes)
    ms, gs = _tensors(sizes, seed=7)
    ps, ms2, gs2 = _apply_case(sizes, seed=8)
    hp = dict(lr=1e-3, beta2=0.99, weight_decay=0.1)
    tk.encode(_d(ms), _d(gs), 0.9, False, _d(torch.empty(-(-n // 8), dtype=torch.uint8)), bits=1, step=0)
    tk.encode(_d(ms), _d(gs), 0.9, False, _d(torch.empty(n, dtype=torch.uint8)), bits=8, step=0, signs=True)
    values = _d(torch.empty(n))
    tk.interpolate(_d(ms), _d(gs), 0.9, False, values)
    tk.quantize_lanes(values, 3.0, 7, 4, _d(torch.empty(-(-n * 4 // 8), dtype=torch.uint8)))
    ps, ms2, gs2 = _d(ps), _d(ms2), _d(gs2)
    tk.apply(ps, ms2, gs2, _d(torch.ones(n, dtype=torch.int8)), **hp)
    tk.apply_bits(ps, ms2, gs2, _d(torch.zeros(-(-n // 8), dtype=torch.uint8)), None, **hp)
    tk.apply_lanes(ps, ms2, gs2, _d(torch.zeros(-(-n * 4 // 8), dtype=torch.uint8)), 4, 7, 7, **hp)



def test_fused_switch_sends_cuda_tensors_to_the_kernels():
    """fused's functions hand the tensors for which ``fused._gpu`` answers (CUDA tensors; on
    CPU, CPU tensors as if they were) to the Triton kernels: the torch path's bytes and updates."""
    calls = []
    real = fused._gpu
    with mock.patch.object(fused, "_gpu", lambda t: calls.append(t.device.type) or (tk if DEVICE == "cpu" else real(t))):
        _through_the_switch()
    assert len(calls) >= 4 and set(calls) == {DEVICE}


def _through_the_switch():
    sizes = [7, 9]
    n = sum(sizes)
    ms, gs = _tensors(sizes, seed=1)
    c = _flat_c(ms, gs, 0.9, False)
    if DEVICE != "cpu":
        assert fused.usable(_d(ms), _d(gs)) and not fused.usable(_d(ms), gs)
    out = _d(torch.empty(-(-n * 4 // 8), dtype=torch.uint8))
    assert _flag(fused.encode(_d(ms), _d(gs), [0.9, 0.9], [False, False], out, bits=4, step=1), out) is True
    assert _same(out, kernels.pack_bytes(kernels.sign_bits(c, 1), n, 4))
    values = _d(torch.empty(n))
    assert _flag(fused.interpolate(_d(ms), _d(gs), 0.9, False, values), values) and _same(values, c)
    fused.quantize_lanes(values, 10.0, 7, 4, out)
    lanes = kernels.pack_bytes(torch.round(c * 10.0).clamp_(-7, 7).to(torch.uint8) + 7, n, 4)
    assert _same(out, lanes)
    ps, ms, gs = _apply_case(sizes, seed=2)
    want = _reference(ps, ms, gs, kernels.vote_lanes(lanes, n, 4, 7, 7), 1e-3, 0.1, 0.99, True)
    ps, ms, gs = _d(ps), _d(ms), _d(gs)
    fused.apply_lanes(ps, ms, gs, out, 4, 7, 7, lr=[1e-3] * 2, beta2=0.99, weight_decay=0.1, maximize=True)
    assert _same(ps + ms, want)


def test_status_and_cpu_tensors_keep_the_c_loops():
    if not torch.cuda.is_available():
        assert not tk.available() and "no CUDA device" in tk.status()
    else:
        assert tk.handles([torch.zeros(3, device="cuda")]) == tk.available()
    assert not tk.handles([torch.zeros(3)])
    assert fused._gpu(torch.zeros(3)) is None


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tests" / "gpu" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lioncub_worker(rank, world):
    """LionCub steps with every fused pass sent to the Triton kernels (interpreted, as CUDA
    tensors would be) against the same steps on the C loops / torch path: per vote method."""
    os.environ["TRITON_INTERPRET"] = "1"
    from tests.flat import LionCub
    gpu_check, real, calls = _gpu_check_module(), fused._gpu, []
    out = {}
    for vote, bits, q in [("onebit", None, None), ("pbit", 8, "l1")]:  # encode-first bits; c, lanes, lane sums
        make = lambda ps: LionCub(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, vote=vote,  # noqa: E731
                                  bits=bits, quantizer=q, nonfinite="skip_step", bucket_mb=1e-3, message_mb=2e-4)
        runs = []
        for route in (False, True):
            fused._gpu = (lambda t: calls.append(1) or tk) if route else real
            try:
                runs.append(gpu_check._run(make, "cpu", rank, nan_step=1 if rank == 1 else -1,
                                           shapes=[(13, 7), (333,)], steps=3))
            finally:
                fused._gpu = real
        out[f"{vote}-{bits}-{q}"] = gpu_check._compare(runs[1], runs[0], 0)["exact"]
    return out, len(calls)


def test_lioncub_steps_through_the_kernels_equal_the_c_loops():
    if DEVICE != "cpu" or not fused.available():
        skip("CPU run of the kernels against the C loops")
    """Two gloo ranks, 3 steps (both tie parities, a NaN gradient skipped), several buckets and
    messages: the CUDA route (fused -> triton_kernels) gives the C loops' parameters and momenta."""
    from tests.dist import run_workers
    for exact, calls in run_workers(_lioncub_worker, 2, timeout_s=120):
        assert calls > 0 and all(exact.values()), exact


def test_gpu_check_says_when_cuda_is_absent(tmp_path, capsys):
    """tests/gpu/gpu_check.py on a machine without CUDA: exit code 3, a report saying so, nothing passed."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: make gpu-check runs the real checks")
    gpu_check = _gpu_check_module()
    assert gpu_check.main(["--out", str(tmp_path)]) == 3
    printed = capsys.readouterr().out
    assert "CUDA is not available" in printed and "nothing was checked" in printed
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["cuda_available"] is False and report["result"] == "no-cuda" and report["checks"] == {}


def test_kernels_compile_for_a_hopper_gpu_without_one(tmp_path):
    """What the interpreter cannot see (Triton's GPU-only rules, types, the PTX without FMA
    contraction): one specialization of each kernel compiled for sm_90 with the bundled ptxas."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_check.py"), "--out", str(tmp_path),
                        "--compile-only", "90", "--quick"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    compiled = json.loads((tmp_path / "gpu_check.json").read_text())["compiled"]
    assert {c["kernel"] for c in compiled} == {"_encode_kernel", "_quantize_lanes_kernel", "_apply_kernel",
                                               "_vote_count_kernel"}
    assert all(c["cubin_bytes"] > 0 for c in compiled)


def test_the_kernel_tests_run_without_pytest():
    """make gpu-check on a machine without pytest: tests/gpu/kernel_runner.py imports every tests/test_triton*.py with
    pytest hidden, runs a parametrised test's every case and lists the tests that need pytest's fixtures as not
    run; its list holds every case of every kernel test file, as pytest collects them."""
    env = dict(os.environ, TRITON_INTERPRET="1", LIONCUB_TEST_DEVICE="cpu")

    def runner(*args):
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "kernel_runner.py"), "--without-pytest", *args],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        return r.returncode, json.loads(r.stdout.strip().splitlines()[-1]), r.stderr[-2000:]

    rc, report, err = runner("--only", "quantize_lanes")
    assert rc == 0 and not report["failed"], err
    assert report["passed"] == [f"test_quantize_lanes_equals_round_clamp_then_pack[{n}]" for n in (1, 13, 1031)]
    rc, listed, err = runner("--list")
    assert rc == 0, err
    modules = [importlib.import_module(f"tests.{path.stem}") for path in sorted((ROOT / "tests").glob("test_triton*.py"))]
    assert [m.__name__ for m in modules] == ["tests.test_triton", "tests.test_triton_apply", "tests.test_triton_encode"]
    want, fixtures = [], []
    for module in modules:
        for name, fn in vars(module).items():
            if name.startswith("test_") and callable(fn):
                arg, values = getattr(fn, "cases", (None, [None]))
                if {"tmp_path", "capsys"} & set(inspect.signature(fn).parameters):
                    fixtures.append(name)
                else:
                    want += [name] if arg is None else [f"{name}[{v}]" for v in values]
    assert sorted(listed["cases"]) == sorted(want) and sorted(listed["not_run"]) == sorted(fixtures)
