"""The message side's Triton kernels equal the torch CPU path bit for bit: the encode (c = β1·m + (1-β1)·g into
packed sign lanes, int8 signs or c itself, one launch for every tensor of a call), the quantized lanes and the vote
count. Interpreted on CPU, compiled on CUDA under ``make gpu-check`` (tests/triton_cases.py says how)."""
from unittest import mock

from tests import triton_cases  # before torch, triton and lioncub: it sets up the interpreter
from tests.triton_cases import DEVICE, SIZES, _d, _flag, _flat_c, _launches, _same, cases, tk, triton
from tests.kernel_data import kernel_tensors as _tensors

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import triton.language as tl  # noqa: E402

from lioncub import fused  # noqa: E402
from lioncub.lion import interpolate  # noqa: E402
from lioncub.wire import kernels  # noqa: E402

_interpreter = triton_cases.interpreter  # pytest's autouse fixture: the interpreter around each test here
# the kernel tests' sizes; empty tensors only; whole bytes and words; starts mid-byte past a program (8192 lanes)
ENCODE_SIZES = SIZES + [[0], [0, 0, 9, 0], [8, 24, 32], [7, 8193, 3, 0, 5]]


@cases("sizes", ENCODE_SIZES)
def test_encode_equals_interpolate_sign_bits_pack(sizes):
    """Lanes of every width at both step parities, int8 signs and c itself, per-tensor β1 / maximize; every byte
    written (``out`` starts as 0xAA), a byte's lanes from every tensor that holds one."""
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


def test_encode_is_one_launch_for_every_tensor_of_a_call():
    """300 tensors (a 1.3B GPT has about as many; sizes 0 to 40, 2-D ones among them, so bytes hold lanes of up to
    8 tensors and many start mid-byte), per-tensor β1 and maximize: each encode call is one launch (before: one per
    non-empty tensor, 300 for ``[3, 1, 2] × 100``), its bytes / signs / c those of the torch path."""
    g = torch.Generator().manual_seed(300)
    sizes = torch.randint(0, 41, (300,), generator=g).tolist()
    sizes[:3] = [0, 1, 0]
    ms, gs = _tensors(sizes, seed=300)
    ms = [m.reshape(2, -1) if m.numel() % 2 == 0 and m.numel() else m for m in ms]  # contiguous 2-D: same stream
    gs = [gr.reshape(m.shape) for m, gr in zip(ms, gs)]
    betas = torch.rand(300, generator=g).tolist()
    maxi = (torch.rand(300, generator=g) < 0.3).tolist()
    c = torch.cat([interpolate([m], [gr], b, maximize=x)[0].reshape(-1) for m, gr, b, x in zip(ms, gs, betas, maxi)])
    n = sum(sizes)
    for bits, signs in ((1, False), (2, False), (4, False), (8, False), (8, True)):
        got = _d(torch.full((n if signs else -(-n * bits // 8),), 0xAA, dtype=torch.uint8))
        with _launches() as launched:
            assert _flag(tk.encode(_d(ms), _d(gs), betas, maxi, got, bits=bits, step=bits % 2, signs=signs), got)
        want = torch.sign(c).to(torch.int8).view(torch.uint8) if signs else \
            kernels.pack_bytes(kernels.sign_bits(c, bits % 2), n, bits)
        assert launched == [tk._encode_kernel] and _same(got, want), (bits, signs)
    values = _d(torch.full((n,), float("nan")))
    with _launches() as launched:
        tk.interpolate(_d(ms), _d(gs), betas, maxi, values)
    assert launched == [tk._encode_kernel] and _same(values, c)


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
_block_offsets, _unit_elements, _stream_indices = tk._block_offsets, tk._unit_elements, tk._stream_indices
_tensors_of = tk._tensors_of


def _offsets_probe_kernel(block_ptr, unit_ptr, lane_ptr, ends_ptr, i_ptr, j_ptr, pid, start, total,
                          PER: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    tl.store(block_ptr + r, _block_offsets(pid, BLOCK))
    unit, lanes, lo, hi = _unit_elements(pid, total, PER, BLOCK)
    tl.store(unit_ptr + r, unit)
    tl.store(lane_ptr + r[:, None] * PER + tl.arange(0, PER)[None, :], lanes)
    tl.store(ends_ptr, lo)
    tl.store(ends_ptr + 1, hi)
    i, j = _stream_indices(pid, start, BLOCK)
    tl.store(i_ptr + r, i)
    tl.store(j_ptr + r, j)


def _search_probe_kernel(starts_ptr, j_ptr, t_ptr, k, BLOCK: tl.constexpr):
    # the encode's search for a program whose elements j (sorted) run from j[0] to j[BLOCK - 1]
    r = tl.arange(0, BLOCK)
    j = tl.load(j_ptr + r)
    tl.store(t_ptr + r, _tensors_of(starts_ptr, tl.cast(k, tl.int64), j, tl.load(j_ptr), tl.load(j_ptr + BLOCK - 1)))


def _jit(kernel, *sizes):
    """A probe, jitted when called: the module deletes TRITON_INTERPRET after its import, and
    the test's fixture sets it again, so only now does the decorator pick the interpreter."""
    return triton.jit(do_not_specialize=list(sizes))(kernel)


def test_offsets_are_int64_past_2_31():
    """pid·BLOCK, start + i, the encode's lanes j = unit·PER + lane and its program's first and last element
    pid·BLOCK·PER and min((pid + 1)·BLOCK·PER, total) − 1: exact for program ids whose pid·BLOCK passes 2^31 (up
    to the largest grid, 2^31 − 1 programs) and starts and streams past 2^31 / 2^32."""
    B, probe = tk._BLOCK, _jit(_offsets_probe_kernel, "pid", "start", "total")
    assert (2 ** 21) * B == 2 ** 31  # the first program id past int32 at this block size
    r = torch.arange(B, dtype=torch.int64)
    # (pid, start, total). Not start and total both in [2^31, 2^32): the interpreter holds such an
    # argument as uint32 (typed i64), and two of them add in uint32; compiled, both are i64.
    cases = [(0, 0, 10), (3, 5, 1030), (2 ** 21 - 1, 2 ** 31 - 3, 10), (1, 2 ** 31 - 1, 2 ** 31 - 1),
             (2 ** 21, 2 ** 31 + 5, 2 ** 33), (2 ** 21 + 7, 2 ** 32 + 7, 2 ** 31 + 3), (2 ** 31 - 1, 3 * 2 ** 33 + 1, 5),
             (2 ** 18 + 1, 0, 2 ** 31 + 2 ** 21 + 3), (2 ** 21 - 1, 7, 2 ** 34)]
    for pid, start, total in cases:
        for per in (1, 2, 4, 8):
            got = [_d(torch.full((B,), -1, dtype=torch.int64)) for _ in range(2)]
            lanes, ends = _d(torch.full((B, per), -1, dtype=torch.int64)), _d(torch.full((2,), -1, dtype=torch.int64))
            i, j = _d(torch.full((B,), -1, dtype=torch.int64)), _d(torch.full((B,), -1, dtype=torch.int64))
            probe[(1,)](got[0], got[1], lanes, ends, i, j, pid, start, total, PER=per, BLOCK=B)
            unit, lo = pid * B + r, pid * B * per
            assert torch.equal(got[0].cpu(), unit) and torch.equal(got[1].cpu(), unit), (pid, per)
            assert torch.equal(lanes.cpu(), unit[:, None] * per + torch.arange(per)[None, :]), (pid, per)
            assert ends.cpu().tolist() == [lo, min(lo + B * per, total) - 1], (pid, total, per)
            assert torch.equal(i.cpu(), pid * B + r) and torch.equal(j.cpu(), start + pid * B + r), (pid, start)


def test_the_encode_finds_each_elements_tensor_past_2_31():
    """The encode's search (:func:`lioncub.fused.triton._tensors_of`) against ``torch.searchsorted``: the tensor
    of each element of a program among k = 1 to 700 tensors, one tensor holding the whole program or hundreds
    (many of one element) in it, the tensors starting past 2^31 and 2^33."""
    B, probe, g = tk._BLOCK, _jit(_search_probe_kernel, "k"), torch.Generator().manual_seed(0)
    for k, big, width in [(1, 0, 1), (2, 2 ** 31 + 7, 1), (3, 2 ** 33 + 3, 1), (37, 2 ** 31 - 2, 3),
                          (300, 2 ** 32 + 1, 1), (700, 2 ** 33 + 5, 5), (5, 2 ** 31 + 1, 2000)]:
        sizes = torch.randint(1, width + 1, (k - 1,), generator=g)  # after a first tensor of `big` elements
        zero = torch.zeros(1, dtype=torch.int64)
        starts = torch.cat([zero, big + torch.cat([zero, torch.cumsum(sizes, 0)[:-1]])])[:k]
        for lo in {0, max(big - 5, 0), int(starts[-1]) - 3 if k > 1 else 7}:
            j = lo + torch.arange(B, dtype=torch.int64)
            t = _d(torch.full((B,), -1, dtype=torch.int64))
            probe[(1,)](_d(starts), _d(j), t, k, BLOCK=B)
            assert torch.equal(t.cpu(), torch.searchsorted(starts, j, right=True) - 1), (k, big, lo)


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
    with _launches() as launched:
        tk.vote_bits(_d(rows), world)
    assert launched == [tk._vote_count_kernel]

