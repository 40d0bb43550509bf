/* What the kernels share: exp, silu, softplus written out (Cephes' expf polynomial; log1p through atanh's
 * series) so the loops vectorise without -ffast-math, and as AVX2 intrinsics on 8 at once (exp on 16 with
 * AVX-512); which vector instructions the CPU has (SUBQUAD_AVX2, SUBQUAD_AVX512, SUBQUAD_VNNI512); a thread's share
 * of a range, the short convolution's step, the blocks' norm. Included by each kernel; its text is part of every
 * kernel's build key (kernels/__init__.py). */

#ifndef SUBQUAD_KERNELS_COMMON_H
#define SUBQUAD_KERNELS_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float exp_f(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;        /* round(x / ln 2) */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;                                                  /* ln 2 = C1 - C2 */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float silu_f(float x) { return x / (1.0f + exp_f(-x)); }

static inline float softplus_f(float x) {         /* torch's softplus: x past 20, else log(1 + e^x) */
    float y = exp_f(x > 0.0f ? -x : x);           /* e^-|x| in (0, 1] */
    float s = y / (2.0f + y), s2 = s * s;         /* log1p(y) = 2 atanh(y / (2 + y)), s <= 1/3 */
    float l = 2.0f * s * (1.0f + s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9
                                                          + s2 * (1.0f / 11 + s2 * (1.0f / 13)))))));
    float v = (x > 0.0f ? x : 0.0f) + l;
    return x > 20.0f ? x : v;
}

/* The same functions on 8 floats at once where the CPU has AVX2 and FMA (gcc leaves the scalar forms' loops
 * unvectorised where they hold a branch or sit beside another inner loop), and over arrays either way. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SUBQUAD_AVX2 1

static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 big = _mm256_set1_ps(12582912.0f);
    __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), big), big);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline __m256 silu8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

static inline __m256 softplus8(__m256 x) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 y = exp8(_mm256_min_ps(x, _mm256_sub_ps(zero, x)));                     /* e^-|x| */
    __m256 s = _mm256_div_ps(y, _mm256_add_ps(_mm256_set1_ps(2.0f), y)), s2 = _mm256_mul_ps(s, s);
    __m256 t = _mm256_set1_ps(1.0f / 13);
    t = _mm256_fmadd_ps(t, s2, _mm256_set1_ps(1.0f / 11));
    t = _mm256_fmadd_ps(t, s2, _mm256_set1_ps(1.0f / 9));
    t = _mm256_fmadd_ps(t, s2, _mm256_set1_ps(1.0f / 7));
    t = _mm256_fmadd_ps(t, s2, _mm256_set1_ps(1.0f / 5));
    t = _mm256_fmadd_ps(t, s2, _mm256_set1_ps(1.0f / 3));
    t = _mm256_fmadd_ps(t, s2, _mm256_set1_ps(1.0f));
    __m256 v = _mm256_add_ps(_mm256_max_ps(x, zero), _mm256_mul_ps(_mm256_add_ps(s, s), t));
    /* x past 20, and NaN as it came (unordered: min and max above would have turned it into a number) */
    return _mm256_blendv_ps(v, x, _mm256_cmp_ps(x, _mm256_set1_ps(20.0f), _CMP_NLE_UQ));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
#define SUBQUAD_AVX2 0
#endif

/* exp on 16 floats at once where the CPU has AVX-512 (exp8's steps, twice as wide). */
#if SUBQUAD_AVX2 && defined(__AVX512F__)
#define SUBQUAD_AVX512 1

static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 big = _mm512_set1_ps(12582912.0f);
    __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), big), big);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#else
#define SUBQUAD_AVX512 0
#endif

/* 512-bit integer dot products (vpdpbusd: 64 unsigned x signed byte products summed into 16 int32 in one
 * instruction) where the CPU has AVX-512 VNNI (Intel from Ice Lake and Sapphire Rapids; AMD from Zen 4). */
#if SUBQUAD_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SUBQUAD_VNNI512 1
#else
#define SUBQUAD_VNNI512 0
#endif

/* Sapphire Rapids' tiles (AMX-INT8): qgemv.c's int8_amx_gemv. */
#if SUBQUAD_VNNI512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SUBQUAD_AMX 1
#else
#define SUBQUAD_AMX 0
#endif

/* bfloat16 pairs summed into float32 (vdpbf16ps: Sapphire Rapids, Zen 4), and their tiles (AMX-BF16: Sapphire
 * Rapids): qgemv.c's bf16_gemv. */
#if SUBQUAD_AVX512 && defined(__AVX512BF16__)
#define SUBQUAD_BF16 1
#else
#define SUBQUAD_BF16 0
#endif
#if SUBQUAD_BF16 && SUBQUAD_AMX && defined(__AMX_BF16__)
#define SUBQUAD_AMX_BF16 1
#else
#define SUBQUAD_AMX_BF16 0
#endif

static inline void silu_n(float *v, int64_t n) {                 /* v = silu(v) */
    int64_t i = 0;
#if SUBQUAD_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(v + i, silu8(_mm256_loadu_ps(v + i)));
#endif
    for (; i < n; i++)
        v[i] = silu_f(v[i]);
}

static inline void softplus_n(float *v, int64_t n) {             /* v = softplus(v) */
    int64_t i = 0;
#if SUBQUAD_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(v + i, softplus8(_mm256_loadu_ps(v + i)));
#endif
    for (; i < n; i++)
        v[i] = softplus_f(v[i]);
}

static inline void mul_silu_n(float *y, const float *z, int64_t n) {   /* y *= silu(z) */
    int64_t i = 0;
#if SUBQUAD_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), silu8(_mm256_loadu_ps(z + i))));
#endif
    for (; i < n; i++)
        y[i] *= silu_f(z[i]);
}

static inline void span(int64_t n, int parts, int i, int64_t *a, int64_t *b) {   /* i-th of parts, by 16s */
    int64_t blocks = (n + 15) / 16;
    *a = blocks * i / parts * 16;
    *b = blocks * (i + 1) / parts * 16;
    if (*a > n) *a = n;
    if (*b > n) *b = n;
}

/* A float passed as its bits in a 64-bit word (the stacked blocks' argument tables, mamba_block.c). */
static inline float f_bits(int64_t v) {
    const int32_t bits = (int32_t)v;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A double passed as its bits in a 64-bit word (layer_stack.c's attention rows: the rotary base). */
static inline double d_bits(int64_t v) {
    double f;
    memcpy(&f, &v, 8);
    return f;
}

/* One token of the depthwise causal convolution, channels [c0, c1): out = silu(bias + sum_k w[:, k] [st; x]_k),
 * and the new tail so = [st[1:]; x]. x (C,), st and so (K-1, C), w (C, K), bias (C,) or NULL. wt: NULL, or
 * the span's taps column by column (conv_columns: wt[k (c1 - c0) + c - c0] = w[c K + k]), so the channels are
 * summed in vectors - the same sums in the same order per channel, so the same bits (a 16-row step of
 * mamba-130m's shape took ~10% of its Mamba rows' time in the scalar loop over w's strided taps). */
static inline void conv_step(const float *x, const float *st, float *so, const float *w, const float *wt,
                             const float *bias, int64_t C, int64_t K, int64_t c0, int64_t c1, float *out) {
    if (wt) {
        const int64_t n = c1 - c0;
        float *o = out + c0;
        for (int64_t i = 0; i < n; i++)
            o[i] = bias ? bias[c0 + i] : 0.0f;
        for (int64_t k = 0; k < K - 1; k++) {
            const float *wk = wt + k * n, *sk = st + k * C + c0;
            for (int64_t i = 0; i < n; i++)
                o[i] += wk[i] * sk[i];
        }
        const float *wl = wt + (K - 1) * n, *xc = x + c0;
        for (int64_t i = 0; i < n; i++)
            o[i] += wl[i] * xc[i];
    } else
        for (int64_t c = c0; c < c1; c++) {
            float acc = bias ? bias[c] : 0.0f;
            for (int64_t k = 0; k < K - 1; k++)
                acc += w[c * K + k] * st[k * C + c];
            acc += w[c * K + K - 1] * x[c];
            out[c] = acc;
        }
    silu_n(out + c0, c1 - c0);
    for (int64_t k = 0; k + 1 < K - 1; k++)
        memcpy(so + k * C + c0, st + (k + 1) * C + c0, (c1 - c0) * sizeof(float));
    if (K > 1)
        memcpy(so + (K - 2) * C + c0, x + c0, (c1 - c0) * sizeof(float));
}

/* conv_step's wt for channels [c0, c1) of w (C, K), in a buffer it allocates (NULL below CONV_COLUMN_ROWS rows,
 * where the copy would cost about what it saves): free() it after. */
#define CONV_COLUMN_ROWS 4
static inline float *conv_columns(int64_t B, const float *w, int64_t K, int64_t c0, int64_t c1) {
    const int64_t n = c1 - c0;
    if (B < CONV_COLUMN_ROWS || n <= 0)
        return NULL;
    float *wt = malloc(n * K * sizeof(float));
    if (wt)
        for (int64_t i = 0; i < n; i++)
            for (int64_t k = 0; k < K; k++)
                wt[k * n + i] = w[(c0 + i) * K + k];
    return wt;
}

/* The blocks' RMSNorm over B rows of width d: x = h / sqrt(mean(h^2) + eps) * w (one thread: d is small). */
static inline void rms_rows(int64_t B, int64_t d, const float *h, const float *w, float eps, float *x) {
    for (int64_t b = 0; b < B; b++) {
        const float *hb = h + b * d;
        float ss = 0.0f;
        for (int64_t i = 0; i < d; i++)
            ss += hb[i] * hb[i];
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
        for (int64_t i = 0; i < d; i++)
            x[b * d + i] = hb[i] * r * w[i];
    }
}

#endif
