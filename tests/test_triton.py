"""The Triton kernels (lioncub.fused.triton) equal the torch CPU path bit for bit.

By default on CPU tensors, run by Triton's interpreter (TRITON_INTERPRET=1; small tensors:
the interpreter is slow). With ``LIONCUB_TEST_DEVICE=cuda`` (what ``make gpu-check`` does)
the same tests run the compiled kernels on CUDA copies of the inputs against the same CPU
references: the GPU must give the CPU path's bits.

Without pytest (a bare GPU machine) ``tests/gpu/kernel_runner.py`` runs this file's tests itself: each
``test_*`` whose arguments are only its :func:`cases` (the parametrised ones, and those with none); the ones
that need pytest's fixtures (``tmp_path``, ``capsys``) are skipped there and listed. Patching uses the standard
library's ``unittest.mock``, not pytest's ``monkeypatch``, so the same functions run either way."""
import contextlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

DEVICE = os.environ.get("LIONCUB_TEST_DEVICE", "cpu")
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (at the module's import)

try:
    import pytest  # noqa: E402
except ImportError:  # tests/gpu/kernel_runner.py on a machine without pytest
    pytest = None
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

if pytest is not None:
    from tests.conftest import require_module  # noqa: E402

    triton = require_module("triton")  # a skip; a failure under LIONCUB_REQUIRE=triton (.ci/run)
else:
    import triton  # noqa: E402  (the runner's machine must have it)
import triton.language as tl  # noqa: E402

from lioncub import fused
from lioncub.wire import kernels  # noqa: E402
from lioncub.lion import apply_update_, interpolate  # noqa: E402
from tests.kernel_data import kernel_tensors as _tensors  # noqa: E402  (m, g with zeros and -0.0 of c: ties)

if "lioncub.fused.triton" in sys.modules:  # defined earlier without the interpreter: define again
    tk = importlib.reload(sys.modules["lioncub.fused.triton"])
else:
    from lioncub.fused import triton as tk  # noqa: E402
if DEVICE == "cpu" and _INTERPRET_BEFORE is None:  # later test files see the environment as it was;
    del os.environ["TRITON_INTERPRET"]  # the fixture below sets it again around each test here
if DEVICE != "cpu" and not tk.available():  # asked for the GPU: never skip silently
    raise RuntimeError(f"LIONCUB_TEST_DEVICE={DEVICE} but the Triton kernels are {tk.status()}")


def cases(name: str, values: list):
    """``pytest.mark.parametrize(name, values)`` where pytest runs, and the same cases recorded on the function for
    tests/gpu/kernel_runner.py where it does not."""
    def mark(fn):
        fn.cases = (name, list(values))
        return pytest.mark.parametrize(name, values)(fn) if pytest is not None else fn
    return mark


class SkipCase(Exception):
    """A case that does not apply here (tests/gpu/kernel_runner.py's skip; pytest's where pytest runs)."""


def skip(reason: str):
    if pytest is not None:
        pytest.skip(reason)
    raise SkipCase(reason)


if pytest is not None:
    @pytest.fixture(autouse=True)
    def _interpreter(monkeypatch):
        """Triton's interpreter also reads TRITON_INTERPRET when a kernel runs."""
        if DEVICE == "cpu":
            monkeypatch.setenv("TRITON_INTERPRET", "1")


def _d(x):
    """The kernels' copy of a tensor (or list) on DEVICE; the references stay on CPU."""
    return [t.to(DEVICE) for t in x] if isinstance(x, (list, tuple)) else x.to(DEVICE)


def _same(got, want) -> bool:
    """Bit for bit (fp32 compared as int32: -0.0 and NaN payloads too)."""
    got = [got] if isinstance(got, torch.Tensor) else got
    want = [want] if isinstance(want, torch.Tensor) else want
    return len(got) == len(want) and all(
        a.dtype == b.dtype and torch.equal(a.cpu().view(torch.int32) if a.dtype == torch.float32 else a.cpu(),
                                           b.view(torch.int32) if b.dtype == torch.float32 else b)
        for a, b in zip(got, want))


def _flag(finite, out) -> bool:
    """The kernels' finite report: a 0-dim bool tensor on ``out``'s device (never read back by
    the kernels); here read as a bool."""
    assert isinstance(finite, torch.Tensor) and finite.dim() == 0 and finite.dtype == torch.bool, finite
    assert finite.device == out.device, (finite.device, out.device)
    return bool(finite)


ROOT = Path(__file__).resolve().parents[1]
# odd sizes; bytes shared by two tensors at every lane width; an empty tensor; > one program (1024)
SIZES = [[1], [3, 21, 0, 5, 17], [1001, 2, 1030]]


def _flat_c(ms, gs, beta1, maximize):
    return torch.cat([x.reshape(-1) for x in interpolate(ms, gs, beta1, maximize=maximize)] + [torch.zeros(0)])


@cases("sizes", SIZES)
def test_encode_equals_interpolate_sign_bits_pack(sizes):
    """Lanes of every width at both step parities, int8 signs and c itself, per-tensor β1 / maximize."""
    ms, gs = _tensors(sizes, seed=len(sizes))
    n = sum(sizes)
    for beta1, maximize in [(0.9, False), (0.3, True)]:
        c = _flat_c(ms, gs, beta1, maximize)
        for step in (0, 1):
            for bits in (1, 2, 4, 8):
                want = kernels.pack_bytes(kernels.sign_bits(c, step), n, bits)
                got = _d(torch.full((-(-n * bits // 8),), 0xAA, dtype=torch.uint8))
                assert _flag(tk.encode(_d(ms), _d(gs), beta1, maximize, got, bits=bits, step=step), got) is True
                assert _same(got, want), (beta1, maximize, step, bits)
        got = _d(torch.full((n,), 7, dtype=torch.uint8))
        assert _flag(tk.encode(_d(ms), _d(gs), beta1, maximize, got, bits=8, step=0, signs=True), got) is True
        assert _same(got.view(torch.int8), torch.sign(c).to(torch.int8))
        values = _d(torch.full((n,), float("nan")))
        assert _flag(tk.interpolate(_d(ms), _d(gs), [beta1] * len(sizes), [maximize] * len(sizes), values),
                     values) is True
        assert _same(values, c)  # bit for bit, -0.0 too
    betas, maxi = [0.9, 0.5, 0.99, 0.0, 0.7][:len(sizes)], [False, True, False, True, True][:len(sizes)]
    c = torch.cat([interpolate([m], [g], b, maximize=x)[0] for m, g, b, x in zip(ms, gs, betas, maxi)])
    got = _d(torch.empty(-(-n * 2 // 8), dtype=torch.uint8))
    tk.encode(_d(ms), _d(gs), betas, maxi, got, bits=2, step=1)
    assert _same(got, kernels.pack_bytes(kernels.sign_bits(c, 1), n, 2))


def test_encode_reports_nonfinite_gradients():
    """False for one NaN/±Inf in any tensor (also in a byte shared by two tensors), True for
    huge finite values; the packed bytes are those of the torch path either way."""
    sizes = [3, 21, 5]
    ms, gs = _tensors(sizes, seed=3)
    gs[1][4] = torch.finfo(torch.float32).max
    gs[2][0] = -torch.finfo(torch.float32).max
    n = sum(sizes)
    for (t, i), bad in zip([(0, 2), (1, 0), (1, 20), (2, 4)], [float("nan"), float("inf"), float("-inf"), float("nan")]):
        g2 = [x.clone() for x in gs]
        g2[t][i] = bad
        c = _flat_c(ms, g2, 0.9, False)
        for bits, signs in ((1, False), (4, False), (8, True)):
            out = _d(torch.empty(n if signs else -(-n * bits // 8), dtype=torch.uint8))
            assert _flag(tk.encode(_d(ms), _d(gs), 0.9, False, out, bits=bits, step=0, signs=signs), out) is True
            assert _flag(tk.encode(_d(ms), _d(g2), 0.9, False, out, bits=bits, step=1, signs=signs), out) is False, \
                (t, i, bits)
            want = torch.sign(c).to(torch.int8).view(torch.uint8) if signs else \
                kernels.pack_bytes(kernels.sign_bits(c, 1), n, bits)
            assert _same(out, want)
        values = _d(torch.empty(n))
        assert _flag(tk.interpolate(_d(ms), _d(g2), 0.9, False, values), values) is False


class _HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: the op behind ``.item()`` / ``bool()`` / ``int()`` of
    a tensor, i.e. every read of a tensor's value back to the host (a sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_finite_flag_is_a_device_tensor_read_without_a_host_sync():
    """encode (lanes, signs) and interpolate, straight and through fused's switch, return a 0-dim
    bool tensor on the output's device (True: all finite; False for a NaN / +Inf gradient)
    without reading anything back to the host: no ``_local_scalar_dense`` while they run."""
    real = fused._gpu
    with mock.patch.object(fused, "_gpu", lambda t: tk if DEVICE == "cpu" else real(t)):
        _finite_flags_without_a_host_read()


def _finite_flags_without_a_host_read():
    sizes = [3, 21, 0, 5]
    n = sum(sizes)
    ms, gs = _tensors(sizes, seed=4)
    nan, inf = [x.clone() for x in gs], [x.clone() for x in gs]
    nan[1][7], inf[3][4] = float("nan"), float("inf")
    lanes, signs, values = (_d(torch.empty(-(-n * 4 // 8), dtype=torch.uint8)),
                            _d(torch.empty(n, dtype=torch.uint8)), _d(torch.empty(n)))
    calls = [(lambda g: tk.encode(_d(ms), _d(g), 0.9, False, lanes, bits=4, step=0), lanes),
             (lambda g: tk.encode(_d(ms), _d(g), 0.9, True, signs, bits=8, step=1, signs=True), signs),
             (lambda g: tk.interpolate(_d(ms), _d(g), 0.9, False, values), values),
             (lambda g: fused.encode(_d(ms), _d(g), 0.9, False, lanes, bits=4, step=1), lanes),
             (lambda g: fused.interpolate(_d(ms), _d(g), 0.9, False, values), values)]
    with _HostReads() as mode:
        flags = [(call(g), out, want) for call, out in calls for g, want in ((gs, True), (nan, False), (inf, False))]
    assert mode.reads == 0
    assert [_flag(flag, out) for flag, out, _ in flags] == [want for _, _, want in flags]
    empty = _d(torch.empty(0, dtype=torch.uint8))  # no element: nothing launched, still a device flag
    assert _flag(tk.encode([_d(torch.zeros(0))], [_d(torch.zeros(0))], 0.9, False, empty, bits=1, step=0),
                 empty) is True
    with _HostReads() as mode:  # the counter does see a read
        flags[0][0].item()
    assert mode.reads == 1


# The offset helpers every kernel takes its indices from, run for a program id (an int32
# argument standing in for tl.program_id: the interpreter cannot run 2^21 programs) and a start
# past 2^31, as the kernels compute them: int32 arithmetic would wrap there.
_block_offsets, _lane_indices, _stream_indices = tk._block_offsets, tk._lane_indices, tk._stream_indices


def _offsets_probe_kernel(block_ptr, byte_ptr, lane_ptr, ends_ptr, i_ptr, j_ptr, pid, start, n,
                          PER: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    tl.store(block_ptr + r, _block_offsets(pid, BLOCK))
    byte, lanes, first, last = _lane_indices(pid, start, n, PER, BLOCK)
    tl.store(byte_ptr + r, byte)
    tl.store(lane_ptr + r[:, None] * PER + tl.arange(0, PER)[None, :], lanes)
    tl.store(ends_ptr, first)
    tl.store(ends_ptr + 1, last)
    i, j = _stream_indices(pid, start, BLOCK)
    tl.store(i_ptr + r, i)
    tl.store(j_ptr + r, j)


def _offsets_probe():
    """The probe, jitted when called: the module deletes TRITON_INTERPRET after its import, and
    the test's fixture sets it again, so only now does the decorator pick the interpreter."""
    return triton.jit(do_not_specialize=["pid", "start", "n"])(_offsets_probe_kernel)


def test_offsets_are_int64_past_2_31():
    """pid·BLOCK, start + i, start // PER, (start + n − 1) // PER and the lanes' element index
    i = byte·PER + lane − start: exact for program ids whose pid·BLOCK passes 2^31 (up to the
    largest grid, 2^31 − 1 programs) and starts past 2^31 / 2^32."""
    B, probe = tk._BLOCK, _offsets_probe()
    assert (2 ** 21) * B == 2 ** 31  # the first program id past int32 at this block size
    r = torch.arange(B, dtype=torch.int64)
    # (pid, start, n). Not start and n both in [2^31, 2^32): the interpreter holds such an
    # argument as uint32 (typed i64), and two of them add in uint32; compiled, both are i64.
    cases = [(0, 0, 10), (3, 5, 1030), (2 ** 21 - 1, 2 ** 31 - 3, 10), (1, 2 ** 31 - 1, 2 ** 31 - 1),
             (2 ** 21, 2 ** 31 + 5, 2 ** 33), (2 ** 21 + 7, 2 ** 32 + 7, 2 ** 31 + 3), (2 ** 31 - 1, 3 * 2 ** 33 + 1, 5)]
    for pid, start, n in cases:
        for per in (1, 2, 4, 8):
            got = [_d(torch.full((B,), -1, dtype=torch.int64)) for _ in range(2)]
            lanes, ends = _d(torch.full((B, per), -1, dtype=torch.int64)), _d(torch.full((2,), -1, dtype=torch.int64))
            i, j = _d(torch.full((B,), -1, dtype=torch.int64)), _d(torch.full((B,), -1, dtype=torch.int64))
            probe[(1,)](got[0], got[1], lanes, ends, i, j, pid, start, n, PER=per, BLOCK=B)
            first, last = start // per, (start + n - 1) // per
            byte = first + pid * B + r
            assert torch.equal(got[0].cpu(), pid * B + r), (pid, start, per)
            assert torch.equal(got[1].cpu(), byte), (pid, start, per)
            assert torch.equal(lanes.cpu(), byte[:, None] * per + torch.arange(per)[None, :] - start), (pid, start, per)
            assert ends.cpu().tolist() == [first, last], (pid, start, n, per)
            assert torch.equal(i.cpu(), pid * B + r) and torch.equal(j.cpu(), start + pid * B + r), (pid, start)


_KERNELS = ("_encode_lanes_kernel", "_encode_values_kernel", "_quantize_lanes_kernel", "_apply_kernel")


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
    # encode: one per non-empty tensor and call (3 calls); apply: one per call (3 calls); quantize_lanes: one for c
    assert len(launches) == 3 * 2 + 3 + 1
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


@cases("n", [1, 13, 1031])
def test_quantize_lanes_equals_round_clamp_then_pack(n):
    """q = round(c·mult) half to even, clamped to ±levels, + levels, in lanes: exact halves of
    both signs, values past ±levels, ±0.0, mult = 0."""
    g = torch.Generator().manual_seed(n)
    c = torch.randn(n, generator=g) * 3
    c[::4] = (torch.arange(len(c[::4]), dtype=torch.float32) % 13 - 6) + 0.5
    if n > 2:
        c[1], c[2] = -0.0, 0.0
    for bits, levels in ((2, 1), (4, 7), (8, 31), (8, 127)):
        for mult in (1.0, 0.7316, 127 / 2.3, 0.0):
            want = torch.round(c * mult).clamp_(-levels, levels).to(torch.int8).view(torch.uint8) + levels
            want = kernels.pack_bytes(want, n, bits)
            got = _d(torch.full((-(-n * bits // 8),), 0xAA, dtype=torch.uint8))
            tk.quantize_lanes(_d(c), mult, levels, bits, got)
            assert _same(got, want), (bits, levels, mult)
            got.fill_(0xAA)  # the multiplier as a device scalar (no host read of the scale): same bytes
            tk.quantize_lanes(_d(c), _d(torch.tensor(mult, dtype=torch.float32)), levels, bits, got)
            assert _same(got, want), ("tensor mult", bits, levels, mult)


HYPER = [(1e-3, 0.0, 0.99, False), (0.7, 1.3, 0.5, True)]


def _apply_case(sizes, seed):
    ms, gs = _tensors(sizes, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ps = [torch.randn(n, generator=g) for n in sizes]
    return ps, ms, gs


def _reference(ps, ms, gs, u, lr, wd, beta2, maximize):
    ps_ref, ms_ref = [p.clone() for p in ps], [m.clone() for m in ms]
    apply_update_(ps_ref, list(u.float().split([p.numel() for p in ps])), ms_ref, gs, lr=lr, beta2=beta2,
                  weight_decay=wd, maximize=maximize, foreach=True)
    return ps_ref + ms_ref


@cases("sizes", SIZES)
def test_apply_and_apply_bits_equal_apply_update(sizes):
    """From int8 u, from packed ±1 bits (1-bit vote) and from pos − neg bits (gather)."""
    n = sum(sizes)
    g = torch.Generator().manual_seed(n)
    u = torch.randint(-1, 2, (n,), generator=g, dtype=torch.int8)
    bits = torch.randint(0, 2, (2, n), generator=g, dtype=torch.uint8)
    pos_b, neg_b = bits[0], bits[1] * (1 - bits[0])
    pack = lambda b: kernels.pack_bytes(b.clone(), n, 1)  # noqa: E731
    for lr, wd, beta2, maximize in HYPER:
        for how, votes in [("u", u), ("pm1", 2 * pos_b.to(torch.int8) - 1),
                           ("posneg", pos_b.to(torch.int8) - neg_b.to(torch.int8))]:
            ps, ms, gs = _apply_case(sizes, seed=5)
            want = _reference(ps, ms, gs, votes, lr, wd, beta2, maximize)
            hp = dict(lr=lr, beta2=beta2, weight_decay=wd, maximize=maximize)
            ps, ms, gs = _d(ps), _d(ms), _d(gs)
            if how == "u":
                tk.apply(ps, ms, gs, _d(votes), **hp)
            else:
                tk.apply_bits(ps, ms, gs, _d(pack(pos_b)), None if how == "pm1" else _d(pack(neg_b)), **hp)
            assert _same(ps + ms, want), (how, lr)


@cases("bits", [2, 4, 8])
def test_apply_lanes_equals_vote_lanes_then_apply_update(bits):
    sizes = [3, 5, 17, 0, 1030]
    n, top = sum(sizes), (1 << bits) - 1
    g = torch.Generator().manual_seed(bits)
    k = torch.randint(0, top + 1, (n,), generator=g, dtype=torch.uint8)
    lanes = kernels.pack_bytes(k.clone(), n, bits)
    for above, below in [(1, 2), (top // 2, (top + 1) // 2), (0, 0), (top, top)]:
        u = kernels.vote_lanes(lanes, n, bits, above, below)
        ps, ms, gs = _apply_case(sizes, seed=6)
        want = _reference(ps, ms, gs, u, 1e-3, 0.1, 0.99, False)
        ps, ms, gs = _d(ps), _d(ms), _d(gs)
        tk.apply_lanes(ps, ms, gs, _d(lanes), bits, above, below, lr=1e-3, beta2=0.99, weight_decay=0.1)
        assert _same(ps + ms, want), (above, below)


def test_per_tensor_hyperparameters():
    sizes = [13, 8, 21]
    ps, ms, gs = _apply_case(sizes, seed=9)
    u = torch.randint(-1, 2, (sum(sizes),), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    hp = [(1e-2, 0.0, 0.9, False), (3e-3, 0.2, 0.95, True), (0.5, 1.0, 0.99, False)]
    want = []
    for p, m, gr, uu, (lr, wd, b2, x) in zip(ps, ms, gs, u.split(sizes), hp):
        want.append(_reference([p], [m], [gr], uu, lr, wd, b2, x))
    ps, ms, gs = _d(ps), _d(ms), _d(gs)
    tk.apply(ps, ms, gs, _d(u), lr=[h[0] for h in hp], weight_decay=[h[1] for h in hp],
             beta2=[h[2] for h in hp], maximize=[h[3] for h in hp])
    assert _same(ps + ms, [w[0] for w in want] + [w[1] for w in want])


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
    from lioncub import LionCub
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
    assert {c["kernel"] for c in compiled} == {"_encode_lanes_kernel", "_encode_values_kernel",
                                               "_quantize_lanes_kernel", "_apply_kernel", "_vote_count_kernel"}
    assert all(c["cubin_bytes"] > 0 for c in compiled)


def test_apply_is_one_launch_for_every_tensor_of_a_call():
    """The launches of one step's passes for 300 tensors (a 1.3B GPT has about as many): the apply kernels take
    them all in one launch (before: 300), the encode one launch per tensor; the result still equals the torch
    path bit for bit."""
    counted = []
    real = tk._launch
    with mock.patch.object(tk, "_launch", lambda kernel, *a, **kw: (counted.append(kernel), real(kernel, *a, **kw))):
        _count_launches(counted)


def _count_launches(counted):
    sizes = [3, 1, 2] * 100
    n = sum(sizes)
    ms, gs = _tensors(sizes, seed=11)
    tk.encode(_d(ms), _d(gs), 0.9, False, _d(torch.empty(-(-n // 8), dtype=torch.uint8)), bits=1, step=0)
    assert len(counted) == 300
    counted.clear()
    ps, ms2, gs2 = _apply_case(sizes, seed=12)
    u = torch.randint(-1, 2, (n,), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    want = _reference(ps, ms2, gs2, u, 1e-3, 0.1, 0.99, False)
    ps, ms2, gs2 = _d(ps), _d(ms2), _d(gs2)
    tk.apply(ps, ms2, gs2, _d(u), lr=1e-3, beta2=0.99, weight_decay=0.1)
    assert len(counted) == 1 and _same(ps + ms2, want)


@cases("world", [1, 2, 3, 4, 5, 8, 9, 64, 255])
def test_vote_count_kernel_equals_the_bit_sliced_counters(world):
    """The masks 2k > P and 2k = P of P rows of packed bits, in one launch, against the torch counters
    (kernels.vote_bits) word for word: odd byte counts, all-ones and all-zero columns (k = P, k = 0), rows that
    are a strided view of a wider buffer."""
    g = torch.Generator().manual_seed(world)
    for m in (1, 7, 13, 1031):
        wide = torch.randint(0, 256, (world, m + 5), generator=g, dtype=torch.uint8)
        wide[:, 0], wide[:, 1] = 255, 0
        rows = wide[:, 2:2 + m] if m > 2 else wide[:, :m]
        want = kernels.vote_bits(rows.contiguous(), world)
        got = tk.vote_bits(_d(rows), world)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)), (world, m)
    launches = []
    real = tk._launch
    try:
        tk._launch = lambda kernel, *a, **kw: (launches.append(kernel), real(kernel, *a, **kw))
        tk.vote_bits(_d(rows), world)
    finally:
        tk._launch = real
    assert len(launches) == 1


@cases("sizes", SIZES)
def test_lion_step_equals_lion_and_a_set_skip_flag_changes_nothing(sizes):
    """A whole Lion step in one launch (u = sign(c) made in the kernel; c = 0 exactly where m and g tie) equals
    lioncub.lion.lion bit for bit; with the device flag set (a non-finite gradient, decided on the device) p and
    m stay as they were, bit for bit, even where g holds NaN and Inf."""
    from lioncub.lion import lion

    for lr, wd, beta2, maximize in HYPER:
        for beta1 in (0.9, 0.5):
            ps, ms, gs = _apply_case(sizes, seed=31)
            want_p, want_m = [p.clone() for p in ps], [m.clone() for m in ms]
            lion(want_p, gs, want_m, lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, maximize=maximize, foreach=True)
            hp = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, maximize=maximize)
            got_p, got_m, got_g = _d(ps), _d(ms), _d(gs)
            tk.lion_step(got_p, got_m, got_g, **hp, skip=_d(torch.tensor(False)))
            assert _same(got_p + got_m, want_p + want_m), (lr, beta1)
            got_p, got_m, got_g = _d(ps), _d(ms), _d(gs)
            if sum(sizes) > 1:
                got_g[-1].view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
            tk.lion_step(got_p, got_m, got_g, **hp, skip=_d(torch.tensor(True)))
            assert _same(got_p + got_m, ps + ms), (lr, beta1)


def test_localcub_decides_a_non_finite_inner_step_on_the_device():
    """LocalCub's inner Lion through the one-launch kernel with the skip flag on the device (CUDA's path, here with
    the kernels interpreted on CPU tensors): the same parameters, momenta and skipped round as the host-read path,
    with no host read in any inner step (the round's end reads once)."""
    from lioncub import LocalCub

    def run(device_path: bool):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (37, 5)]
        if device_path:  # on the GPU (make gpu-check) its own tensors; here CPU tensors the kernels interpret
            ps = [torch.nn.Parameter(p.detach().to(DEVICE)) for p in ps]
        opt = LocalCub(ps, lr=1e-2, local_steps=3, nonfinite="skip")
        reads = []
        for step in range(9):  # rounds 0-2; a NaN in step 4 (round 1): that round is dropped
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(p.device)
            if step == 4:
                ps[0].grad[3] = float("nan")
            with contextlib.ExitStack() as patches:
                if device_path and DEVICE == "cpu":
                    patches.enter_context(mock.patch.object(fused, "_gpu", lambda t: tk))
                    patches.enter_context(mock.patch.object(fused, "usable", lambda *lists: True))
                real_bool, real_item = torch.Tensor.__bool__, torch.Tensor.item
                patches.enter_context(mock.patch.object(torch.Tensor, "__bool__",
                                                        lambda t: (reads.append(step), real_bool(t))[1]))
                patches.enter_context(mock.patch.object(torch.Tensor, "item",
                                                        lambda t: (reads.append(step), real_item(t))[1]))
                opt.step()
        return ps, opt, reads

    host_ps, host, host_reads = run(False)
    dev_ps, dev, dev_reads = run(True)
    assert host.skipped_rounds == dev.skipped_rounds == 1 and host.rounds == dev.rounds == 2
    assert _same(dev_ps + [dev.inner.state[p]["exp_avg"] for p in dev_ps],
                 host_ps + [host.inner.state[p]["exp_avg"] for p in host_ps])
    inner_steps = [s for s in range(9) if (s + 1) % 3]
    assert all(s in host_reads for s in inner_steps)  # the host path reads every inner step's verdict
    assert not any(s in dev_reads for s in inner_steps)  # the device path reads none of them


def test_the_kernel_tests_run_without_pytest():
    """make gpu-check on a machine without pytest: tests/gpu/kernel_runner.py imports this file with pytest hidden,
    runs a parametrised test's every case and lists the tests that need pytest's fixtures as not run."""
    env = dict(os.environ, TRITON_INTERPRET="1", LIONCUB_TEST_DEVICE="cpu")
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "kernel_runner.py"), "--without-pytest",
                        "--only", "quantize_lanes"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and not report["failed"], r.stderr[-2000:]
    assert report["passed"] == [f"test_quantize_lanes_equals_round_clamp_then_pack[{n}]" for n in (1, 13, 1031)]
