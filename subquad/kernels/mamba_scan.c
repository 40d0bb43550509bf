/* Mamba's selective scan over whole prompts, its token loop in one call (ops/mamba/fused_scan.py states the
 * math and shapes; ops/mamba/recurrent.py, the recurrent form, is the reference). float32.
 *
 *   h_t = exp(dt_t A) * h_{t-1} + dt_t x_t B_t      per channel d: h (N,), A[d] (N,) <= 0, dt_t[d], x_t[d]
 *   y_t = (C_t . h_t + Dp x_t) * silu(z_t)          Dp and z optional
 *   dt_t = softplus(dt_t + bias) where asked        (mamba_ssm's delta_bias and delta_softplus: one softplus a
 *                                                    channel and token here instead of a pass over dt before)
 *
 * x, dt, z (Bz, T, D) and B, C (Bz, T, N) are read through their batch and token strides (unit stride within a
 * token: in_proj's and x_proj's outputs are split without copies); y (Bz, T, D) and the states (Bz, D, N) are
 * contiguous, and so are the states after every token where hs is given (a speculative verification's).
 * Packed prompts (seg, Bz + 1 cumulative lengths, or NULL): row b is tokens seg[b] .. seg[b + 1] of the one row
 * of x, dt, z, B, C, y and hs, from state row b of h0 into row b of hT, so a packed batch needs no copies.
 * Work items are (row, CB channels): their N x CB states and decays transposed into the item's own
 * arrays (L1), each token's update 8 channels at a time, so no sum runs across a vector. Rows and channel
 * blocks split across one OpenMP team (the runtime torch loaded), handed out one at a time: packed prompts of
 * unequal lengths are unequal items. */

#include "common.h"

#define CB 32
#define PF_T 4        /* tokens ahead to prefetch */

static void scan_item(int64_t T, int64_t N, int64_t nc, const float *x, int64_t xs, const float *dt, int64_t ds,
                      const float *bias, int softplus, const float *z, int64_t zs, const float *Bm, int64_t bs,
                      const float *Cm, int64_t cs, const float *A, const float *Dp, const float *h0, float *y,
                      int64_t ys, float *hT, float *hs, int64_t hss, float *At, float *h)
{
    for (int64_t n = 0; n < N; n++)                              /* transposed: (N, CB), pad lanes 0 */
        for (int64_t c = 0; c < CB; c++) {
            At[n * CB + c] = c < nc ? A[c * N + n] : 0.0f;
            h[n * CB + c] = c < nc && h0 ? h0[c * N + n] : 0.0f;
        }
    float dv[CB], dx[CB], yv[CB];
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * xs, *dtt = dt + t * ds, *bt = Bm + t * bs, *ct = Cm + t * cs;
        if (t + PF_T < T) {                                      /* a later token's rows: strided, so no    */
            __builtin_prefetch(xt + PF_T * xs);                  /* hardware prefetcher follows them        */
            __builtin_prefetch(dtt + PF_T * ds);
            __builtin_prefetch(bt + PF_T * bs);
            __builtin_prefetch(ct + PF_T * cs);
            if (z)
                __builtin_prefetch(z + (t + PF_T) * zs);
        }
        for (int64_t c = 0; c < CB; c++)
            dv[c] = c < nc ? dtt[c] : 0.0f;
        if (bias)
            for (int64_t c = 0; c < nc; c++)
                dv[c] += bias[c];
        if (softplus)
            softplus_n(dv, nc);
        for (int64_t c = 0; c < CB; c++) {
            dx[c] = c < nc ? dv[c] * xt[c] : 0.0f;
            yv[c] = 0.0f;
        }
#if SUBQUAD_AVX2
        __m256 d0 = _mm256_loadu_ps(dv), d1 = _mm256_loadu_ps(dv + 8), d2 = _mm256_loadu_ps(dv + 16),
               d3 = _mm256_loadu_ps(dv + 24);
        __m256 u0 = _mm256_loadu_ps(dx), u1 = _mm256_loadu_ps(dx + 8), u2 = _mm256_loadu_ps(dx + 16),
               u3 = _mm256_loadu_ps(dx + 24);
        __m256 y0 = _mm256_setzero_ps(), y1 = y0, y2 = y0, y3 = y0;
        for (int64_t n = 0; n < N; n++) {
            const __m256 bn = _mm256_set1_ps(bt[n]), cn = _mm256_set1_ps(ct[n]);
            float *hn = h + n * CB;
            const float *an = At + n * CB;
#define STEP(k, dk, uk, yk)                                                                                   \
            {                                                                                                 \
                __m256 hv = _mm256_fmadd_ps(exp8(_mm256_mul_ps(dk, _mm256_loadu_ps(an + 8 * k))),              \
                                            _mm256_loadu_ps(hn + 8 * k), _mm256_mul_ps(uk, bn));              \
                _mm256_storeu_ps(hn + 8 * k, hv);                                                             \
                yk = _mm256_fmadd_ps(cn, hv, yk);                                                             \
            }
            STEP(0, d0, u0, y0) STEP(1, d1, u1, y1) STEP(2, d2, u2, y2) STEP(3, d3, u3, y3)
#undef STEP
        }
        _mm256_storeu_ps(yv, y0);
        _mm256_storeu_ps(yv + 8, y1);
        _mm256_storeu_ps(yv + 16, y2);
        _mm256_storeu_ps(yv + 24, y3);
#else
        for (int64_t n = 0; n < N; n++) {
            const float bn = bt[n], cn = ct[n];
            float *hn = h + n * CB;
            const float *an = At + n * CB;
            for (int64_t c = 0; c < CB; c++) {
                hn[c] = exp_f(dv[c] * an[c]) * hn[c] + dx[c] * bn;
                yv[c] += cn * hn[c];
            }
        }
#endif
        float *yt = y + t * ys;
        const float *zt = z ? z + t * zs : NULL;
        for (int64_t c = 0; c < nc; c++) {
            float v = yv[c] + (Dp ? Dp[c] * xt[c] : 0.0f);
            yt[c] = zt ? v * silu_f(zt[c]) : v;
        }
        if (hs)                                                  /* the state after this token too */
            for (int64_t c = 0; c < nc; c++)
                for (int64_t n = 0; n < N; n++)
                    hs[t * hss + c * N + n] = h[n * CB + c];
    }
    for (int64_t c = 0; c < nc; c++)
        for (int64_t n = 0; n < N; n++)
            hT[c * N + n] = h[n * CB + c];
}

void mamba_scan(int64_t Bz, int64_t T, int64_t D, int64_t N, int threads,
                const float *x, int64_t x_b, int64_t x_t, const float *dt, int64_t dt_b, int64_t dt_t,
                const float *bias, int softplus,                      /* dt's bias (D,) or NULL; softplus 0/1 */
                const float *z, int64_t z_b, int64_t z_t,             /* z: NULL for no gate */
                const float *Bm, int64_t b_b, int64_t b_t, const float *Cm, int64_t c_b, int64_t c_t,
                const float *A, const float *Dp,                      /* (D, N) contiguous; (D,) or NULL */
                const float *h0,                                      /* (Bz, D, N) or NULL (zeros) */
                float *y, float *hT,                                  /* (Bz, T, D), (Bz, D, N) */
                float *hs,                                            /* (Bz, T, D, N) or NULL */
                const int64_t *seg)                                   /* (Bz + 1,) packed rows, or NULL */
{
    const int64_t blocks = (D + CB - 1) / CB, items = Bz * blocks;
#pragma omp parallel num_threads(threads)
    {
        float *At = malloc(sizeof(float) * 2 * N * CB), *h = At + N * CB;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = it / blocks, c0 = it % blocks * CB, nc = D - c0 < CB ? D - c0 : CB;
            /* where row b's tokens start: in its own row, or at seg[b] of the one packed row */
            const int64_t t0 = seg ? seg[b] : 0, Tb = seg ? seg[b + 1] - seg[b] : T, r = seg ? 0 : b;
            scan_item(Tb, N, nc, x + r * x_b + t0 * x_t + c0, x_t, dt + r * dt_b + t0 * dt_t + c0, dt_t,
                      bias ? bias + c0 : NULL, softplus, z ? z + r * z_b + t0 * z_t + c0 : NULL, z_t,
                      Bm + r * b_b + t0 * b_t, b_t, Cm + r * c_b + t0 * c_t, c_t, A + c0 * N, Dp ? Dp + c0 : NULL,
                      h0 ? h0 + (b * D + c0) * N : NULL, y + (r * T + t0) * D + c0, D, hT + (b * D + c0) * N,
                      hs ? hs + ((r * T + t0) * D + c0) * N : NULL, D * N, At, h);
        }
        free(At);
    }
}
