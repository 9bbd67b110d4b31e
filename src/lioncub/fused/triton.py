r"""Triton kernels for the per-parameter passes on CUDA: the GPU counterpart of ``fused.c``.

Same functions, arguments, layouts and arithmetic as :mod:`lioncub.fused` (which calls
these for CUDA tensors, the C loops for CPU tensors, the torch path otherwise):

* :func:`encode` — ``c = β1·m + (1-β1)·g`` → this rank's packed sign lanes (1/2/4/8 bits,
  ``c ≥ 0`` on even steps, ``c > 0`` on odd) or int8 ``sign(c)``; :func:`interpolate` — ``c``
  itself. Both report whether every gradient element is finite (read from its exponent bits)
  as a 0-dim ``torch.bool`` tensor on the tensors' device, never read back here (no host sync).
* :func:`quantize_lanes` — ``round(c·mult)`` (half to even) clamped to ``±levels``, plus
  ``levels``, in 2/4/8-bit lanes.
* :func:`apply` / :func:`apply_bits` / :func:`apply_lanes` — ``p ← p·decay − lr·u``,
  ``m ← β2·m + (1-β2)·g`` with ``u`` from int8 votes, packed bits or lane sums.

Arithmetic, operation by operation as torch's CPU kernels and the C loops do it: fp32
scalars (Python floats rounded to fp32 once), ``m·β1`` rounded, then **one fused
multiply-add** ``fma(α, g, m·β1)`` (``tl.fma``: rounded once, never left to the compiler's
contraction, which every launch turns off: ``enable_fp_fusion=False``, PTX ``.rn`` ops); the
same for ``m``. The p update ``fma(-lr, u, p·decay)`` is exact whatever
the contraction, since ``u ∈ {-1, 0, 1}``. So the results equal the torch CPU path bit for
bit (``tests/test_triton_*.py`` run every kernel in Triton's CPU interpreter,
``TRITON_INTERPRET=1``). torch's own CUDA kernels compute ``a + α·b`` as nvcc compiles it
(contracted to an FMA by default): ``tests/gpu/gpu_check.py`` measures whether that is exact
on the GPU too and allows at most 1 ulp there.

Tensors of one call form one stream (element ``j`` of the concatenation). The apply and the encode
kernels take every tensor of a call in one launch (a table of the tensors' addresses). An encode
program owns whole output bytes, so a packed byte shared by several tensors is assembled by one
program (each lane from its own tensor, found by :func:`_tensors_of`), never by two launches in turn.
The finite report is one int32 flag on the device that the programs OR into; the call returns
``flag == 0`` (a 0-dim bool tensor, still on the device): nothing waits for the kernels, so an
encode inside a backward hook does not stall the stream. Whoever needs the answer on the host
reads it (one sync), once, where it decides.

Every launch goes through :func:`_launch`: under ``torch.cuda.device(tensor.device)`` for a
CUDA tensor (Triton launches on the *current* device and its current stream, so a tensor on
another GPU would otherwise get the wrong one), with no guard for CPU tensors (the interpreter).

Offsets are int64: each kernel takes its element / byte indices from :func:`_block_offsets`
(``pid.to(int64)·BLOCK + arange``) and ``start`` as int64 (:func:`_unit_elements`,
:func:`_stream_indices`), so tensors and streams past 2^31 elements index correctly (int32
``pid·BLOCK`` wraps at 2^31). ``tests/test_triton_encode.py`` runs these helpers and the encode's
search in the interpreter with program ids, starts and streams past 2^31.

Import-time note: ``TRITON_INTERPRET=1`` must be set before this module is imported for
the kernels to run on CPU tensors.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path (or the C loops) run instead
    triton = None
    tl = None

__all__ = ["available", "status", "handles", "encode", "interpolate", "quantize_lanes", "apply",
           "apply_bits", "apply_lanes", "vote_bits", "lion_step"]

_BLOCK = 1024  # elements (apply, signs, c) or output bytes (lanes) per program
_NO_CONTRACTION = dict(enable_fp_fusion=False)  # launch option: no FMA but the explicit tl.fma


@functools.lru_cache(maxsize=None)
def status() -> str:
    """One line: ``in use: triton X`` when CUDA tensors get these kernels, or why not."""
    if os.environ.get("LIONCUB_FUSED", "1") == "0":
        return "off: LIONCUB_FUSED=0"
    if triton is None:
        return "unavailable: triton is not installed"
    if not torch.cuda.is_available():
        return f"unavailable: no CUDA device (triton {triton.__version__} installed)"
    return f"in use: triton {triton.__version__} for fp32 CUDA tensors"


def available() -> bool:
    """True when fp32 CUDA tensors get these kernels."""
    return status().startswith("in use")


def handles(tensors) -> bool:
    """All contiguous fp32 CUDA tensors and :func:`available`."""
    return available() and all(t.dtype == torch.float32 and t.device.type == "cuda" and t.is_contiguous()
                               for t in tensors)


if triton is not None:
    _MAGIC = tl.constexpr(12582912.0)  # 1.5·2^23: (y + M) - M rounds y half to even for |y| < 2^22

    @triton.jit
    def _nonfinite_any(g):
        """1 when an element of g has all exponent bits set (NaN, ±Inf), else 0."""
        bits = g.to(tl.int32, bitcast=True)
        return tl.max(((bits & 0x7F800000) == 0x7F800000).to(tl.int32))

    @triton.jit
    def _block_offsets(pid, BLOCK: tl.constexpr):
        """``pid·BLOCK + [0, BLOCK)`` in int64 (``pid``: the int32 program id; int32 would wrap
        at 2^31)."""
        return pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)

    @triton.jit
    def _unit_elements(pid, total, PER: tl.constexpr, BLOCK: tl.constexpr):
        """Program ``pid`` of the encode over a stream of ``total`` elements: ``(unit, j, lo, hi)`` in int64 — its
        BLOCK output units (bytes of ``PER`` lanes, or elements when ``PER`` is 1), the [BLOCK, PER] stream element
        of each lane ``j = unit·PER + lane``, and the first and last of them in the stream (``hi < total``)."""
        unit = _block_offsets(pid, BLOCK)
        lo = pid.to(tl.int64) * (BLOCK * PER)
        hi = tl.minimum(lo + BLOCK * PER, tl.cast(total, tl.int64)) - 1
        return unit, unit[:, None] * PER + tl.arange(0, PER)[None, :], lo, hi

    @triton.jit
    def _tensor_of(starts_ptr, j, lo, hi):
        """The tensor holding stream element ``j``: the largest ``t`` in ``[lo, hi]`` with ``starts[t] ≤ j``
        (``starts`` increasing, ``starts[lo] ≤ j``; ``j`` a scalar or a block, ``lo``/``hi`` scalars). A binary
        search: each step keeps the half ``[mid, hi]`` or ``[lo, mid − 1]``, ``mid = ⌈(lo + hi)/2⌉``, so the
        ``hi − lo + 1`` candidates become at most half as many; ``⌈log2(hi − lo + 1)⌉`` steps (the bit length
        of ``hi − lo``), none when ``lo = hi``."""
        span = hi - lo
        lo = j * 0 + lo  # j's shape: each element narrows its own range
        hi = j * 0 + hi
        while span > 0:
            mid = (lo + hi + 1) // 2
            ok = tl.load(starts_ptr + mid) <= j
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
            span = span // 2
        return lo

    @triton.jit
    def _tensors_of(starts_ptr, k, j, lo, hi):
        """The tensor of each stream element ``j`` (a block) of a program whose elements run from ``lo`` to
        ``hi``: the tensors of ``lo`` and ``hi`` first (scalar searches over all ``k``), then each element's
        among those only — no search at all when one tensor holds the whole program."""
        first = _tensor_of(starts_ptr, lo, 0, k - 1)
        last = _tensor_of(starts_ptr, hi, first, k - 1)
        return _tensor_of(starts_ptr, j, first, last)

    @triton.jit
    def _stream_indices(pid, start, BLOCK: tl.constexpr):
        """Program ``pid`` of a per-element kernel: ``(i, j)`` in int64 — the element index in
        this tensor and in the stream (``start + i``)."""
        i = _block_offsets(pid, BLOCK)
        return i, tl.cast(start, tl.int64) + i

    @triton.jit(do_not_specialize=["k", "total"])  # sizes: one compile per kind
    def _encode_kernel(ints_ptr, floats_ptr, k, total, out_ptr, bad_ptr, MODE: tl.constexpr, EVEN: tl.constexpr,
                       BITS: tl.constexpr, BLOCK: tl.constexpr):
        # Every tensor of the call in one launch (:func:`_encode`): ints holds the k non-empty tensors' m and g
        # addresses and their starts in the stream of `total` elements (increasing); floats their β1 and
        # α = ±(1 − β1). One program: BLOCK output units, whole, so no byte is written by two programs. MODE 0:
        # bytes of 8/BITS lanes of c ≥ 0 (EVEN) / c > 0, a byte's lanes from as many tensors as hold them;
        # 1: int8 sign(c) per element; 2: c per element (fp32).
        PER: tl.constexpr = 8 // BITS if MODE == 0 else 1
        k64 = tl.cast(k, tl.int64)
        total64 = tl.cast(total, tl.int64)
        starts_ptr = ints_ptr + 2 * k64
        unit, j, lo, hi = _unit_elements(tl.program_id(0), total, PER, BLOCK)
        inside = j < total64
        t = _tensors_of(starts_ptr, k64, j, lo, hi)  # [BLOCK, PER]; lanes past `total` (masked): the last tensor
        i = j - tl.load(starts_ptr + t)  # the element's index in its tensor
        m = tl.load(tl.load(ints_ptr + t).to(tl.pointer_type(tl.float32)) + i, mask=inside, other=0.0)
        g = tl.load(tl.load(ints_ptr + k64 + t).to(tl.pointer_type(tl.float32)) + i, mask=inside, other=0.0)
        c = tl.fma(tl.load(floats_ptr + k64 + t), g, m * tl.load(floats_ptr + t))
        if MODE == 0:
            if EVEN:
                on = c >= 0.0
            else:
                on = c > 0.0
            v = tl.where(inside & on, 1, 0) << (tl.arange(0, PER) * BITS)[None, :]
            tl.store(out_ptr + unit, tl.sum(v, axis=1).to(tl.uint8), mask=unit * PER < total64)
        elif MODE == 1:
            tl.store(out_ptr + j, ((c > 0.0).to(tl.int8) - (c < 0.0).to(tl.int8)), mask=inside)
        else:
            tl.store(out_ptr + j, c, mask=inside)
        tl.atomic_or(bad_ptr, _nonfinite_any(g))

    @triton.jit(do_not_specialize=["n", "nbytes"])
    def _quantize_lanes_kernel(c_ptr, out_ptr, n, nbytes, mult_ptr, s, BITS: tl.constexpr, BLOCK: tl.constexpr):
        PER: tl.constexpr = 8 // BITS
        byte = _block_offsets(tl.program_id(0), BLOCK)
        lane = tl.arange(0, PER)
        i = byte[:, None] * PER + lane[None, :]  # int64, as byte
        inside = i < n
        c = tl.load(c_ptr + i, mask=inside, other=0.0)
        sf = s
        mult = tl.load(mult_ptr)  # a device scalar: the scale is never read back to the host
        y = c * mult
        y = tl.where(y < -sf, -sf, tl.where(y > sf, sf, y))  # clamp first: rounding is monotone
        y = (y + _MAGIC) - _MAGIC  # half to even (|y| <= 127 here)
        q = (y + sf).to(tl.int32)
        v = tl.where(inside, q, 0) << (lane * BITS)[None, :]
        tl.store(out_ptr + byte, tl.sum(v, axis=1).to(tl.uint8), mask=byte < nbytes)

    @triton.jit(do_not_specialize=["k", "above", "below"])
    def _apply_kernel(ints_ptr, floats_ptr, k, u_ptr, neg_ptr, above, below, skip_ptr,
                      SOURCE: tl.constexpr, BITS: tl.constexpr, KMAX: tl.constexpr, SKIP: tl.constexpr,
                      BLOCK: tl.constexpr):
        # Every tensor of the call in one launch (:func:`_apply`): ints holds the k tensors' p, m and g addresses,
        # sizes, vote-stream starts and first program (a running count of their blocks); floats their decay,
        # -lr, β2 and ±(1 − β2) (SOURCE 4: then β1 and ±(1 − β1)). Program r finds its tensor t among the first
        # k ≤ KMAX firsts. SOURCE 0: int8 u; 1: u = 2·bit − 1; 2: u = pos bit − neg bit; 3: u from BITS-wide lane
        # sums; 4: Lion's own u = sign(fma(±(1 − β1), g, m·β1)). SKIP: the int32 at skip_ptr, when not 0, says the
        # whole call changes nothing (decided on the device: no host read).
        if SKIP:
            if tl.load(skip_ptr) != 0:
                return
        k64 = tl.cast(k, tl.int64)
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, KMAX)
        firsts = tl.load(ints_ptr + 5 * k64 + s, mask=s < k, other=row + 1)
        t = (tl.sum((firsts <= row).to(tl.int64)) - 1).to(tl.int64)
        blk = row - tl.load(ints_ptr + 5 * k64 + t)
        p_ptr = tl.load(ints_ptr + t).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(ints_ptr + k64 + t).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(ints_ptr + 2 * k64 + t).to(tl.pointer_type(tl.float32))
        n = tl.load(ints_ptr + 3 * k64 + t)
        start = tl.load(ints_ptr + 4 * k64 + t)
        decay = tl.load(floats_ptr + t)
        neg_lr = tl.load(floats_ptr + k64 + t)
        beta2 = tl.load(floats_ptr + 2 * k64 + t)
        alpha2 = tl.load(floats_ptr + 3 * k64 + t)
        i, j = _stream_indices(blk, start, BLOCK)  # int64: element index in p, and in the vote stream
        mask = i < n
        p = tl.load(p_ptr + i, mask=mask, other=0.0)
        m = tl.load(m_ptr + i, mask=mask, other=0.0)
        g = tl.load(g_ptr + i, mask=mask, other=0.0)
        if SOURCE == 4:
            c = tl.fma(tl.load(floats_ptr + 5 * k64 + t), g, m * tl.load(floats_ptr + 4 * k64 + t))
            u = (c > 0).to(tl.float32) - (c < 0).to(tl.float32)
        elif SOURCE == 0:
            u = tl.load(u_ptr + j, mask=mask, other=0).to(tl.float32)
        elif SOURCE == 3:
            PER: tl.constexpr = 8 // BITS
            shift = ((j % PER) * BITS).to(tl.int32)
            q = (tl.load(u_ptr + j // PER, mask=mask, other=0).to(tl.int32) >> shift) & ((1 << BITS) - 1)
            u = (q > above).to(tl.float32) - (q < below).to(tl.float32)
        else:
            bit = (j % 8).to(tl.int32)
            pb = (tl.load(u_ptr + j // 8, mask=mask, other=0).to(tl.int32) >> bit) & 1
            if SOURCE == 1:
                u = (2 * pb - 1).to(tl.float32)
            else:
                nb = (tl.load(neg_ptr + j // 8, mask=mask, other=0).to(tl.int32) >> bit) & 1
                u = (pb - nb).to(tl.float32)
        tl.store(p_ptr + i, tl.fma(neg_lr, u, p * decay), mask=mask)  # (decay 1.0 without weight decay: exact)
        tl.store(m_ptr + i, tl.fma(alpha2, g, m * beta2), mask=mask)


    @triton.jit(do_not_specialize=["stride", "world", "nbytes", "half"])
    def _vote_count_kernel(packed_ptr, stride, world, nbytes, half, gt_ptr, eq_ptr, EVEN: tl.constexpr,
                           BLOCK: tl.constexpr):
        # One program: BLOCK bytes (8·BLOCK elements) of the P rows; each element's count k of set bits over the
        # rows, then "k > ⌊P/2⌋" (2k > P) and, for even P, "k = P/2" (2k = P), packed as the rows are.
        byte = _block_offsets(tl.program_id(0), BLOCK)
        inside = byte < nbytes
        lane = tl.arange(0, 8)
        counts = tl.zeros([BLOCK, 8], dtype=tl.int32)
        for r in range(world):
            b = tl.load(packed_ptr + r * tl.cast(stride, tl.int64) + byte, mask=inside, other=0).to(tl.int32)
            counts += (b[:, None] >> lane[None, :]) & 1
        gt = tl.sum((counts > half).to(tl.int32) << lane[None, :], axis=1)
        tl.store(gt_ptr + byte, gt.to(tl.uint8), mask=inside)
        if EVEN:
            eq = tl.sum((counts == half).to(tl.int32) << lane[None, :], axis=1)
            tl.store(eq_ptr + byte, eq.to(tl.uint8), mask=inside)


def _per_tensor(value, k: int) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * k
    if len(values) != k:
        raise ValueError(f"expected one value per tensor ({k}), got {len(values)}")
    return values


def _grid(count: int) -> tuple[int]:
    return (triton.cdiv(count, _BLOCK),)


def _device_guard(device: torch.device):
    """``torch.cuda.device(device)`` for a CUDA device; a null context otherwise (CPU tensors in
    the interpreter: torch.cuda is never touched without CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(kernel, count: int, tensor: Tensor, *args, programs: Optional[int] = None, **meta) -> None:
    """``kernel`` over ``count`` indices (one program per ``_BLOCK``; or ``programs`` programs), launched with
    the current device set to ``tensor``'s (:func:`_device_guard`), FMA contraction off. Every launch here."""
    with _device_guard(tensor.device):
        kernel[_grid(count) if programs is None else (programs,)](*args, BLOCK=_BLOCK, **meta, **_NO_CONTRACTION)


def _table(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` as a tensor on ``device``: on CUDA from pinned memory, copied without blocking (no host sync:
    torch keeps the pinned buffer until the copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _encode(exp_avgs, grads, beta1, maximize, out: Tensor, *, mode: int, bits: int, step: int) -> Tensor:
    """One launch for every tensor of the call: a program per ``_BLOCK`` output units (bytes of lanes, mode 0;
    elements, modes 1 and 2) of the stream, each finding the tensor of each of its elements in a small table
    (:func:`_table`) of the non-empty tensors' addresses and starts, and their β1 and α (fp32, each rounded once
    from the Python float, as a scalar argument is). The finite flag: one int32 that the programs OR into."""
    k = len(exp_avgs)
    live, floats, start = [], [[], []], 0
    for m, g, b1, mx in zip(exp_avgs, grads, _per_tensor(beta1, k), _per_tensor(maximize, k)):
        if m.numel():
            b1 = float(b1)
            live.append((m.data_ptr(), g.data_ptr(), start))
            floats[0].append(b1)
            floats[1].append(-(1.0 - b1) if mx else 1.0 - b1)  # as lion.interpolate
        start += m.numel()
    bad = torch.zeros((), dtype=torch.int32, device=out.device)  # 0-dim: `bad == 0` is the 0-dim answer
    if live:
        per = 8 // bits if mode == 0 else 1
        ints = [e[column] for column in range(3) for e in live]
        dst = out.view(torch.int8) if mode == 1 else out
        _launch(_encode_kernel, -(-start // per), out, _table(ints, torch.int64, out.device),
                _table(floats[0] + floats[1], torch.float32, out.device), len(live), start, dst, bad, MODE=mode,
                EVEN=mode == 0 and step % 2 == 0, BITS=bits if mode == 0 else 8)
    return bad == 0  # on the device: no sync


def encode(exp_avgs: list[Tensor], grads: list[Tensor], beta1, maximize, out: Tensor, *,
           bits: int, step: int, signs: bool = False) -> Tensor:
    """:func:`lioncub.fused.encode` on CUDA: lanes of ``c ≥ 0`` / ``c > 0`` or int8 signs into
    the uint8 ``out``; returns whether every gradient element is finite as a 0-dim
    ``torch.bool`` tensor on ``out``'s device (True: all finite), computed without a host sync."""
    return _encode(exp_avgs, grads, beta1, maximize, out, mode=1 if signs else 0, bits=bits, step=step)


def interpolate(exp_avgs: list[Tensor], grads: list[Tensor], beta1, maximize, out: Tensor) -> Tensor:
    """:func:`lioncub.fused.interpolate` on CUDA: ``c`` into the flat fp32 ``out``; returns the
    finite flag as :func:`encode` does (0-dim bool tensor on ``out``'s device, no host sync)."""
    return _encode(exp_avgs, grads, beta1, maximize, out, mode=2, bits=32, step=0)


def quantize_lanes(c: Tensor, mult: float, levels: int, bits: int, out: Tensor) -> None:
    """:func:`lioncub.fused.quantize_lanes` on CUDA (arguments checked there)."""
    n = c.numel()
    if n:
        if isinstance(mult, Tensor):
            mult_t = mult.to(device=c.device, dtype=torch.float32).reshape(1)
        else:  # a Python float: filled on the device, no host-to-device copy
            mult_t = torch.full((1,), float(mult), dtype=torch.float32, device=c.device)
        _launch(_quantize_lanes_kernel, out.numel(), out, c, out, n, out.numel(), mult_t, float(levels),
                BITS=bits)


def _apply(params, exp_avgs, grads, source: int, u: Optional[Tensor], neg: Optional[Tensor], bits: int, above: int,
           below: int, *, lr, beta2, weight_decay, maximize, beta1=None, skip: Optional[Tensor] = None) -> None:
    """One launch for every tensor of the call: a program per ``_BLOCK`` elements of each non-empty tensor,
    found through two small tables (:func:`_table`, one entry per tensor) of the tensors' addresses, sizes,
    starts in the vote stream, first programs and hyper-parameters (fp32, each rounded once from the Python
    float, as a scalar argument is). ``KMAX``, the tables' length rounded up to a power of two, is one compile
    per size class. ``beta1`` (SOURCE 4 only): each tensor's β1; ``skip``: a 0-dim tensor on the device whose
    non-zero value makes the launch change nothing (read by the kernel, never on the host)."""
    k = len(params)
    hyper = zip(_per_tensor(lr, k), _per_tensor(beta2, k), _per_tensor(weight_decay, k), _per_tensor(maximize, k),
                _per_tensor(0.0 if beta1 is None else beta1, k))
    live, floats, programs, start = [], [[], [], [], [], [], []], 0, 0
    for p, m, g, (a, b2, wd, mx, b1) in zip(params, exp_avgs, grads, hyper):
        n = p.numel()
        if n:
            a, b2, wd, b1 = float(a), float(b2), float(wd), float(b1)
            live.append((p, m, g, n, start, programs))
            programs += triton.cdiv(n, _BLOCK)
            for column, value in zip(floats, (1.0 - a * wd if wd != 0 else 1.0, -a, b2,
                                              -(1.0 - b2) if mx else 1.0 - b2,  # as lion.apply_update_
                                              b1, -(1.0 - b1) if mx else 1.0 - b1)):  # as lion.interpolate
                column.append(value)
        start += n
    if not live:
        return
    device = params[0].device
    ints = [e[column].data_ptr() for column in range(3) for e in live] + [e[column] for column in (3, 4, 5)
                                                                          for e in live]
    flag = params[0] if skip is None else skip.reshape(1).to(torch.int32)  # (a pointer the kernel never reads)
    vote = params[0] if u is None else u
    _launch(_apply_kernel, 0, params[0], _table(ints, torch.int64, device),
            _table([v for column in floats for v in column], torch.float32, device), len(live), vote,
            vote if neg is None else neg, above, below, flag, programs=programs, SOURCE=source, BITS=bits,
            KMAX=max(16, triton.next_power_of_2(len(live))), SKIP=skip is not None)


def vote_bits(rows: Tensor, world: int) -> tuple[Tensor, Tensor]:
    """:func:`lioncub.wire.kernels.vote_bits` in one launch: ``rows`` (P, m) uint8 with contiguous rows; the
    masks "2k > P" and "2k = P" as int64 words (zero past the m bytes), as the torch function returns them."""
    m = rows.shape[1]
    gt = torch.zeros(-(-m // 8) * 8, dtype=torch.uint8, device=rows.device)
    eq = torch.zeros_like(gt)
    if m:
        _launch(_vote_count_kernel, m, rows, rows, rows.stride(0), world, m, world // 2, gt, eq, EVEN=world % 2 == 0)
    return gt.view(torch.int64), eq.view(torch.int64)


def apply(params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], u: Tensor, *, lr,
          beta2, weight_decay, maximize=False) -> None:
    """:func:`lioncub.fused.apply` on CUDA: p and m in place from the int8 votes ``u``."""
    _apply(params, exp_avgs, grads, 0, u, None, 8, 0, 0, lr=lr, beta2=beta2, weight_decay=weight_decay,
           maximize=maximize)


def apply_bits(params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], pos: Tensor,
               neg: Optional[Tensor] = None, *, lr, beta2, weight_decay, maximize=False) -> None:
    """:func:`lioncub.fused.apply_bits` on CUDA: ``u = 2·pos − 1``, or ``pos − neg``."""
    _apply(params, exp_avgs, grads, 1 if neg is None else 2, pos, neg, 1, 0, 0, lr=lr, beta2=beta2,
           weight_decay=weight_decay, maximize=maximize)


def apply_lanes(params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], lanes: Tensor, bits: int,
                above: int, below: int, *, lr, beta2, weight_decay, maximize=False) -> None:
    """:func:`lioncub.fused.apply_lanes` on CUDA: ``u = (k > above) − (k < below)``."""
    _apply(params, exp_avgs, grads, 3, lanes, None, bits, int(above), int(below), lr=lr, beta2=beta2,
           weight_decay=weight_decay, maximize=maximize)


def lion_step(params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], *, lr, beta1, beta2, weight_decay,
              maximize=False, skip: Optional[Tensor] = None) -> None:
    """One whole Lion step in one launch (:func:`lioncub.lion.lion`'s arithmetic): ``u = sign(c)`` of
    ``c = β1·m + (1-β1)·g`` made in the kernel, then ``p`` and ``m`` in place. ``skip``: a 0-dim tensor on the
    parameters' device; when it holds a non-zero value (e.g. a gradient was not finite) nothing changes, decided
    on the device as torch's fused optimizers read ``found_inf``."""
    _apply(params, exp_avgs, grads, 4, None, None, 8, 0, 0, lr=lr, beta2=beta2, weight_decay=weight_decay,
           maximize=maximize, beta1=beta1, skip=skip)
