/* What the kernels share: exp, silu, softplus written out (Cephes' expf polynomial; log1p through atanh's
 * series) so the loops vectorise without -ffast-math, a thread's share of a range, and the short convolution's
 * step. Included by each kernel; its text is part of every kernel's build key (kernels/__init__.py). */

#ifndef SUBQUAD_KERNELS_COMMON_H
#define SUBQUAD_KERNELS_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
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

static inline void span(int64_t n, int parts, int i, int64_t *a, int64_t *b) {   /* i-th of parts, by 16s */
    int64_t blocks = (n + 15) / 16;
    *a = blocks * i / parts * 16;
    *b = blocks * (i + 1) / parts * 16;
    if (*a > n) *a = n;
    if (*b > n) *b = n;
}

/* One token of the depthwise causal convolution, channels [c0, c1): out = silu(bias + sum_k w[:, k] [st; x]_k),
 * and the new tail so = [st[1:]; x]. x (C,), st and so (K-1, C), w (C, K), bias (C,) or NULL. */
static inline void conv_step(const float *x, const float *st, float *so, const float *w, const float *bias,
                             int64_t C, int64_t K, int64_t c0, int64_t c1, float *out) {
    for (int64_t c = c0; c < c1; c++) {
        float acc = bias ? bias[c] : 0.0f;
        for (int64_t k = 0; k < K - 1; k++)
            acc += w[c * K + k] * st[k * C + c];
        acc += w[c * K + K - 1] * x[c];
        out[c] = silu_f(acc);
    }
    for (int64_t k = 0; k + 1 < K - 1; k++)
        memcpy(so + k * C + c0, st + (k + 1) * C + c0, (c1 - c0) * sizeof(float));
    if (K > 1)
        memcpy(so + (K - 2) * C + c0, x + c0, (c1 - c0) * sizeof(float));
}

#endif
