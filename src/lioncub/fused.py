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
separate read for :func:`lioncub.guard.grads_finite`.

The results are those of the torch ops bit for bit: the loops repeat torch's CPU
arithmetic operation by operation (``mul`` by a float32 scalar, then ``add`` with
``alpha`` as one fused multiply-add, ``fmaf``), compiled with contraction off so the
compiler adds no FMA of its own. ``tests/test_fused.py`` checks equality against the
torch path on random data.

The loops are C, compiled on first use with the system C compiler (``cc``) into a
per-machine cache (``$LIONCUB_CACHE`` or ``~/.cache/lioncub``) and called through
ctypes with raw pointers. No compiler, a failed build, or ``LIONCUB_FUSED=0``: the
torch path runs instead (same results, slower); :func:`available` says which.
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
from typing import Optional

import torch
from torch import Tensor

__all__ = ["available", "encode", "interpolate", "quantize_lanes", "apply", "apply_bits", "apply_lanes", "usable"]

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* 1 when x is NaN or +-Inf (all exponent bits set), read from its bits. */
static inline uint32_t nonfinite(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7f800000u) == 0x7f800000u;
}

/* Whole output bytes from element i on; bits and even are constants at every call
   (inlined), so each byte's 8/bits elements unroll and vectorize. Returns the next i;
   sets *bad when a gradient read is not finite. */
static inline __attribute__((always_inline)) int64_t
blocks(const float *m, const float *g, int64_t i, int64_t n, float beta1, float alpha,
       const int bits, const int even, uint8_t **out, uint32_t *bad)
{
    const int per = 8 / bits;
    uint8_t *o = *out;
    uint32_t nf = 0;
    for (; i + per <= n; i += per) {
        uint32_t b = 0;
        for (int k = 0; k < per; k++) {
            float c = fmaf(alpha, g[i + k], m[i + k] * beta1);
            b |= (uint32_t)(even ? c >= 0.0f : c > 0.0f) << (k * bits);
            nf |= nonfinite(g[i + k]);
        }
        *o++ = (uint8_t)b;
    }
    *out = o;
    *bad |= nf;
    return i;
}

#ifdef __AVX2__
#include <immintrin.h>
/* 1-bit lanes, 8 elements per byte by one compare + movemask (same values as blocks()). */
static int64_t blocks1_avx2(const float *m, const float *g, int64_t i, int64_t n, float beta1, float alpha,
                            int even, uint8_t **out, uint32_t *bad)
{
    const __m256 b1 = _mm256_set1_ps(beta1), a = _mm256_set1_ps(alpha), z = _mm256_setzero_ps();
    __m256 nf = z;  /* g - g is +0 for finite g, NaN for NaN/Inf: OR-ed bits stay 0 iff all finite */
    uint8_t *o = *out;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 c = _mm256_fmadd_ps(a, gv, _mm256_mul_ps(_mm256_loadu_ps(m + i), b1));
        __m256 s = even ? _mm256_cmp_ps(c, z, _CMP_GE_OQ) : _mm256_cmp_ps(c, z, _CMP_GT_OQ);
        *o++ = (uint8_t)_mm256_movemask_ps(s);
        nf = _mm256_or_ps(nf, _mm256_sub_ps(gv, gv));
    }
    *out = o;
    *bad |= !_mm256_testz_si256(_mm256_castps_si256(nf), _mm256_castps_si256(nf));
    return i;
}
#endif

/* One tensor's update, as torch's mul_(decay); add_(u, alpha=-lr); mul_(beta2); add_(g, alpha=alpha2). */
typedef struct {
    float *p, *m;
    const float *g;
    float decay, neg_lr, beta2, alpha2;
    int64_t has_decay, n;
} lc_tensor;

static inline lc_tensor tensor_at(int64_t t, float *const *ps, float *const *ms, const float *const *gs,
                                  const int64_t *sizes, const int64_t *has_decays, const float *decays,
                                  const float *neg_lrs, const float *beta2s, const float *alpha2s)
{
    lc_tensor x = {ps[t], ms[t], gs[t], decays[t], neg_lrs[t], beta2s[t], alpha2s[t], has_decays[t], sizes[t]};
    return x;
}

static inline void update1(const lc_tensor *x, int64_t i, float u)
{
    float pv = x->has_decay ? x->p[i] * x->decay : x->p[i];
    x->p[i] = fmaf(x->neg_lr, u, pv);
    x->m[i] = fmaf(x->alpha2, x->g[i], x->m[i] * x->beta2);
}

#ifdef __AVX2__
static inline void update8(const lc_tensor *x, int64_t i, __m256 u)  /* elements i .. i+7 */
{
    __m256 pv = _mm256_loadu_ps(x->p + i);
    if (x->has_decay) pv = _mm256_mul_ps(pv, _mm256_set1_ps(x->decay));
    _mm256_storeu_ps(x->p + i, _mm256_fmadd_ps(_mm256_set1_ps(x->neg_lr), u, pv));
    __m256 mv = _mm256_mul_ps(_mm256_loadu_ps(x->m + i), _mm256_set1_ps(x->beta2));
    _mm256_storeu_ps(x->m + i, _mm256_fmadd_ps(_mm256_set1_ps(x->alpha2), _mm256_loadu_ps(x->g + i), mv));
}
#endif
#define LC_TENSOR(t) tensor_at(t, ps, ms, gs, sizes, has_decays, decays, neg_lrs, beta2s, alpha2s)

/* c = fmaf(alpha, g, m * beta1): torch's mul(m, beta1).add_(g, alpha=alpha) on CPU.
   mode 0: lanes of `bits` bits holding 1 when c >= 0 (even step) / c > 0 (odd step);
   mode 1: int8 sign(c); mode 2: c itself (fp32). The tensors are streamed as one concatenation. Returns 1 when
   any gradient element is NaN or +-Inf (the finite check, folded into this read), else 0. */
int64_t lc_encode(int64_t ntensors, const float *const *ms, const float *const *gs, const int64_t *sizes,
               const float *beta1s, const float *alphas, int64_t mode, int64_t bits, int64_t even, uint8_t *out)
{
    uint32_t bad = 0;
    if (mode == 2) {
        float *o = (float *)out;
        for (int64_t t = 0; t < ntensors; t++) {
            const float *m = ms[t], *g = gs[t];
            const float beta1 = beta1s[t], alpha = alphas[t];
            int64_t n = sizes[t];
            uint32_t nf = 0;
            for (int64_t i = 0; i < n; i++) {
                o[i] = fmaf(alpha, g[i], m[i] * beta1);
                nf |= nonfinite(g[i]);
            }
            bad |= nf;
            o += n;
        }
        return bad;
    }
    if (mode == 1) {
        int8_t *o = (int8_t *)out;
        for (int64_t t = 0; t < ntensors; t++) {
            const float *m = ms[t], *g = gs[t];
            const float beta1 = beta1s[t], alpha = alphas[t];
            int64_t n = sizes[t];
            for (int64_t i = 0; i < n; i++) {
                float c = fmaf(alpha, g[i], m[i] * beta1);
                o[i] = (int8_t)((c > 0.0f) - (c < 0.0f));
                bad |= nonfinite(g[i]);
            }
            o += n;
        }
        return bad;
    }
    uint32_t acc = 0;
    int64_t shift = 0;
    for (int64_t t = 0; t < ntensors; t++) {
        const float *m = ms[t], *g = gs[t];
        const float beta1 = beta1s[t], alpha = alphas[t];
        int64_t n = sizes[t], i = 0;
        while (i < n && shift != 0) {  /* finish the byte the previous tensor started */
            float c = fmaf(alpha, g[i], m[i] * beta1);
            acc |= (uint32_t)(even ? c >= 0.0f : c > 0.0f) << shift;
            bad |= nonfinite(g[i]);
            i++;
            shift += bits;
            if (shift == 8) { *out++ = (uint8_t)acc; acc = 0; shift = 0; }
        }
#ifdef __AVX2__
        if (bits == 1) i = blocks1_avx2(m, g, i, n, beta1, alpha, (int)even, &out, &bad);
#endif
        if (bits == 1 && even) i = blocks(m, g, i, n, beta1, alpha, 1, 1, &out, &bad);
        else if (bits == 1) i = blocks(m, g, i, n, beta1, alpha, 1, 0, &out, &bad);
        else if (bits == 2 && even) i = blocks(m, g, i, n, beta1, alpha, 2, 1, &out, &bad);
        else if (bits == 2) i = blocks(m, g, i, n, beta1, alpha, 2, 0, &out, &bad);
        else if (bits == 4 && even) i = blocks(m, g, i, n, beta1, alpha, 4, 1, &out, &bad);
        else if (bits == 4) i = blocks(m, g, i, n, beta1, alpha, 4, 0, &out, &bad);
        else if (even) i = blocks(m, g, i, n, beta1, alpha, 8, 1, &out, &bad);
        else i = blocks(m, g, i, n, beta1, alpha, 8, 0, &out, &bad);
        for (; i < n; i++) {  /* a partial byte, continued by the next tensor */
            float c = fmaf(alpha, g[i], m[i] * beta1);
            acc |= (uint32_t)(even ? c >= 0.0f : c > 0.0f) << shift;
            bad |= nonfinite(g[i]);
            shift += bits;
            if (shift == 8) { *out++ = (uint8_t)acc; acc = 0; shift = 0; }
        }
    }
    if (shift != 0) *out = (uint8_t)acc;
    return bad;
}

/* q + s for one element: y = c * mult clamped to [-s, s], then rounded half to even by
   the 1.5 * 2^23 trick (exact for |y| < 2^22; plain adds, so it vectorizes). Clamping
   first changes nothing: s is an integer and rounding is monotone. */
static inline uint32_t lane_value(float c, float mult, float s)
{
    const float magic = 12582912.0f;
    float y = c * mult;
    y = y < -s ? -s : (y > s ? s : y);
    y = (y + magic) - magic;
    return (uint32_t)(int32_t)(y + s);
}

static inline __attribute__((always_inline)) void
quantize_lanes(const float *c, int64_t n, float mult, float s, const int bits, uint8_t *out)
{
    const int per = 8 / bits;
    int64_t i = 0;
    for (; i + per <= n; i += per) {
        uint32_t b = 0;
        for (int k = 0; k < per; k++) b |= lane_value(c[i + k], mult, s) << (k * bits);
        *out++ = (uint8_t)b;
    }
    if (i < n) {
        uint32_t b = 0;
        for (int k = 0; i + k < n; k++) b |= lane_value(c[i + k], mult, s) << (k * bits);
        *out = (uint8_t)b;
    }
}

/* Lanes of `bits` bits (2, 4, 8) holding q + levels, q = clamp(round_half_even(c * mult),
   -levels, levels): torch.round(c * mult).clamp_(-s, s) + s of lioncub.quantize, element by
   element (mult is the float32 torch makes of the Python scalar). mult 0: q = 0 (c finite). */
void lc_quantize_lanes(const float *c, int64_t n, float mult, int64_t levels, int64_t bits, uint8_t *out)
{
    const float s = (float)levels;
    if (bits == 8) quantize_lanes(c, n, mult, s, 8, out);
    else if (bits == 4) quantize_lanes(c, n, mult, s, 4, out);
    else quantize_lanes(c, n, mult, s, 2, out);
}

/* p <- p*decay (if has_decay); p <- fmaf(neg_lr, u, p); m <- fmaf(alpha2, g, m*beta2):
   torch's mul_(decay); add_(u, alpha=-lr); mul_(beta2); add_(g, alpha=alpha2). */
void lc_apply(int64_t ntensors, float *const *ps, float *const *ms, const float *const *gs,
              const int64_t *sizes, const int8_t *u, const int64_t *has_decays, const float *decays,
              const float *neg_lrs, const float *beta2s, const float *alpha2s)
{
    for (int64_t t = 0; t < ntensors; t++) {
        const lc_tensor x = LC_TENSOR(t);
        for (int64_t i = 0; i < x.n; i++) update1(&x, i, (float)u[i]);
        u += x.n;
    }
}

/* lc_apply with u read from packed bits (element j = bit j of the stream): u = pos - neg,
   or, without neg, u = 2*pos - 1 (the 1-bit vote: every element is +1 or -1). */
void lc_apply_bits(int64_t ntensors, float *const *ps, float *const *ms, const float *const *gs,
                   const int64_t *sizes, const uint8_t *pos, const uint8_t *neg, const int64_t *has_decays,
                   const float *decays, const float *neg_lrs, const float *beta2s, const float *alpha2s)
{
    int64_t j = 0;  /* element index in the bit stream */
    for (int64_t t = 0; t < ntensors; t++) {
        const lc_tensor x = LC_TENSOR(t);
        int64_t i = 0;
        while (i < x.n) {
#ifdef __AVX2__
            if ((j & 7) == 0 && i + 8 <= x.n) {  /* whole bytes: 8 elements at once */
                const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
                const __m256 one = _mm256_set1_ps(1.0f);
                for (; i + 8 <= x.n; i += 8, j += 8) {
                    __m256i pb = _mm256_and_si256(_mm256_set1_epi32(pos[j >> 3]), sel);
                    __m256 u = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(pb, sel)), one);
                    if (neg) {
                        __m256i nb = _mm256_and_si256(_mm256_set1_epi32(neg[j >> 3]), sel);
                        u = _mm256_sub_ps(u, _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(nb, sel)), one));
                    } else {
                        u = _mm256_sub_ps(_mm256_add_ps(u, u), one);
                    }
                    update8(&x, i, u);
                }
                continue;
            }
#endif
            int pb = (pos[j >> 3] >> (j & 7)) & 1;
            update1(&x, i, neg ? (float)(pb - ((neg[j >> 3] >> (j & 7)) & 1)) : (float)(2 * pb - 1));
            i++;
            j++;
        }
    }
}

/* lc_apply with u from w-bit lane sums k (element j = lane j of the stream, w = 2, 4, 8):
   u = (k > above) - (k < below), as lioncub.kernels.vote_lanes decides. */
void lc_apply_lanes(int64_t ntensors, float *const *ps, float *const *ms, const float *const *gs,
                    const int64_t *sizes, const uint8_t *lanes, int64_t bits, int64_t above, int64_t below,
                    const int64_t *has_decays, const float *decays, const float *neg_lrs, const float *beta2s,
                    const float *alpha2s)
{
    const int64_t per = 8 / bits, mask = (1 << bits) - 1;
    int64_t j = 0;  /* element index in the lane stream */
    for (int64_t t = 0; t < ntensors; t++) {
        const lc_tensor x = LC_TENSOR(t);
        int64_t i = 0;
        while (i < x.n) {
#ifdef __AVX2__
            if ((j & 7) == 0 && i + 8 <= x.n) {  /* 8 elements = `bits` whole bytes */
                const __m256i shifts = bits == 2 ? _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)
                                                 : _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
                const __m256i vmask = _mm256_set1_epi32((int)mask), hi = _mm256_set1_epi32((int)above);
                const __m256i lo = _mm256_set1_epi32((int)below);
                const __m256 one = _mm256_set1_ps(1.0f);
                for (; i + 8 <= x.n; i += 8, j += 8) {
                    const uint8_t *src = lanes + j * bits / 8;
                    __m256i k;
                    if (bits == 8) {
                        k = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
                    } else {
                        uint32_t word = 0;
                        memcpy(&word, src, (size_t)bits);
                        k = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), vmask);
                    }
                    __m256 gt = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, hi)), one);
                    __m256 lt = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(lo, k)), one);
                    update8(&x, i, _mm256_sub_ps(gt, lt));
                }
                continue;
            }
#endif
            int64_t k = (lanes[j / per] >> ((j % per) * bits)) & mask;
            update1(&x, i, (float)((k > above) - (k < below)));
            i++;
            j++;
        }
    }
}
"""
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
def _lib() -> Optional[ctypes.CDLL]:
    if os.environ.get("LIONCUB_FUSED", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + cc + _cpu_key()).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"lioncub_fused_{key}.so")
    if not os.path.exists(path):
        try:
            os.makedirs(_cache_dir(), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=_cache_dir()) as d:  # ranks may build at once:
                src, tmp = os.path.join(d, "fused.c"), os.path.join(d, "fused.so")  # build apart,
                with open(src, "w") as f:
                    f.write(_SOURCE)
                subprocess.run([cc, *_FLAGS, "-o", tmp, src, "-lm"], check=True, capture_output=True, timeout=120)
                os.replace(tmp, path)  # then move in atomically
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
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
    return lib


def available() -> bool:
    """True when the compiled loops are in use (else the torch path runs)."""
    return _lib() is not None


def usable(*tensor_lists: list[Tensor]) -> bool:
    """The loops take contiguous fp32 CPU tensors only (anything else: the torch path)."""
    return available() and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                               for ts in tensor_lists for t in ts)


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
           bits: int, step: int, signs: bool = False) -> bool:
    """This rank's part of the message for ``c = β1·m + (1-β1)·g`` of the tensors in
    order, written into the uint8 ``out``: ``bits``-wide lanes (1, 2, 4, 8) of ``c ≥ 0``
    (even ``step``) / ``c > 0`` (odd), as :func:`lioncub.kernels.sign_bits` +
    :func:`~lioncub.kernels.pack_bytes`; or, with ``signs``, one int8 ``sign(c)`` per element.
    ``beta1``, ``maximize``: one value, or one per tensor. Call only when :func:`usable`.

    Returns whether every gradient element is finite (no NaN, no ±Inf): the check of
    :func:`lioncub.guard.grads_finite`, made during the same read of ``g``."""
    k, n = len(exp_avgs), sum(t.numel() for t in exp_avgs)
    need = n if signs else -(-n * bits // 8)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != need:
        raise ValueError(f"out must be a contiguous uint8 tensor of {need} bytes, got {out.dtype} {tuple(out.shape)}")
    return _encode(exp_avgs, grads, beta1, maximize, out, mode=1 if signs else 0, bits=bits, step=step)


def _encode(exp_avgs, grads, beta1, maximize, out: Tensor, *, mode: int, bits: int, step: int) -> bool:
    k = len(exp_avgs)
    b1 = list(_per_tensor(beta1, k, ctypes.c_double))
    mx = list(_per_tensor(maximize, k, ctypes.c_bool))
    alphas = [-(1.0 - b) if x else 1.0 - b for b, x in zip(b1, mx)]  # as lion.interpolate
    return not _lib().lc_encode(k, _ptrs(exp_avgs), _ptrs(grads), _sizes(exp_avgs), _per_tensor(b1, k),
                                _per_tensor(alphas, k), mode, bits, 1 if step % 2 == 0 else 0, out.data_ptr())


def interpolate(exp_avgs: list[Tensor], grads: list[Tensor], beta1, maximize, out: Tensor) -> bool:
    """``c = β1·m + (1-β1)·g`` of the tensors in order into the flat fp32 ``out``, as
    :func:`lioncub.lion.interpolate` computes it (bit for bit), in one pass; returns whether
    every gradient element is finite. Call only when :func:`usable`."""
    k, n = len(exp_avgs), sum(t.numel() for t in exp_avgs)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != n:
        raise ValueError(f"out must be a contiguous fp32 tensor of {n} elements, got {out.dtype} {tuple(out.shape)}")
    return _encode(exp_avgs, grads, beta1, maximize, out, mode=2, bits=32, step=0)


def quantize_lanes(c: Tensor, mult: float, levels: int, bits: int, out: Tensor) -> None:
    """``bits``-wide lanes (2, 4, 8) of ``q + levels``, ``q = round(c·mult)`` clamped to
    ``[-levels, levels]`` (half to even), into the uint8 ``out``: what
    ``quantize._scaled`` + :func:`lioncub.kernels.pack_bytes` make of the flat fp32 ``c``,
    in one pass. ``mult``: ``levels / norm``, or 0 for an all-zero code."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
    if not isinstance(levels, int) or not 1 <= levels or 2 * levels >= 1 << bits:  # q + levels fits a lane
        raise ValueError(f"levels must be in [1, {((1 << bits) - 1) // 2}] for {bits}-bit lanes, got {levels!r}")
    n = c.numel()
    need = -(-n * bits // 8)
    if c.dtype != torch.float32 or not c.is_contiguous() or c.device.type != "cpu":
        raise ValueError(f"c must be a contiguous fp32 CPU tensor, got {c.dtype} on {c.device}")
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != need:
        raise ValueError(f"out must be a contiguous uint8 tensor of {need} bytes, got {out.dtype} {tuple(out.shape)}")
    _lib().lc_quantize_lanes(c.data_ptr(), n, mult, levels, bits, out.data_ptr())


def apply(params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], u: Tensor, *, lr,
          beta2, weight_decay, maximize=False) -> None:
    """In place, from the int8 votes ``u`` (the tensors' elements in order): the same
    as :func:`lioncub.lion.apply_update_` with ``u`` as float. Hyper-parameters: one
    value, or one per tensor. Call only when :func:`usable`."""
    n = sum(t.numel() for t in params)
    if u.dtype != torch.int8 or not u.is_contiguous() or u.numel() != n:
        raise ValueError(f"u must be a contiguous int8 tensor of {n} elements, got {u.dtype} {tuple(u.shape)}")
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
    _lib().lc_apply_bits(len(params), _ptrs(params), _ptrs(exp_avgs), _ptrs(grads), _sizes(params), pos.data_ptr(),
                         None if neg is None else neg.data_ptr(),
                         *_update_args(len(params), lr, beta2, weight_decay, maximize))


def apply_lanes(params: list[Tensor], exp_avgs: list[Tensor], grads: list[Tensor], lanes: Tensor, bits: int,
                above: int, below: int, *, lr, beta2, weight_decay, maximize=False) -> None:
    """:func:`apply` with ``u = (k > above) − (k < below)`` read from the ``bits``-wide lane
    sums ``k`` of ``lanes`` (2, 4 or 8 bits; element ``j`` = lane ``j``), the ``pbit`` vote
    of :func:`lioncub.kernels.vote_lanes` without its int8 pass. Call only when :func:`usable`."""
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
    nbytes = -(-sum(t.numel() for t in params) * bits // 8)
    if lanes.dtype != torch.uint8 or not lanes.is_contiguous() or lanes.numel() < nbytes:
        raise ValueError(f"lanes must be a contiguous uint8 tensor of >= {nbytes} bytes, "
                         f"got {lanes.dtype} {tuple(lanes.shape)}")
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
