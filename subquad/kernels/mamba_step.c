/* One decoding step of a Mamba-1 layer between its two large products, fused (subquad/ops/mamba/fused_step.py
 * states the math and shapes; layers/mamba.py's PyTorch step is the reference). float32, row-major unless said.
 *
 *   u        = silu(conv_b + sum_k conv_w[:, k] * [conv_state, x][k])     the short convolution's new output
 *   dt, B, C = wx u                                                       x_proj, (R + 2N) rows
 *   (Zamba: ``heads`` groups of D / heads channels, each with its own wx (R + 2N, D / heads) over its own
 *   channels, so its own dt, B and C; wdt then row-major, (D, R) = (heads, D / heads, R))
 *   dt       = softplus(wdt dt + bdt)                                     dt_proj, strided (either layout)
 *   h'       = exp(-dt exp(A_log)) h + dt B u;   y = (C . h' + Dp u) * silu(z)
 *
 * One OpenMP team (the runtime torch itself loaded, so no second pool): channels split across threads for the
 * convolution and the scan, x_proj's rows for the product; two barriers. exp and log1p are written out in
 * common.h so the loops vectorise without -ffast-math, whose start-up code would set flush-to-zero for the whole
 * process. */

#include "common.h"

#define SCAN_N 256                                          /* state sizes whose decays a channel keeps */

#if SUBQUAD_AVX512
/* w (n,) against R rows of u (R <= 4; a constant where inlined): out[i] = w . u[i]. Per row four 16-lane chains
 * over k in steps of 64, then 16 at a time on the first, the chains added pairwise, the lanes summed, a scalar
 * tail: the same order for every R, so a row's sum does not depend on the rows beside it. */
static inline __attribute__((always_inline)) void dot_rows(const int R, const float *w, const float *const u[4],
                                                           int64_t n, float out[4]) {
    __m512 a[4][4];
    for (int i = 0; i < R; i++)
        for (int c = 0; c < 4; c++)
            a[i][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= n; k += 64)
        for (int c = 0; c < 4; c++) {
            const __m512 wv = _mm512_loadu_ps(w + k + 16 * c);
            for (int i = 0; i < R; i++)
                a[i][c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(u[i] + k + 16 * c), a[i][c]);
        }
    for (; k + 16 <= n; k += 16) {
        const __m512 wv = _mm512_loadu_ps(w + k);
        for (int i = 0; i < R; i++)
            a[i][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(u[i] + k), a[i][0]);
    }
    for (int i = 0; i < R; i++) {
        out[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[i][0], a[i][1]), _mm512_add_ps(a[i][2], a[i][3])));
        for (int64_t kk = k; kk < n; kk++)
            out[i] += w[kk] * u[i][kk];
    }
}

static inline void dot_rows4(const float *w, const float *const u[4], int64_t n, float out[4]) {
    dot_rows(4, w, u, n, out);
}

static inline float dot_row1(const float *w, const float *u, int64_t n) {
    const float *const one[4] = {u, u, u, u};
    float out[4];
    dot_rows(1, w, one, n, out);
    return out[0];
}
#else
/* w (n,) against four rows of u: out[i] = w . u[i], k in steps of 8 (then a scalar tail). */
static inline void dot_rows4(const float *w, const float *const u[4], int64_t n, float out[4]) {
    int64_t k = 0;
    for (int i = 0; i < 4; i++)
        out[i] = 0.0f;
#if SUBQUAD_AVX2
    __m256 a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        const __m256 wv = _mm256_loadu_ps(w + k);
        for (int i = 0; i < 4; i++)
            a[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(u[i] + k), a[i]);
    }
    for (int i = 0; i < 4; i++)
        out[i] = hsum8(a[i]);
#endif
    for (; k < n; k++)
        for (int i = 0; i < 4; i++)
            out[i] += w[k] * u[i][k];
}

/* w . u for one row of u: four chains over k in steps of 32 (a single chain waits on each fma in turn). */
static inline float dot_row1(const float *w, const float *u, int64_t n) {
    int64_t k = 0;
    float out = 0.0f;
#if SUBQUAD_AVX2
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (; k + 32 <= n; k += 32)
        for (int i = 0; i < 4; i++)
            a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8 * i), _mm256_loadu_ps(u + k + 8 * i), a[i]);
    for (; k + 8 <= n; k += 8)
        a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(u + k), a[0]);
    out = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
#endif
    for (; k < n; k++)
        out += w[k] * u[k];
    return out;
}
#endif

#if SUBQUAD_AVX512
/* A layer's new state from this size on is written with streaming stores (scan16): at 16 rows of mamba-130m's
 * shape (1.5 MB a layer) the stores' reads for ownership were a quarter of the scan's samples, and the next step
 * reads the state from memory anyway; a few rows' states stay in the cache for it (benchmarks/RESULTS.md). */
#define STREAM_BYTES (1 << 20)

/* The sums of 16 vectors' lanes, one lane each: out[j] = sum_i v[j][i], in an order fixed per lane (pairs of
 * lanes two apart, then one apart, then the 128-bit quarters) - lane j's sum reads only v[j], so a vector of
 * zeros in a slot changes no other lane's bits. */
static inline __m512 lane_sums16(__m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), z = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, z)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, z)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* mamba_rows' scan for N = 16, channels [c0, c1) in blocks of 16 (the last one shorter): per row, each
 * channel's h' = exp(-dt a) h + dt u B in one vector, its C . h' summed with its block's other 15 by
 * lane_sums16 instead of one horizontal sum per channel (the scan's latency at 16 rows), y = sum + Dp u. A
 * channel's bits do not depend on the block it is in, nor on c0 and c1 (the threads). */
static void scan16(int64_t B, int64_t Bs, int64_t D, int64_t N, int64_t hd, int64_t J, int64_t R, int64_t c0,
                   int64_t c1, const float *A_log, const float *Dp, const float *p, int64_t heads, const float *dts,
                   const float *u, const float *h, float *h_out, float *y) {
    const int big = B * D * N * (int64_t)sizeof(float) >= STREAM_BYTES;
    for (int64_t cb = c0; cb < c1; cb += 16) {
        const int64_t nc = c1 - cb < 16 ? c1 - cb : 16;
        const __mmask16 mask = (__mmask16)((1u << nc) - 1);
        __m512 a[16];                                       /* exp(A_log[c]), as the per-channel loop takes it */
        int64_t head[16];                                   /* where channel c's dt, B, C lie in a row of p */
        for (int64_t j = 0; j < nc; j++) {
            a[j] = exp16(_mm512_loadu_ps(A_log + (cb + j) * N));
            head[j] = (cb + j) / hd * J;
        }
        for (int64_t b = 0; b < B; b++) {
            const float *pr = p + b * heads * J;
            const int stream = big && b + Bs >= B && (uintptr_t)h_out % 64 == 0;
            __m512 acc[16];
            for (int j = 0; j < 16; j++)
                acc[j] = _mm512_setzero_ps();
            for (int64_t j = 0; j < nc; j++) {
                const int64_t c = cb + j;
                const float d = dts[b * D + c], du = d * u[b * D + c];
                const float *Bv = pr + head[j] + R, *Cv = Bv + N;
                const float *hc = b < Bs ? h + (b * D + c) * N : h_out + ((b - Bs) * D + c) * N;
                _mm_prefetch((const char *)(hc + 16 * N), _MM_HINT_T0);      /* this row's next block */
                const __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-d), a[j]));
                const __m512 hn = _mm512_fmadd_ps(e, _mm512_loadu_ps(hc),
                                                  _mm512_mul_ps(_mm512_set1_ps(du), _mm512_loadu_ps(Bv)));
                float *ho = h_out + (b * D + c) * N;
                if (stream)
                    _mm512_stream_ps(ho, hn);
                else
                    _mm512_storeu_ps(ho, hn);
                acc[j] = _mm512_mul_ps(_mm512_loadu_ps(Cv), hn);
            }
            const __m512 uv = _mm512_maskz_loadu_ps(mask, u + b * D + cb);
            _mm512_mask_storeu_ps(y + b * D + cb, mask,
                                  _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, Dp + cb), uv, lane_sums16(acc)));
        }
    }
    _mm_sfence();
}
#endif

#if SUBQUAD_AVX2
/* dt_proj column-major for 32 channels and NR <= 4 rows (a constant where inlined): dt[j][0..31] (row stride ld,
 * holding dt_bias) += sum_r w[r][0..31] pr[j][r], rows' p at pr + j lp; each column read once for the NR rows,
 * each row's sums the same fma chain over r as alone (0.95x the 16-row layer step's time: RESULTS.md). */
static inline __attribute__((always_inline)) void dt_columns(const int NR, int64_t R, const float *w,
                                                             int64_t w_s1, const float *pr, int64_t lp, float *dt,
                                                             int64_t ld) {
    __m256 a[4][4];
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < 4; i++)
            a[j][i] = _mm256_loadu_ps(dt + j * ld + 8 * i);
    for (int64_t r = 0; r < R; r++) {
        __m256 wv[4];
        for (int i = 0; i < 4; i++)
            wv[i] = _mm256_loadu_ps(w + r * w_s1 + 8 * i);
        for (int j = 0; j < NR; j++) {
            const __m256 prr = _mm256_set1_ps(pr[j * lp + r]);
            for (int i = 0; i < 4; i++)
                a[j][i] = _mm256_fmadd_ps(wv[i], prr, a[j][i]);
        }
    }
    for (int j = 0; j < NR; j++)
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(dt + j * ld + 8 * i, a[j][i]);
}
#endif

/* mamba_step over B rows, of which rows b >= Bs continue row b - Bs: their conv and ssm states are the ones row
 * b - Bs leaves (in conv_out, h_out), not conv_state and h - T tokens of Bs sequences, rows t-major, in one pass
 * (mamba_block.c's mamba_block_tokens). A channel's rows run in order on one thread, so row b - Bs is done
 * before row b reads it; the convolution, x_proj and dt of every row are computed first, as they depend on the
 * inputs only. Bs = B: every row on its own (mamba_step). */
static void mamba_rows(int64_t B, int64_t Bs, int64_t D, int64_t N, int64_t R, int64_t K, int64_t heads, int threads,
                       const float *xz, int64_t xz_row, const float *conv_state, const float *conv_w,
                       const float *conv_b, const float *wx, const float *wdt, int64_t wdt_s0, int64_t wdt_s1,
                       const float *bdt, const float *A_log, const float *Dp, const float *h, float *y,
                       float *conv_out, float *h_out, float *scratch)
{
    const int64_t J = R + 2 * N, hd = D / heads;
    float *u = scratch, *dts = scratch + B * D, *p = scratch + 2 * B * D;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t c0, c1, j0, j1;
        span(D, nt, t, &c0, &c1);
        float *wt = conv_columns(B, conv_w, K, c0, c1);
        for (int64_t b = 0; b < B; b++)                     /* the convolution, its new tail */
            conv_step(xz + b * xz_row, b < Bs ? conv_state + b * (K - 1) * D : conv_out + (b - Bs) * (K - 1) * D,
                      conv_out + b * (K - 1) * D, conv_w, wt, conv_b, D, K, c0, c1, u + b * D);
        free(wt);
#pragma omp barrier
        j0 = heads * J * t / nt;                            /* x_proj: rows of wx (all heads') by thread */
        j1 = heads * J * (t + 1) / nt;
        for (int64_t j = j0; j < j1; j++) {                 /* four rows of u per pass: four chains, w read once */
            const float *w = wx + j * hd;
            const int64_t hh = j / J;
            int64_t b0 = 0;
            for (; b0 + 4 <= B || (b0 < B && B - b0 > 1); b0 += 4) {
                const float *ub[4];
                for (int i = 0; i < 4; i++)                 /* past the last row: row b0 again, not stored */
                    ub[i] = u + (b0 + i < B ? b0 + i : b0) * D + hh * hd;
                float acc[4];
                dot_rows4(w, ub, hd, acc);
                for (int i = 0; i < 4 && b0 + i < B; i++)
                    p[(b0 + i) * heads * J + j] = acc[i];
            }
            if (b0 < B)                                     /* a last row alone: one row's dot, not four */
                p[b0 * heads * J + j] = dot_row1(w, u + b0 * D + hh * hd, hd);
        }
#pragma omp barrier
        const int col_major = wdt_s0 == 1 && heads == 1;    /* decode_layout's dt_proj: a column per dt rank */
        int64_t cv = c0;                                    /* channels [c0, cv): done in 32-channel blocks */
        for (int64_t b = 0; b < B; b++)
            for (int64_t c = c0; c < c1; c++)
                dts[b * D + c] = bdt[c];
#if SUBQUAD_AVX2
        if (col_major)                                      /* 32 channels' sums in registers over every rank, */
            for (; cv + 32 <= c1; cv += 32)                 /* up to four rows a pass: the columns read once */
                for (int64_t b0 = 0; b0 < B; b0 += 4) {
#define DTC(nr) dt_columns(nr, R, wdt + cv, wdt_s1, p + b0 * heads * J, heads * J, dts + b0 * D + cv, D)
                    switch (B - b0) { case 1: DTC(1); break; case 2: DTC(2); break; case 3: DTC(3); break;
                                      default: DTC(4); }                     /* nr a constant: registers */
#undef DTC
                }
#endif
        for (int64_t b = 0; b < B; b++) {                   /* dt_proj, softplus: dt (B, D) */
            const float *pr = p + b * heads * J;            /* head hh's dt, B, C at pr + hh J */
            float *dt = dts + b * D;
            if (col_major) {
                for (int64_t r = 0; r < R; r++) {           /* the channels past the last 32 */
                    const float *w = wdt + r * wdt_s1;
                    const float prr = pr[r];
                    for (int64_t cc = cv; cc < c1; cc++)
                        dt[cc] += w[cc] * prr;
                }
            } else if (wdt_s1 == 1) {                       /* row-major (nn.Linear's): a dot per channel */
                for (int64_t c = c0; c < c1; c++) {
                    const float *w = wdt + c * wdt_s0, *pb = pr + (c / hd) * J;
                    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t r = 0; r < R; r++)
                        acc += w[r] * pb[r];
                    dt[c] += acc;
                }
            } else {
                for (int64_t c = c0; c < c1; c++) {
                    const float *w = wdt + c * wdt_s0, *pb = pr + (c / hd) * J;
                    float acc = 0.0f;
                    for (int64_t r = 0; r < R; r++)
                        acc += w[r * wdt_s1] * pb[r];
                    dt[c] += acc;
                }
            }
            softplus_n(dt + c0, c1 - c0);
        }
#if SUBQUAD_AVX512
        if (N == 16)                                        /* Mamba-1's N: 16 channels at a time */
            scan16(B, Bs, D, N, hd, J, R, c0, c1, A_log, Dp, p, heads, dts, u, h, h_out, y);
        else
#endif
        for (int64_t c = c0; c < c1; c++) {                 /* the scan: a channel's decays once for every row */
            const float *al = A_log + c * N;
            float a[SCAN_N];                                /* exp(A_log[c]) where N fits, else per row below */
            const int keep = N <= SCAN_N;
            int64_t n8 = 0;                                 /* each exp as the loop below would take it */
#if SUBQUAD_AVX2
            for (; keep && n8 + 8 <= N; n8 += 8)
                _mm256_storeu_ps(a + n8, exp8(_mm256_loadu_ps(al + n8)));
#endif
            for (int64_t n = n8; keep && n < N; n++)
                a[n] = exp_f(al[n]);
            for (int64_t b = 0; b < B; b++) {
                const float *pr = p + b * heads * J;
                const float d = dts[b * D + c], du = d * u[b * D + c];
                const float *Bv = pr + (c / hd) * J + R, *Cv = Bv + N;
                const float *hc = b < Bs ? h + (b * D + c) * N : h_out + ((b - Bs) * D + c) * N;
                float *ho = h_out + (b * D + c) * N;
                float acc = 0.0f;
                int64_t n = 0;
#if SUBQUAD_AVX512
                __m512 aw = _mm512_setzero_ps();            /* 16 at a time: Mamba-1's N = 16 in one */
                for (; n + 16 <= N; n += 16) {
                    const __m512 an = keep ? _mm512_loadu_ps(a + n) : exp16(_mm512_loadu_ps(al + n));
                    const __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-d), an));
                    const __m512 hn = _mm512_fmadd_ps(e, _mm512_loadu_ps(hc + n),
                                                      _mm512_mul_ps(_mm512_set1_ps(du), _mm512_loadu_ps(Bv + n)));
                    _mm512_storeu_ps(ho + n, hn);
                    aw = _mm512_fmadd_ps(_mm512_loadu_ps(Cv + n), hn, aw);
                }
                acc = _mm512_reduce_add_ps(aw);
#endif
#if SUBQUAD_AVX2
                __m256 av = _mm256_setzero_ps();
                const __m256 md = _mm256_set1_ps(-d), duv = _mm256_set1_ps(du);
                const int64_t n_avx2 = n;
                for (; n + 8 <= N; n += 8) {
                    const __m256 an = keep ? _mm256_loadu_ps(a + n) : exp8(_mm256_loadu_ps(al + n));
                    const __m256 e = exp8(_mm256_mul_ps(md, an));
                    const __m256 hn = _mm256_fmadd_ps(e, _mm256_loadu_ps(hc + n),
                                                      _mm256_mul_ps(duv, _mm256_loadu_ps(Bv + n)));
                    _mm256_storeu_ps(ho + n, hn);
                    av = _mm256_fmadd_ps(_mm256_loadu_ps(Cv + n), hn, av);
                }
                if (n > n_avx2)                             /* (N a multiple of 16 with AVX-512: none left) */
                    acc += hsum8(av);
#endif
                for (; n < N; n++) {
                    float hn = exp_f(-d * (keep ? a[n] : exp_f(al[n]))) * hc[n] + du * Bv[n];
                    ho[n] = hn;
                    acc += Cv[n] * hn;
                }
                y[b * D + c] = acc + Dp[c] * u[b * D + c];
            }
        }
        for (int64_t b = 0; b < B; b++)
            mul_silu_n(y + b * D + c0, xz + b * xz_row + D + c0, c1 - c0);
    }
}

void mamba_step(int64_t B, int64_t D, int64_t N, int64_t R, int64_t K, int64_t heads, int threads,
                const float *xz, int64_t xz_row,                       /* (B, 2D): x, then z; row stride */
                const float *conv_state, const float *conv_w,          /* (B, K-1, D); (D, K) */
                const float *conv_b,                                   /* (D,) or NULL */
                const float *wx,                                       /* (heads, R + 2N, D / heads) */
                const float *wdt, int64_t wdt_s0, int64_t wdt_s1,      /* (D, R), strides */
                const float *bdt, const float *A_log, const float *Dp, /* (D,), (D, N), (D,) */
                const float *h,                                        /* (B, D, N) */
                float *y, float *conv_out, float *h_out,               /* (B, D), (B, K-1, D), (B, D, N) */
                float *scratch)                                        /* B (2D + heads (R + 2N)) floats */
{
    mamba_rows(B, B, D, N, R, K, heads, threads, xz, xz_row, conv_state, conv_w, conv_b, wx, wdt, wdt_s0, wdt_s1,
               bdt, A_log, Dp, h, y, conv_out, h_out, scratch);
}
