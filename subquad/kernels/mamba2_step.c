/* One decoding step of a Mamba-2 layer between in_proj and out_proj, fused (subquad/ops/decay/fused_step.py
 * states the math and shapes; layers/mamba2.py's PyTorch step is the reference). float32, row-major.
 *
 *   z, xBC, dt = split(in, [Dn, Dn + 2GN, H])
 *   x, B, C    = silu(conv_b + sum_k conv_w[:, k] [conv_state; xBC]_k)
 *   dt         = clamp(softplus(dt + dt_bias), lo, hi)
 *   S'_h       = exp(-dt_h exp(A_log_h)) S_h + dt_h B_g x_h^T        S_h (N, P), g = h / (H / G)
 *   y_h        = C_g^T S'_h + Dp_h x_h;   g = y * silu(z);   out = rmsnorm(g) * w per norm group (or g)
 *   (defer: out = g * w, and inv = 1 / rms(g) per group written apart, for the caller to apply after out_proj)
 *
 * One OpenMP team of the runtime torch loaded: channels split for the convolution, heads for the scan, norm
 * groups for the norm; two barriers. exp written out in common.h (no -ffast-math). */

#include "common.h"

#if SUBQUAD_AVX2
/* The state update of one head, 64 columns at a time (the first P - P % 64): S'[n, p] = dA S[n, p] + dt B[n] x[p],
 * y[p] += sum_n C[n] S'[n, p], row after row of S (read in address order: the state of a 16-row batch is ~12 MB a
 * layer, read from memory), y's 64 columns in registers. S' is written with streaming stores where its rows are
 * whole lines: it is read back only at the next token, from memory, so it skips the read a cached store does
 * first (a third of the state's traffic) - unless ``may_stream`` is 0 (a state the next row reads at once:
 * mamba2_rows' chained rows). Returns the columns done. */
static int64_t scan_lines(int64_t N, int64_t P, float dA, float dt, const float *Bv, const float *Cv,
                          const float *x, const float *s, float *so, float *y, int may_stream) {
    const int stream = may_stream && (uintptr_t)so % 64 == 0 && P % 16 == 0;
    const int64_t done = P - P % 64;
    const __m256 da = _mm256_set1_ps(dA);
    for (int64_t p0 = 0; p0 < done; p0 += 64) {
        __m256 a[8];
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_loadu_ps(y + p0 + 8 * i);
        for (int64_t n = 0; n < N; n++) {
            const __m256 db = _mm256_set1_ps(dt * Bv[n]), cn = _mm256_set1_ps(Cv[n]);
            const float *sn = s + n * P + p0;
            float *on = so + n * P + p0;
            for (int i = 0; i < 8; i++) {
                const __m256 v = _mm256_fmadd_ps(da, _mm256_loadu_ps(sn + 8 * i),
                                                 _mm256_mul_ps(db, _mm256_loadu_ps(x + p0 + 8 * i)));
                if (stream)
                    _mm256_stream_ps(on + 8 * i, v);
                else
                    _mm256_storeu_ps(on + 8 * i, v);
                a[i] = _mm256_fmadd_ps(cn, v, a[i]);
            }
        }
        for (int i = 0; i < 8; i++)
            _mm256_storeu_ps(y + p0 + 8 * i, a[i]);
    }
    if (stream)
        _mm_sfence();                                   /* the streamed lines visible before the team's barrier */
    return done;
}
#endif

/* mamba2_step over B rows, of which rows b >= Bs continue row b - Bs (their conv state and S are the ones row
 * b - Bs leaves in conv_out and S_out): T tokens of Bs sequences, rows t-major (mamba2_block.c's
 * mamba2_block_tokens). A channel's (a head's) rows run in order on one thread, so row b - Bs is done before row
 * b reads it. Bs = B: every row on its own (mamba2_step). */
static void mamba2_rows(int64_t B, int64_t Bs, int64_t Dn, int64_t G, int64_t N, int64_t H, int64_t P, int64_t K,
                        int threads, const float *in, int64_t in_row, const float *conv_state, const float *conv_w,
                        const float *conv_b, const float *dt_bias, const float *A_log, const float *Dp, float dt_lo,
                        float dt_hi, const float *S, const float *norm_w, int64_t norm_group, float eps, int defer,
                        float *inv_out, float *out, float *conv_out, float *S_out, float *scratch)
{
    const int64_t C = Dn + 2 * G * N, heads_per_group = H / G, groups = Dn / norm_group;
    float *xbc = scratch;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t c0, c1;
        span(C, nt, t, &c0, &c1);
        float *wt = conv_columns(B, conv_w, K, c0, c1);
        for (int64_t b = 0; b < B; b++)                     /* the convolution, its new tail */
            conv_step(in + b * in_row + Dn, b < Bs ? conv_state + b * (K - 1) * C : conv_out + (b - Bs) * (K - 1) * C,
                      conv_out + b * (K - 1) * C, conv_w, wt, conv_b, C, K, c0, c1, xbc + b * C);
        free(wt);
#pragma omp barrier
        const int64_t h0 = H * t / nt, h1 = H * (t + 1) / nt;
        for (int64_t b = 0; b < B; b++) {                   /* the scan and the gate, head by head */
            const float *row = in + b * in_row, *xb = xbc + b * C;
            for (int64_t hh = h0; hh < h1; hh++) {
                const int64_t g = hh / heads_per_group;
                const float *x = xb + hh * P, *Bv = xb + Dn + g * N, *Cv = xb + Dn + G * N + g * N;
                const float *z = row + hh * P;
                float dt = softplus_f(row[Dn + C + hh] + dt_bias[hh]);
                dt = dt < dt_lo ? dt_lo : (dt > dt_hi ? dt_hi : dt);
                const float dA = exp_f(-dt * exp_f(A_log[hh]));
                const float *s = b < Bs ? S + ((b * H + hh) * N) * P : S_out + (((b - Bs) * H + hh) * N) * P;
                float *so = S_out + ((b * H + hh) * N) * P, *y = out + b * Dn + hh * P;
                for (int64_t p = 0; p < P; p++)
                    y[p] = Dp[hh] * x[p];
                int64_t p0 = 0;
#if SUBQUAD_AVX2
                p0 = scan_lines(N, P, dA, dt, Bv, Cv, x, s, so, y, b + Bs >= B);
#endif
                for (int64_t n = 0; n < N && p0 < P; n++) {
                    const float db = dt * Bv[n], cn = Cv[n];
                    const float *sn = s + n * P;
                    float *on = so + n * P;
                    for (int64_t p = p0; p < P; p++) {
                        float v = dA * sn[p] + db * x[p];
                        on[p] = v;
                        y[p] += cn * v;
                    }
                }
                mul_silu_n(y, z, P);
            }
        }
        if (norm_w) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t bg = 0; bg < B * groups; bg++) {   /* rmsnorm per group of norm_group channels */
                float *y = out + (bg / groups) * Dn + (bg % groups) * norm_group;
                const float *w = norm_w + (bg % groups) * norm_group;
                float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
                for (int64_t i = 0; i < norm_group; i++)
                    ss += y[i] * y[i];
                const float inv = 1.0f / sqrtf(ss / (float)norm_group + eps);
                inv_out[bg] = inv;
                const float f = defer ? 1.0f : inv;
                for (int64_t i = 0; i < norm_group; i++)
                    y[i] = y[i] * f * w[i];
            }
        }
    }
}

void mamba2_step(int64_t B, int64_t Dn, int64_t G, int64_t N, int64_t H, int64_t P, int64_t K, int threads,
                 const float *in, int64_t in_row,                      /* (B, 2 Dn + 2 G N + H) */
                 const float *conv_state, const float *conv_w,         /* (B, K-1, Dn + 2GN); (Dn + 2GN, K) */
                 const float *conv_b,                                  /* (Dn + 2GN,) or NULL */
                 const float *dt_bias, const float *A_log, const float *Dp,  /* (H,) each */
                 float dt_lo, float dt_hi,
                 const float *S,                                       /* (B, H, N, P) */
                 const float *norm_w, int64_t norm_group, float eps,   /* (Dn,) or NULL: no norm */
                 int defer, float *inv_out,                            /* (B, Dn / norm_group) */
                 float *out, float *conv_out, float *S_out,            /* (B, Dn), (B, K-1, Dn + 2GN), like S */
                 float *scratch)                                       /* B (Dn + 2GN) floats */
{
    mamba2_rows(B, B, Dn, G, N, H, P, K, threads, in, in_row, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, dt_lo,
                dt_hi, S, norm_w, norm_group, eps, defer, inv_out, out, conv_out, S_out, scratch);
}
