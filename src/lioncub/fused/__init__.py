r"""Fused CPU loops for the two per-parameter passes of a voted step (fp32 only).

With plain torch ops a Lion Cub step walks every parameter's memory about seven
times: ``c = β1·m + (1-β1)·g`` (two ops), ``c ≥ 0`` and the packing (two), then
``p ← p - η·u`` and ``m ← β2·m + (1-β2)·g`` (three). This module does the same
arithmetic in two loops:

* :func:`encode` — ``c`` → this rank's part of the message (sign bits in 1/2/4/8-bit
  lanes with the step's zero parity, or int8 signs), ``c`` never stored;
* :func:`apply` — the voted int8 ``u`` → ``p`` and ``m`` updated in one pass (and
  :func:`apply_bits` / :func:`apply_lanes` straight from the voted bits or lane sums).

Quantized ``pbit`` votes need the whole ``c`` for their scale: :func:`interpolate` writes it
in one pass, :func:`quantize_lanes` rounds, clamps and packs it into lanes in another.
The loops that read ``g`` also report whether it is finite (NaN/±Inf), so a step needs no
separate read for :func:`lioncub.engine.guard.grads_finite`: a Python bool from the C loops, a 0-dim
``torch.bool`` tensor on the tensors' device from the Triton kernels (not read back: no host
sync; whoever combines several uses ``torch.logical_and``, never ``and`` / ``bool()``).

The results are those of the torch ops bit for bit: the loops repeat torch's CPU
arithmetic operation by operation (``mul`` by a float32 scalar, then ``add`` with
``alpha`` as one fused multiply-add, ``fmaf``), compiled with contraction off so the
compiler adds no FMA of its own. ``tests/test_fused.py`` checks equality against the
torch path on random data.

The loops are C (``fused.c`` beside this file), compiled on first use with the system C
compiler (``cc``) into a per-machine cache (``$LIONCUB_CACHE`` or ``~/.cache/lioncub``)
and called through ctypes with raw pointers. No compiler, a failed build, or ``LIONCUB_FUSED=0``: the
torch path runs instead (same results, slower); :func:`available` says which.

Contiguous fp32 CUDA tensors take the same functions through :mod:`lioncub.fused.triton`
(Triton kernels, same layouts and arithmetic; :func:`usable` and ``_gpu`` are the switch);
without Triton, or with ``LIONCUB_FUSED=0``, they take the torch path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional, Union

import torch
from torch import Tensor

from ..wire import kernels

__all__ = ["available", "status", "warn_if_unavailable", "encode", "interpolate", "quantize_lanes", "apply", "apply_bits", "apply_lanes", "usable",
           "unusable_reason", "backend_of", "vote_bits"]

_SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared"]


def _cache_dir() -> str:
    return os.environ.get("LIONCUB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lioncub")


def _cpu_key() -> str:
    """The build is -march=native: key the cache by the CPU it was built for."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "".join(lines) + sys.platform


@functools.lru_cache(maxsize=None)
def _build() -> tuple[Optional[ctypes.CDLL], str]:
    """(the loaded library or None, a line saying which and why)."""
    if os.environ.get("LIONCUB_FUSED", "1") == "0":
        return None, "off: LIONCUB_FUSED=0"
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None, f"unavailable: no C compiler ({os.environ.get('CC', 'cc')!r} not on PATH)"
    try:
        with open(_SOURCE_PATH) as f:
            source = f.read()
    except OSError as exc:  # an install without the C file
        return None, f"unavailable: cannot read {_SOURCE_PATH} ({exc.strerror})"
    key = hashlib.sha256((source + " ".join(_FLAGS) + cc + _cpu_key()).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"lioncub_fused_{key}.so")
    if not os.path.exists(path):
        try:
            os.makedirs(_cache_dir(), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=_cache_dir()) as d:  # ranks may build at once:
                src, tmp = os.path.join(d, "fused.c"), os.path.join(d, "fused.so")  # build apart,
                with open(src, "w") as f:
                    f.write(source)
                subprocess.run([cc, *_FLAGS, "-o", tmp, src, "-lm"], check=True, capture_output=True, timeout=120)
                os.replace(tmp, path)  # then move in atomically
        except subprocess.CalledProcessError as exc:
            tail = exc.stderr.decode(errors="replace").strip().splitlines()[-1:] if exc.stderr else []
            return None, f"unavailable: {cc} failed to build {_SOURCE_PATH}: {' '.join(tail)}"
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"unavailable: building into {_cache_dir()} failed ({exc})"
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return None, f"unavailable: cannot load {path} ({exc})"
    i64, f32, vp = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.lc_encode.argtypes = [i64, vp, vp, vp, vp, vp, i64, i64, i64, vp]
    lib.lc_encode.restype = i64
    lib.lc_quantize_lanes.argtypes = [vp, i64, f32, i64, i64, vp]
    lib.lc_quantize_lanes.restype = None
    lib.lc_apply.argtypes = [i64, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp]
    lib.lc_apply.restype = None
    lib.lc_apply_bits.argtypes = [i64, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp]
    lib.lc_apply_bits.restype = None
    lib.lc_apply_lanes.argtypes = [i64, vp, vp, vp, vp, vp, i64, i64, i64, vp, vp, vp, vp, vp]
    lib.lc_apply_lanes.restype = None
    return lib, f"in use: {path}"


def _lib() -> Optional[ctypes.CDLL]:
    return _build()[0]


def status() -> str:
    """One line: ``in use: <library>``, or why the torch path runs (``off: ...`` when
    disabled with ``LIONCUB_FUSED=0``, ``unavailable: ...`` otherwise)."""
    return _build()[1]


def available() -> bool:
    """True when the compiled loops are in use (else the torch path runs)."""
    return _lib() is not None


def warn_if_unavailable(params: list[Tensor], who: str, stacklevel: int = 2) -> None:
    """fp32 CPU parameters but the fused loops failed to build: say so once, with why."""
    why = status()
    if why.startswith("unavailable") and any(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
        import warnings

        warnings.warn(f"{who}: the fused CPU loops are {why}. The torch path runs instead (same results, "
                      "3-10x slower local work per step). Set LIONCUB_FUSED=0 to choose it and silence this.",
                      RuntimeWarning, stacklevel=stacklevel + 1)


def usable(*tensor_lists: list[Tensor]) -> bool:
    """The loops take contiguous fp32 CPU tensors; contiguous fp32 CUDA tensors get the Triton
    kernels of :mod:`lioncub.fused.triton` when Triton is installed (anything else: the torch path)."""
    ts = [t for group in tensor_lists for t in group]
    if any(_traced(t) for t in ts):  # no data behind them: the loops would read null pointers
        return False
    if ts and all(t.device.type == "cuda" for t in ts):
        from . import triton as triton_kernels
        return triton_kernels.handles(ts)
    return available() and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                               for t in ts)


def _traced(t: Tensor) -> bool:
    """Whether ``t`` is a fake tensor (``FakeTensorMode``: a memory estimate, a trace), whose data pointer is null."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def unusable_reason(ts: list[Tensor]) -> Optional[str]:
    """None when :func:`usable` holds for the tensors ``ts``, else why not, in one line."""
    if usable(ts):
        return None
    if any(_traced(t) for t in ts):
        return "fake tensors (FakeTensorMode) have no data for the loops"
    if ts and all(t.device.type == "cuda" for t in ts):
        return "CUDA tensors need contiguous fp32 and Triton (lioncub.fused.triton)"
    if not available():
        return f"fused CPU loops {status()}"
    bad = next(t for t in ts if not (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()))
    return (f"a {bad.dtype} tensor on {bad.device} (contiguous={bad.is_contiguous()}); "
            "the loops take contiguous fp32 tensors, all on CPU or all on CUDA")


def backend_of(ts: list[Tensor]) -> str:
    """Which fused loops run for the (usable) tensors ``ts``: Triton kernels or the C library."""
    return "Triton kernels" if ts and ts[0].device.type == "cuda" else f"C loops ({status()})"


def _gpu(t: Tensor):
    """The Triton kernels when ``t`` is a CUDA tensor (the backend switch), else None: the C loops."""
    if t.device.type != "cuda":
        return None
    from . import triton as triton_kernels
    return triton_kernels


def _ptrs(ts: list[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


def _sizes(ts: list[Tensor]) -> ctypes.Array:
    return (ctypes.c_int64 * len(ts))(*[t.numel() for t in ts])


def _per_tensor(value, k: int, ctype=ctypes.c_float) -> ctypes.Array:
    """A scalar for every tensor, or one value per tensor (param groups differ)."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * k
    if len(values) != k:
        raise ValueError(f"expected one value per tensor ({k}), got {len(values)}")
    return (ctype * k)(*values)


def encode(exp_avgs: list[Tensor], grads: list[Tensor], beta1, maximize, out: Tensor, *,
           bits: int, step: int, signs: bool = False) -> Union[bool, Tensor]:
    """This rank's part of the message for ``c = β1·m + (1-β1)·g`` of the tensors in
    order, written into the uint8 ``out``: ``bits``-wide lanes (1, 2, 4, 8) of ``c ≥ 0``
    (even ``step``) / ``c > 0`` (odd), as :func:`lioncub.wire.kernels.sign_bits` +
    :func:`~lioncub.wire.kernels.pack_bytes`; or, with ``signs``, one int8 ``sign(c)`` per element.
    ``beta1``, ``maximize``: one value, or one per tensor. Call only when :func:`usable`.

    Returns whether every gradient is finite (no NaN, no ±Inf): a bool (C loops) or a 0-dim
    bool tensor on the tensors' device (Triton: no host sync) — the check of
    :func:`lioncub.engine.guard.grads_finite`, made during the same read of ``g``, passed on as is."""
    n = sum(t.numel() for t in exp_avgs)
    need = n if signs else -(-n * bits // 8)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != need:
        raise ValueError(f"out must be a contiguous uint8 tensor of {need} bytes, got {out.dtype} {tuple(out.shape)}")
    if _gpu(out) is not None:
        return _gpu(out).encode(exp_avgs, grads, beta1, maximize, out, bits=bits, step=step, signs=signs)
    return _encode(exp_avgs, grads, beta1, maximize, out, mode=1 if signs else 0, bits=bits, step=step)


def _encode(exp_avgs, grads, beta1, maximize, out: Tensor, *, mode: int, bits: int, step: int) -> bool:
    """The C loop behind :func:`encode` (mode 0: lanes, 1: int8 signs) and :func:`interpolate` (2)."""
    k = len(exp_avgs)
    b1 = list(_per_tensor(beta1, k, ctypes.c_double))
    mx = list(_per_tensor(maximize, k, ctypes.c_bool))
    alphas = [-(1.0 - b) if x else 1.0 - b for b, x in zip(b1, mx)]  # as lion.interpolate
    return not _lib().lc_encode(k, _ptrs(exp_avgs), _ptrs(grads), _sizes(exp_avgs), _per_tensor(b1, k),
                                _per_tensor(alphas, k), mode, bits, 1 if step % 2 == 0 else 0, out.data_ptr())


def interpolate(exp_avgs: list[Tensor], grads: list[Tensor], beta1, maximize, out: Tensor) -> Union[bool, Tensor]:
    """``c = β1·m + (1-β1)·g`` of the tensors in order into the flat fp32 ``out``, as
    :func:`lioncub.lion.interpolate` computes it (bit for bit), in one pass. Call only when
    :func:`usable`.

    Returns whether every gradient is finite: a bool (C loops) or a 0-dim bool tensor on the
    tensors' device (Triton: no host sync), passed on as is."""
    n = sum(t.numel() for t in exp_avgs)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != n:
        raise ValueError(f"out must be a contiguous fp32 tensor of {n} elements, got {out.dtype} {tuple(out.shape)}")
    if _gpu(out) is not None:
        return _gpu(out).interpolate(exp_avgs, grads, beta1, maximize, out)
    return _encode(exp_avgs, grads, beta1, maximize, out, mode=2, bits=32, step=0)


def quantize_lanes(c: Tensor, mult, levels: int, bits: int, out: Tensor) -> None:
    """``bits``-wide lanes (2, 4, 8) of ``q + levels``, ``q = round(c·mult)`` clamped to
    ``[-levels, levels]`` (half to even), into the uint8 ``out``: what
    ``quantize._scaled`` + :func:`lioncub.wire.kernels.pack_bytes` make of the flat fp32 ``c``,
    in one pass. ``mult``: ``levels / norm``, or 0 for an all-zero code: a float, or a 0-dim
    fp32 tensor (on CUDA it stays there: the kernel loads it, no host read)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
    if not isinstance(levels, int) or not 1 <= levels or 2 * levels >= 1 << bits:  # q + levels fits a lane
        raise ValueError(f"levels must be in [1, {((1 << bits) - 1) // 2}] for {bits}-bit lanes, got {levels!r}")
    n = c.numel()
    need = -(-n * bits // 8)
    if c.dtype != torch.float32 or not c.is_contiguous() or c.device.type not in ("cpu", "cuda"):
        raise ValueError(f"c must be a contiguous fp32 CPU or CUDA tensor, got {c.dtype} on {c.device}")
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != need:
        raise ValueError(f"out must be a contiguous uint8 tensor of {need} bytes, got {out.dtype} {tuple(out.shape)}")
    if _gpu(c) is not None:
        return _gpu(c).quantize_lanes(c, mult, levels, bits, out)
    _lib().lc_quantize_lanes(c.data_ptr(), n, float(mult), levels, bits, out.data_ptr())  # CPU: free to read


def vote_bits(packed: Tensor, world: int) -> tuple[Tensor, Tensor]:
    """:func:`lioncub.wire.kernels.vote_bits` (the masks "2k > P" and "2k = P" of P rows of packed bits): one
    Triton launch for CUDA rows when the kernels are in use, else the torch ops (bit-sliced counters)."""
    rows = packed.reshape(packed.shape[0], -1) if packed.dim() > 1 else packed.reshape(1, -1)
    gpu = _gpu(rows)
    if gpu is not None and gpu.available() and world <= 255 and rows.stride(-1) == 1 and not _traced(rows):
        return gpu.vote_bits(rows, world)
    return kernels.vote_bits(packed, world)


def apply(params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], u: Tensor, *, lr,
          beta2, weight_decay, maximize=False) -> None:
    """In place, from the int8 votes ``u`` (the tensors' elements in order): the same
    as :func:`lioncub.lion.apply_update_` with ``u`` as float. Hyper-parameters: one
    value, or one per tensor. Call only when :func:`usable`."""
    n = sum(t.numel() for t in params)
    if u.dtype != torch.int8 or not u.is_contiguous() or u.numel() != n:
        raise ValueError(f"u must be a contiguous int8 tensor of {n} elements, got {u.dtype} {tuple(u.shape)}")
    if _gpu(u) is not None:
        return _gpu(u).apply(params, exp_avgs, grads, u, lr=lr, beta2=beta2, weight_decay=weight_decay,
                             maximize=maximize)
    _lib().lc_apply(len(params), _ptrs(params), _ptrs(exp_avgs), _ptrs(grads), _sizes(params), u.data_ptr(),
                    *_update_args(len(params), lr, beta2, weight_decay, maximize))


def apply_bits(params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], pos: Tensor,
               neg: Optional[Tensor] = None, *, lr, beta2, weight_decay, maximize=False) -> None:
    """:func:`apply` with ``u`` read from packed bits (element ``j`` = bit ``j % 8`` of
    byte ``j // 8``): ``u = pos − neg``, or ``u = 2·pos − 1`` without ``neg`` (the 1-bit
    vote). Saves the int8 ``u`` pass. Call only when :func:`usable`."""
    nbytes = -(-sum(t.numel() for t in params) // 8)
    for name, bits in (("pos", pos), ("neg", neg)):
        if bits is not None and (bits.dtype != torch.uint8 or not bits.is_contiguous() or bits.numel() < nbytes):
            raise ValueError(f"{name} must be a contiguous uint8 tensor of >= {nbytes} bytes, "
                             f"got {bits.dtype} {tuple(bits.shape)}")
    if _gpu(pos) is not None:
        return _gpu(pos).apply_bits(params, exp_avgs, grads, pos, neg, lr=lr, beta2=beta2,
                                    weight_decay=weight_decay, maximize=maximize)
    _lib().lc_apply_bits(len(params), _ptrs(params), _ptrs(exp_avgs), _ptrs(grads), _sizes(params), pos.data_ptr(),
                         None if neg is None else neg.data_ptr(),
                         *_update_args(len(params), lr, beta2, weight_decay, maximize))


def apply_lanes(params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], lanes: Tensor, bits: int,
                above: int, below: int, *, lr, beta2, weight_decay, maximize=False) -> None:
    """:func:`apply` with ``u = (k > above) − (k < below)`` read from the ``bits``-wide lane
    sums ``k`` of ``lanes`` (2, 4 or 8 bits; element ``j`` = lane ``j``), the ``pbit`` vote
    of :func:`lioncub.wire.kernels.vote_lanes` without its int8 pass. Call only when :func:`usable`."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
    nbytes = -(-sum(t.numel() for t in params) * bits // 8)
    if lanes.dtype != torch.uint8 or not lanes.is_contiguous() or lanes.numel() < nbytes:
        raise ValueError(f"lanes must be a contiguous uint8 tensor of >= {nbytes} bytes, "
                         f"got {lanes.dtype} {tuple(lanes.shape)}")
    if _gpu(lanes) is not None:
        return _gpu(lanes).apply_lanes(params, exp_avgs, grads, lanes, bits, above, below, lr=lr, beta2=beta2,
                                       weight_decay=weight_decay, maximize=maximize)
    _lib().lc_apply_lanes(len(params), _ptrs(params), _ptrs(exp_avgs), _ptrs(grads), _sizes(params),
                          lanes.data_ptr(), bits, above, below,
                          *_update_args(len(params), lr, beta2, weight_decay, maximize))


def _update_args(k: int, lr, beta2, weight_decay, maximize) -> list:
    """Per-tensor has-decay flag, decay, -lr, β2 and momentum alpha, as lion.apply_update_ forms them."""
    lrs, wds = list(_per_tensor(lr, k, ctypes.c_double)), list(_per_tensor(weight_decay, k, ctypes.c_double))
    b2 = list(_per_tensor(beta2, k, ctypes.c_double))
    mx = list(_per_tensor(maximize, k, ctypes.c_bool))
    return [_per_tensor([int(w != 0) for w in wds], k, ctypes.c_int64),
            _per_tensor([1.0 - a * w for a, w in zip(lrs, wds)], k), _per_tensor([-a for a in lrs], k),
            _per_tensor(b2, k), _per_tensor([-(1.0 - b) if x else 1.0 - b for b, x in zip(b2, mx)], k)]


def adam_step_unless(optimizer, skip: Tensor) -> bool:
    """One step of a torch ``Adam``/``AdamW`` built with ``fused=True`` that the 0-dim ``skip`` flag cancels on the
    device: torch's fused kernel reads it as its ``found_inf`` (the parameters, moments and step counts stay as they
    were), no host read. Returns False, having done nothing, for any other optimizer: the caller then reads
    ``skip`` on the host."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    if not all(g.get("fused") for g in optimizer.param_groups) or hasattr(optimizer, "found_inf"):
        return False  # (a found_inf already set is the loss scaler's, under torch's newer contract)
    optimizer.found_inf = skip.to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    return True


def lion_step_unless(optimizer, skip: Tensor) -> bool:
    """One step of :class:`lioncub.lion.Lion` ``optimizer`` that the 0-dim ``skip`` flag (on the parameters' device)
    cancels on the device, when the Triton kernels take every tensor (contiguous fp32 CUDA): one launch per param
    group, no host read (as torch's fused optimizers read ``found_inf``). Returns False, having done nothing, when
    they do not (not our Lion, CPU tensors, another dtype): the caller then reads ``skip`` on the host."""
    from ..lion import Lion

    kernels = _gpu(skip)
    if not isinstance(optimizer, Lion) or kernels is None:
        return False
    todo = []
    for group in optimizer.param_groups:
        params, grads, exp_avgs = [], [], []
        optimizer._init_group(group, params, grads, exp_avgs)
        if params and not usable(params, grads, exp_avgs):
            return False
        todo.append((group, params, grads, exp_avgs))
    for group, params, grads, exp_avgs in todo:
        if params:
            beta1, beta2 = group["betas"]
            kernels.lion_step(params, exp_avgs, grads, lr=group["lr"], beta1=beta1, beta2=beta2,
                                 weight_decay=group["weight_decay"], maximize=group["maximize"], skip=skip)
    return True


STEP_UNLESS = (lion_step_unless, adam_step_unless)
"""The inner steps a 0-dim skip flag can cancel on the device (each returns False where it cannot)."""
