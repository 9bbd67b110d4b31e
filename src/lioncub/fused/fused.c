/* The fused CPU loops of lioncub.fused (see its docstring): compiled on first use with
   `cc -O3 -march=native -ffp-contract=off -fno-fast-math -fPIC -shared`, called through
   ctypes. Every loop repeats torch's CPU arithmetic operation by operation, so results
   equal the torch path bit for bit (tests/test_fused.py). */
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
    if (mode != 0) {  /* one output element per element: int8 sign(c) (mode 1), c (mode 2) */
        int8_t *signs = (int8_t *)out;
        float *values = (float *)out;
        for (int64_t t = 0; t < ntensors; t++) {
            const float *m = ms[t], *g = gs[t];
            const float beta1 = beta1s[t], alpha = alphas[t];
            int64_t n = sizes[t];
            uint32_t nf = 0;
            for (int64_t i = 0; i < n; i++) {  /* the mode test is hoisted (loop unswitching) */
                float c = fmaf(alpha, g[i], m[i] * beta1);
                if (mode == 2) values[i] = c;
                else signs[i] = (int8_t)((c > 0.0f) - (c < 0.0f));
                nf |= nonfinite(g[i]);
            }
            bad |= nf;
            signs += n;
            values += n;
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
   u = (k > above) - (k < below), as lioncub.wire.kernels.vote_lanes decides. */
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
