/* Weights times a few float32 rows (a decoding step's products), reading each weight byte once.
 *
 * f32_gemv:   y[m, n] = sum_k w[n, k] x[m, k] + bias[n]      w (N, K) float32 row-major, x (M, K) with row
 *             stride ldx, y (M, N); f32_gemv_cm the same for w stored column-major (wt = w^T (K, N) row-major:
 *             ``models.decode.decode_layout``'s small wide matrices), 16 rows of x per pass over the weights;
 *             from TILE_ROWS rows on f32_gemv computes tiles of outer products (below).
 * int8_gemv:  y[m, n] = sum_g scale[n, g] (sum_{k in g} q[n, k] x[m, k]) - offset[n, g] (sum_{k in g} x[m, k])
 *                       + bias[n]
 *             q (N, K) int8 row-major, scale (and offset, or NULL) (N, G) float32, G groups of K / G inputs
 *             (G = 1: one scale per output channel), x (M, K) with row stride ldx, y (M, N).
 * int4_gemv:  y[m, n] = sum_g s[g, n] (sum_{k in g} c[n, k] x~[m, k]) + (z[g, n] - 8 s[g, n]) (sum_{k in g} x~[m, k])
 *                       + bias[n],  x~ = x rounded per block of 32 (below; K a multiple of 32)
 *             c in [0, 15] packed as torch's _weight_int4pack_mm_for_cpu packs them (quant.py's LAYOUTS): rows in
 *             blocks of BN, each block k-major (K, BN / 2) bytes; in a full block byte j holds rows j (low nibble)
 *             and j + BN / 2 (high) when split, rows 2j and 2j + 1 otherwise, as it always does in a last,
 *             shorter block;
 *             sz (G, Np, 2) bfloat16 scale and zero per group, Np = N rounded up to 16.
 *
 * x stays float32 (no rounding of the activations, unlike fbgemm's 8-bit x and torch's int4 kernel's bfloat16
 * x), sums in float32. Threads split the output rows; each weight row (int8) or row block (int4) is read once
 * for all M rows of x, so M rows cost one pass over the weights. */

#ifndef SUBQUAD_KERNELS_QGEMV_C      /* included by the block kernels, some of them twice (mlp_block.c) */
#define SUBQUAD_KERNELS_QGEMV_C

#include "common.h"

static inline float bf16_f(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Group g's sums of x, per row: xs (M, G). */
static void group_sums(int64_t M, int64_t G, int64_t gs, const float *x, int64_t ldx, float *xs) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0;
            for (int64_t k = g * gs; k < (g + 1) * gs; k++)
                s += x[m * ldx + k];
            xs[m * G + g] = s;
        }
}

/* Four rows of q against one row of x, groups of K / G (a multiple of 16): sum_g scale[r, g] (q_r . x)_g. */
#if SUBQUAD_AVX2
#define SIMD 1

static inline __m256 i8_f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }   /* low 8 bytes */
static inline __m256 u8_f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }


static inline void dot4s(const int8_t *q, int64_t K, const float *x, int64_t G, const float *scale, float out[4]) {
    const int64_t gs = K / G;
    __m256 t[8];
    for (int i = 0; i < 8; i++)
        t[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 a[8];
        for (int i = 0; i < 8; i++)
            a[i] = _mm256_setzero_ps();
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
            const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
            for (int r = 0; r < 4; r++) {
                const __m128i v = _mm_loadu_si128((const __m128i *)(q + r * K + k));
                a[2 * r] = _mm256_fmadd_ps(i8_f(v), x0, a[2 * r]);
                a[2 * r + 1] = _mm256_fmadd_ps(i8_f(_mm_srli_si128(v, 8)), x1, a[2 * r + 1]);
            }
        }
        for (int r = 0; r < 4; r++) {                 /* the group's scale, still as vectors */
            const __m256 s = _mm256_set1_ps(scale[r * G + g]);
            t[2 * r] = _mm256_fmadd_ps(a[2 * r], s, t[2 * r]);
            t[2 * r + 1] = _mm256_fmadd_ps(a[2 * r + 1], s, t[2 * r + 1]);
        }
    }
    for (int r = 0; r < 4; r++)
        out[r] = hsum8(_mm256_add_ps(t[2 * r], t[2 * r + 1]));
}
#else
#define SIMD 0

static inline void dot4s(const int8_t *q, int64_t K, const float *x, int64_t G, const float *scale, float out[4]) {
    const int64_t gs = K / G;
    out[0] = out[1] = out[2] = out[3] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        float a0[16] = {0}, a1[16] = {0}, a2[16] = {0}, a3[16] = {0};
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 16)
            for (int j = 0; j < 16; j++) {
                const float xv = x[k + j];
                a0[j] += (float)q[k + j] * xv;
                a1[j] += (float)q[K + k + j] * xv;
                a2[j] += (float)q[2 * K + k + j] * xv;
                a3[j] += (float)q[3 * K + k + j] * xv;
            }
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (int j = 0; j < 16; j++)
            s0 += a0[j], s1 += a1[j], s2 += a2[j], s3 += a3[j];
        out[0] += scale[g] * s0, out[1] += scale[G + g] * s1, out[2] += scale[2 * G + g] * s2;
        out[3] += scale[3 * G + g] * s3;
    }
}
#endif

static inline float dot1(const int8_t *q, const float *x, int64_t k0, int64_t k1) {
    float a[16] = {0};
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16)
        for (int j = 0; j < 16; j++)
            a[j] += (float)q[k + j] * x[k + j];
    float s = 0;
    for (int j = 0; j < 16; j++)
        s += a[j];
    for (; k < k1; k++)
        s += (float)q[k] * x[k];
    return s;
}

void int8_gemv(int64_t M, int64_t N, int64_t K, int64_t G, int threads, const float *x, int64_t ldx,
               const int8_t *q, const float *scale, const float *offset, const float *bias, float *y,
               float *xs) {                                  /* xs: scratch of M G floats */
    const int64_t gs = K / G;
    if (offset)
        group_sums(M, G, gs, x, ldx, xs);
    const int fast = gs % 16 == 0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n4 = 0; n4 < (N + 3) / 4; n4++) {
        const int64_t n0 = n4 * 4;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * ldx;
            float out[4] = {0, 0, 0, 0};
            if (fast && n0 + 4 <= N)                     /* four rows at once, scaled per group as vectors */
                dot4s(q + n0 * K, K, xm, G, scale + n0 * G, out);
            else
                for (int r = 0; r < 4 && n0 + r < N; r++)
                    for (int64_t g = 0; g < G; g++)
                        out[r] += scale[(n0 + r) * G + g] * dot1(q + (n0 + r) * K, xm, g * gs, (g + 1) * gs);
            if (offset)
                for (int r = 0; r < 4 && n0 + r < N; r++)
                    for (int64_t g = 0; g < G; g++)
                        out[r] -= offset[(n0 + r) * G + g] * xs[m * G + g];
            for (int r = 0; r < 4 && n0 + r < N; r++)
                y[m * N + n0 + r] = out[r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
}

/* int8q_gemv: y[m, n] = scale[n] sum_b d[m, b] (sum_{k in b} q[n, k] c[m, k]) + bias[n]
 * or, with G = K / 32 scales per row (a GGUF file's Q8_0 matrix), sum_b scale[n, b] d[m, b] (q . c)_b + bias[n],
 * which is llama.cpp's own Q8_0 x Q8_0 product (G = 1: one scale per output channel), 
 * with x's rows rounded per block b of 32 inputs to int8 codes c and a float scale d (GGUF's Q8_0: d = max |x| /
 * 127, c = round(127 x / max |x|)), as llama.cpp's Q8_0 and fbgemm's products do (fbgemm: one scale per call):
 * the sums are exact in int32 - AVX2's maddubs multiplies 32 byte pairs into 16-bit pair sums, |q| <= 128 and
 * |c| <= 127 keep them below 2^15 - about half the instructions per weight of widening q to float. q (N, K) int8
 * per output channel, K a multiple of 32; x (M, K) with row stride ldx, y (M, N); xq: scratch of M K bytes, xd:
 * M K / 32 floats. */
static void quantize_q8(int64_t M, int64_t K, const float *x, int64_t ldx, int8_t *xq, float *xd) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + m * ldx + 32 * b;
            int8_t *c = xq + m * K + 32 * b;
#if SIMD
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 f[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                f[i] = _mm256_loadu_ps(v + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[i]));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(f[i], f[i], _CMP_UNORD_Q));
            }
            float mx = hmax8(amax);
            /* max skips a NaN: the block's scale is NaN then, so every sum it enters is (not a finite guess) */
            const float d = _mm256_movemask_ps(nan) ? NAN : mx / 127.0f;
            const __m256 id = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
            __m256i i32[4];
            for (int i = 0; i < 4; i++)
                i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(f[i], id), _MM_FROUND_TO_NEAREST_INT
                                                                                      | _MM_FROUND_NO_EXC));
            /* pack 32 int32 to 32 int8; the packs interleave 128-bit lanes, the permute puts them back in order */
            const __m256i p16 = _mm256_packs_epi32(i32[0], i32[1]), q16 = _mm256_packs_epi32(i32[2], i32[3]);
            const __m256i p8 = _mm256_packs_epi16(p16, q16);
            _mm256_storeu_si256((__m256i *)c, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3,
                                                                                                7)));
#else
            float mx = 0.0f;
            int nan = 0;
            for (int j = 0; j < 32; j++) {
                mx = fabsf(v[j]) > mx ? fabsf(v[j]) : mx;
                nan |= v[j] != v[j];
            }
            const float d = nan ? NAN : mx / 127.0f, id = mx > 0.0f ? 127.0f / mx : 0.0f;
            for (int j = 0; j < 32; j++)
                c[j] = (int8_t)nearbyintf(v[j] * id);
#endif
            xd[m * nb + b] = d;
        }
}

/* One row of q against one row of codes, two blocks at a time: sum_b d[b] (q . c)_b. Reads q in order and
 * prefetches PF_BYTES ahead: with it the loop keeps up with memory, without it it waits on each miss in turn. */
#define PF_BYTES 2048
static inline float q8_dot(const int8_t *q, int64_t nb, const int8_t *c, const float *d, const float *ws) {
#if SIMD
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        _mm_prefetch((const char *)(q + 32 * b + PF_BYTES), _MM_HINT_T0);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(q + 32 * b + 32));
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(c + 32 * b));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(c + 32 * b + 32));
        /* |q| as unsigned bytes times c with q's sign: 16-bit pair sums, then 32-bit ones */
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0)),
                                             ones);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1)),
                                             ones);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(ws ? d[b] * ws[b] : d[b]), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(ws ? d[b + 1] * ws[b + 1] : d[b + 1]), a1);
    }
    if (b < nb) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(c + 32 * b));
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0)),
                                             ones);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(ws ? d[b] * ws[b] : d[b]), a0);
    }
    return hsum8(_mm256_add_ps(a0, a1));
#else
    float s = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t t = 0;
        for (int i = 0; i < 32; i++)
            t += (int32_t)q[32 * b + i] * c[32 * b + i];
        s += (ws ? d[b] * ws[b] : d[b]) * (float)t;
    }
    return s;
#endif
}

#if SUBQUAD_VNNI512
/* With AVX-512 VNNI, int8q_gemv and q4_0_gemv take a weight row 64 bytes at a time (two blocks of Q8_0, four of
 * Q4_0) against up to 4 rows of x at once: one vpdpbusd sums 64 byte products into 16 int32 (four per lane),
 * so a row of x costs about one instruction per 64 weights besides its scaling, and the weights' own work
 * (loading, sums, unpacking nibbles) is shared by the 4 rows. x's codes are laid out once per call:
 *   Q8_0: u = c + 128 (unsigned, as vpdpbusd's first operand must be), and q . c = q . u - 128 sum(q), sum(q)
 *         one more vpdpbusd against ones shared by the rows, -128 sum(q) the accumulator each row starts from;
 *         d16 per pair of blocks [d_b x 8, d_{b+1} x 8] (each lane of the pair's 16 sums its block's scale).
 *   Q4_0: per four blocks their values 0-15 (the nibbles' low halves, 16 bytes a block) then 16-31, so the low
 *         and the high nibbles of one 64-byte load each meet their codes in one vpdpbusd (nibbles unsigned,
 *         codes signed: as they are); o16 carries -8 sum(c) per block in its block's first lane, d16 per block
 *         d_b four times. Integer sums exact; a last pair (Q8_0) or quad (Q4_0) that is not whole takes the
 *         plain loop. */
#define VROWS 4

static inline __m512 bcast16(const float *v, int per) {     /* [v[0] x per, v[1] x per, ...], per 8 or 4 */
    const __m512i idx = per == 8 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                 : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m128 v4 = per == 8 ? _mm_castpd_ps(_mm_load_sd((const double *)v)) : _mm_loadu_ps(v);  /* no more */
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v4));
}

/* R rows of x (u: row r at u + r K, d16 at d16 + r ld16) against one weight row q of nb blocks:
 * out[r] = sum_b ws_b d[r, b] (q . c_r)_b (blocked: ws per block; else 1). */
static inline __attribute__((always_inline)) void q8v_rows(int R, int blocked, const int8_t *q, int64_t nb,
                                                           const uint8_t *u, int64_t K, const float *d16,
                                                           int64_t ld16, const int8_t *c, const float *d,
                                                           const float *ws, float *out) {
    const int64_t np = nb / 2;
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    __m512 acc[2][VROWS];                                  /* even and odd pairs apart: the fma's latency */
    for (int r = 0; r < R; r++)
        acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p += 2)
        for (int h = 0; h < 2 && p + h < np; h++) {
            const int64_t o = 64 * (p + h);
            _mm_prefetch((const char *)(q + o + PF_BYTES), _MM_HINT_T0);
            const __m512i w = _mm512_loadu_si512(q + o);
            const __m512i base = _mm512_sub_epi32(zero, _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, ones, w), 7));
            const __m512 wsv = blocked ? bcast16(ws + 2 * (p + h), 8) : _mm512_setzero_ps();
            for (int r = 0; r < R; r++) {
                const __m512i s = _mm512_dpbusd_epi32(base, _mm512_loadu_si512(u + r * K + o), w);
                const __m512 dv = _mm512_loadu_ps(d16 + r * ld16 + 16 * (p + h));
                acc[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), blocked ? _mm512_mul_ps(dv, wsv) : dv, acc[h][r]);
            }
        }
    for (int r = 0; r < R; r++) {
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]));
        for (int64_t b = 2 * np; b < nb; b++) {             /* an odd last block */
            int32_t t = 0;
            for (int i = 0; i < 32; i++)
                t += (int32_t)q[32 * b + i] * c[r * K + 32 * b + i];
            out[r] += (blocked ? ws[b] : 1.0f) * d[r * nb + b] * (float)t;
        }
    }
}

/* One row of x against two weight rows at once (a decoding step's one row), as q4v_two: out[i] = sum_b ws_i,b d_b
 * (q_i . c)_b (blocked), or the unscaled sum. q1 must follow q0 (q1 = q0 + K): the lines asked for ahead are the
 * pair's 2K bytes in order - two streams 768 bytes apart, each asked for ahead, ran at the speed of none on an AMD
 * EPYC (Zen 4), 1.6x the read bound; in order, at it (benchmarks/RESULTS.md, "Weight rows asked for in order"). */
static inline __attribute__((always_inline)) void q8v_two(int blocked, const int8_t *q0, const int8_t *q1,
                                                          int64_t nb, const uint8_t *u, const float *d16,
                                                          const int8_t *c, const float *d, const float *ws0,
                                                          const float *ws1, float out[2]) {
    const int64_t np = nb / 2;
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    __m512 a[2][2];                                        /* [even / odd pair][row]: q8v_rows' order, its bits */
    a[0][0] = a[0][1] = a[1][0] = a[1][1] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < np; p0 += 2)
        for (int h = 0; h < 2 && p0 + h < np; h++) {
            const int64_t p = p0 + h;
            _mm_prefetch((const char *)(q0 + 128 * p + PF_BYTES), _MM_HINT_T0);     /* q1 = q0 + K: the pair's */
            _mm_prefetch((const char *)(q0 + 128 * p + 64 + PF_BYTES), _MM_HINT_T0);   /* lines in order */
            const __m512i w0 = _mm512_loadu_si512(q0 + 64 * p), w1 = _mm512_loadu_si512(q1 + 64 * p);
            const __m512i x = _mm512_loadu_si512(u + 64 * p);
            const __m512 dv = _mm512_loadu_ps(d16 + 16 * p);
            __m512i s0 = _mm512_sub_epi32(zero, _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, ones, w0), 7));
            __m512i s1 = _mm512_sub_epi32(zero, _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, ones, w1), 7));
            s0 = _mm512_dpbusd_epi32(s0, x, w0);
            s1 = _mm512_dpbusd_epi32(s1, x, w1);
            a[h][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), blocked ? _mm512_mul_ps(dv, bcast16(ws0 + 2 * p, 8)) : dv,
                                      a[h][0]);
            a[h][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), blocked ? _mm512_mul_ps(dv, bcast16(ws1 + 2 * p, 8)) : dv,
                                      a[h][1]);
        }
    out[0] = _mm512_reduce_add_ps(_mm512_add_ps(a[0][0], a[1][0]));
    out[1] = _mm512_reduce_add_ps(_mm512_add_ps(a[0][1], a[1][1]));
    for (int64_t b = 2 * np; b < nb; b++)                   /* an odd last block */
        for (int i = 0; i < 2; i++) {
            const int8_t *qb = (i ? q1 : q0) + 32 * b;
            int32_t t = 0;
            for (int j = 0; j < 32; j++)
                t += (int32_t)qb[j] * c[32 * b + j];
            out[i] += (blocked ? (i ? ws1 : ws0)[b] : 1.0f) * d[b] * (float)t;
        }
}

static void int8q_vnni(int64_t M, int64_t N, int64_t K, int64_t G, int threads, const int8_t *q, const float *scale,
                       const float *bias, float *y, const int8_t *xq, const float *xd) {
    const int64_t nb = K / 32, np = nb / 2;
    uint8_t *u = malloc(M * K + M * np * 16 * sizeof(float));
    float *d16 = (float *)(u + M * K);                       /* K a multiple of 32 */
    for (int64_t i = 0; i < M * K; i++)
        u[i] = (uint8_t)(xq[i] + 128);
    for (int64_t m = 0; m < M; m++)
        for (int64_t p = 0; p < np; p++)
            for (int j = 0; j < 16; j++)
                d16[(m * np + p) * 16 + j] = xd[m * nb + 2 * p + j / 8];
    if (M == 1) {                                           /* weight rows in pairs */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < N / 2; p++) {
            const int64_t n = 2 * p;
            float out[2];
            if (G == 1)
                q8v_two(0, q + n * K, q + (n + 1) * K, nb, u, d16, xq, xd, NULL, NULL, out);
            else
                q8v_two(1, q + n * K, q + (n + 1) * K, nb, u, d16, xq, xd, scale + n * G, scale + (n + 1) * G, out);
            for (int i = 0; i < 2; i++)
                y[n + i] = (G == 1 ? out[i] * scale[n + i] : out[i]) + (bias ? bias[n + i] : 0.0f);
        }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = M == 1 ? N - N % 2 : 0; n < N; n++) {  /* (one row: the odd last weight row) */
        float out[VROWS];
        for (int64_t m0 = 0; m0 < M; m0 += VROWS) {
            const int R = M - m0 < VROWS ? (int)(M - m0) : VROWS;
            const uint8_t *um = u + m0 * K;
            const float *dm = d16 + m0 * np * 16, *ws = scale + n * G;
            const int8_t *cm = xq + m0 * K, *qn = q + n * K;
#define Q8V(r, blk) q8v_rows(r, blk, qn, nb, um, K, dm, np * 16, cm, xd + m0 * nb, ws, out)
            if (G == 1)
                switch (R) { case 1: Q8V(1, 0); break; case 2: Q8V(2, 0); break; case 3: Q8V(3, 0); break;
                             default: Q8V(4, 0); }
            else
                switch (R) { case 1: Q8V(1, 1); break; case 2: Q8V(2, 1); break; case 3: Q8V(3, 1); break;
                             default: Q8V(4, 1); }
#undef Q8V
            for (int r = 0; r < R; r++)
                y[(m0 + r) * N + n] = (G == 1 ? out[r] * scale[n] : out[r]) + (bias ? bias[n] : 0.0f);
        }
    }
    free(u);
}

/* R rows of x (xl: row r's laid-out codes at xl + r K, o16 / d16 at + r ld16) against one row of Q4_0 blocks:
 * out[r] = sum_b ws_b d[r, b] ((u - 8) . c_r)_b. */
static inline __attribute__((always_inline)) void q4v_rows(int R, const uint8_t *q, int64_t nb, const int8_t *xl,
                                                           int64_t K, const int32_t *o16, const float *d16,
                                                           int64_t ld16, const int8_t *c, const float *d,
                                                           const float *ws, float *out) {
    const int64_t nq = nb / 4;
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512 acc[2 * VROWS];                                 /* two per row: even and odd quads */
    for (int r = 0; r < 2 * R; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < nq; t++) {
        _mm_prefetch((const char *)(q + 64 * t + PF_BYTES), _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(q + 64 * t);
        const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        const __m512 wsv = bcast16(ws + 4 * t, 4);
        for (int r = 0; r < R; r++) {
            const int8_t *x = xl + r * K + 128 * t;
            __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(o16 + r * ld16 + 16 * t), lo, _mm512_loadu_si512(x));
            s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(x + 64));
            acc[2 * r + (t & 1)] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(
                _mm512_loadu_ps(d16 + r * ld16 + 16 * t), wsv), acc[2 * r + (t & 1)]);
        }
    }
    for (int r = 0; r < R; r++) {
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * r], acc[2 * r + 1]));
        for (int64_t b = 4 * nq; b < nb; b++) {             /* blocks past the last whole four */
            int32_t t = 0;
            for (int j = 0; j < 16; j++)
                t += ((int32_t)(q[16 * b + j] & 15) - 8) * c[r * K + 32 * b + j]
                     + ((int32_t)(q[16 * b + j] >> 4) - 8) * c[r * K + 32 * b + 16 + j];
            out[r] += d[r * nb + b] * ws[b] * (float)t;
        }
    }
}

/* One row of x against two weight rows at once (a decoding step's one row): x's codes, o16 and d16 loaded once for
 * both, two independent chains; out[i] as q4v_rows gives it for row q_i. q1 must follow q0 (q1 = q0 + K / 2), the
 * lines asked for ahead in order as q8v_two's. */
static inline void q4v_two(const uint8_t *q0, const uint8_t *q1, int64_t nb, const int8_t *xl, const int32_t *o16,
                           const float *d16, const int8_t *c, const float *d, const float *ws0, const float *ws1,
                           float out[2]) {
    const int64_t nq = nb / 4;
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512 a[2][2];                                        /* [even / odd quad][row]: q4v_rows' order, its bits */
    a[0][0] = a[0][1] = a[1][0] = a[1][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < nq; t++) {
        _mm_prefetch((const char *)(q0 + 128 * t + PF_BYTES), _MM_HINT_T0);         /* q1 = q0 + K / 2 */
        _mm_prefetch((const char *)(q0 + 128 * t + 64 + PF_BYTES), _MM_HINT_T0);
        const __m512i xlo = _mm512_loadu_si512(xl + 128 * t), xhi = _mm512_loadu_si512(xl + 128 * t + 64);
        const __m512i o = _mm512_loadu_si512(o16 + 16 * t);
        const __m512 dv = _mm512_loadu_ps(d16 + 16 * t);
        const __m512i r0 = _mm512_loadu_si512(q0 + 64 * t), r1 = _mm512_loadu_si512(q1 + 64 * t);
        __m512i s0 = _mm512_dpbusd_epi32(o, _mm512_and_si512(r0, m4), xlo);
        __m512i s1 = _mm512_dpbusd_epi32(o, _mm512_and_si512(r1, m4), xlo);
        s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(_mm512_srli_epi16(r0, 4), m4), xhi);
        s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(r1, 4), m4), xhi);
        a[t & 1][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(dv, bcast16(ws0 + 4 * t, 4)), a[t & 1][0]);
        a[t & 1][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(dv, bcast16(ws1 + 4 * t, 4)), a[t & 1][1]);
    }
    out[0] = _mm512_reduce_add_ps(_mm512_add_ps(a[0][0], a[1][0]));
    out[1] = _mm512_reduce_add_ps(_mm512_add_ps(a[0][1], a[1][1]));
    for (int64_t b = 4 * nq; b < nb; b++)                   /* blocks past the last whole four */
        for (int i = 0; i < 2; i++) {
            const uint8_t *qb = (i ? q1 : q0) + 16 * b;
            int32_t t = 0;
            for (int j = 0; j < 16; j++)
                t += ((int32_t)(qb[j] & 15) - 8) * c[32 * b + j] + ((int32_t)(qb[j] >> 4) - 8) * c[32 * b + 16 + j];
            out[i] += d[b] * (i ? ws1 : ws0)[b] * (float)t;
        }
}

static void q4_0_vnni(int64_t M, int64_t N, int64_t K, int threads, const uint8_t *q, const float *scale,
                      const float *bias, float *y, const int8_t *xq, const float *xd) {
    const int64_t nb = K / 32, nq = nb / 4;
    int8_t *xl = malloc(M * K + 2 * M * nq * 16 * sizeof(float));
    float *d16 = (float *)(xl + M * K);
    int32_t *o16 = (int32_t *)(d16 + M * nq * 16);
    for (int64_t m = 0; m < M; m++)
        for (int64_t t = 0; t < nq; t++)
            for (int i = 0; i < 4; i++) {
                const int64_t b = 4 * t + i;
                const int8_t *cb = xq + m * K + 32 * b;
                memcpy(xl + m * K + 128 * t + 16 * i, cb, 16);
                memcpy(xl + m * K + 128 * t + 64 + 16 * i, cb + 16, 16);
                int32_t sum = 0;
                for (int j = 0; j < 32; j++)
                    sum += cb[j];
                for (int j = 0; j < 4; j++) {
                    d16[(m * nq + t) * 16 + 4 * i + j] = xd[m * nb + b];
                    o16[(m * nq + t) * 16 + 4 * i + j] = j ? 0 : -8 * sum;
                }
            }
    if (M == 1) {                                           /* weight rows in pairs */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < N / 2; p++) {
            float out[2];
            q4v_two(q + 2 * p * (K / 2), q + (2 * p + 1) * (K / 2), nb, xl, o16, d16, xq, xd, scale + 2 * p * nb,
                    scale + (2 * p + 1) * nb, out);
            for (int i = 0; i < 2; i++)
                y[2 * p + i] = out[i] + (bias ? bias[2 * p + i] : 0.0f);
        }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = M == 1 ? N - N % 2 : 0; n < N; n++) {  /* (one row: the odd last weight row) */
        float out[VROWS];
        for (int64_t m0 = 0; m0 < M; m0 += VROWS) {
            const int R = M - m0 < VROWS ? (int)(M - m0) : VROWS;
#define Q4V(r) q4v_rows(r, q + n * (K / 2), nb, xl + m0 * K, K, o16 + m0 * nq * 16, d16 + m0 * nq * 16, nq * 16, \
                        xq + m0 * K, xd + m0 * nb, scale + n * nb, out)
            switch (R) { case 1: Q4V(1); break; case 2: Q4V(2); break; case 3: Q4V(3); break; default: Q4V(4); }
#undef Q4V
            for (int r = 0; r < R; r++)
                y[(m0 + r) * N + n] = out[r] + (bias ? bias[n] : 0.0f);
        }
    }
    free(xl);
}
#endif

void int8q_gemv(int64_t M, int64_t N, int64_t K, int64_t G, int threads, const float *x, int64_t ldx,
                const int8_t *q, const float *scale, const float *bias, float *y, int8_t *xq, float *xd) {
    quantize_q8(M, K, x, ldx, xq, xd);
#if SUBQUAD_VNNI512
    int8q_vnni(M, N, K, G, threads, q, scale, bias, y, xq, xd);
#else
    const int64_t nb = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++)                  /* the row stays in L1 for every row of x */
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = (G == 1 ? q8_dot(q + n * K, nb, xq + m * K, xd + m * nb, NULL) * scale[n]
                                   : q8_dot(q + n * K, nb, xq + m * K, xd + m * nb, scale + n * G))
                           + (bias ? bias[n] : 0.0f);
#endif
}

/* int8_amx_gemv: y[m, n] = d[m] scale[n] sum_k q[n, k] c[m, k] + bias[n] (amx_rows' c, d; one scale per output
 * channel) through Sapphire Rapids' AMX tiles: per block of 16 output channels one tile of int32 sums (up to 16
 * rows x 16), per 64 k one tdpbusd of x's codes (16 rows x 64 bytes, u = c + 128; more rows: tiles of 16, u then
 * M rounded up to 16 rows, two channel blocks x two row tiles at a time: int8_amx_many) against the weights' tile
 * (16 x 64 bytes: row r holds k = 4r .. 4r + 3 of each of the 16 channels, int8_amx_pack's layout),
 * q . c = q . u - 128 sum(q) with sum(q) packed after the tiles. A tdpbusd
 * does 16 K products: 3-16 rows cost about one pass over the weights (benchmarks/RESULTS.md). Linux hands a
 * process the tiles' state only when asked (arch_prctl, int8_amx_init). */
#if SUBQUAD_AMX
#include <sys/syscall.h>
#include <unistd.h>
typedef struct { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_config;
#endif

#if SUBQUAD_AMX
/* Whether Linux grants the tiles' state: asked once per library (each block kernel's too), granted per process. */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0)
        granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return granted;
}
#endif

/* *out: 1 where the tiles may be used (compiled in, the kernel grants their state), else 2 where the same packed
 * weights go through AVX-512 VNNI's vectors (int8_vnni_rows), else 0. */
void int8_amx_init(int32_t *out) {
#if SUBQUAD_AMX
    *out = amx_granted() ? 1 : 2;
#else
    *out = SUBQUAD_VNNI512 ? 2 : 0;
#endif
}

/* q (N, K) int8 row-major, K a multiple of 64 -> p (Np K + 4 Np bytes, Np = N rounded up to 16): per block of 16
 * channels (the last padded with zeros) and 64 k, 16 rows of 64 bytes, p[r][4 i + j] = q[16 b + i, 64 kb + 4 r + j];
 * then the rows' sums, Np int32 (amx_sums). */
static inline const int32_t *amx_sums(const int8_t *p, int64_t N, int64_t K) {
    return (const int32_t *)(p + (N + 15) / 16 * 16 * K);
}

void int8_amx_pack(int64_t N, int64_t K, const int8_t *q, int8_t *p) {
    const int64_t nk = K / 64, Np = (N + 15) / 16 * 16;
    int32_t *qsum = (int32_t *)amx_sums(p, N, K);
    for (int64_t n = 0; n < Np; n++) {
        int32_t t = 0;
        for (int64_t k = 0; k < K && n < N; k++)
            t += q[n * K + k];
        qsum[n] = t;
    }
    for (int64_t b = 0; b < Np / 16; b++)
        for (int64_t kb = 0; kb < nk; kb++) {
            int8_t *dst = p + (b * nk + kb) * 1024;
            for (int r = 0; r < 16; r++)
                for (int i = 0; i < 16; i++)
                    for (int j = 0; j < 4; j++)
                        dst[r * 64 + 4 * i + j] = 16 * b + i < N ? q[(16 * b + i) * K + 64 * kb + 4 * r + j] : 0;
        }
}

#if SUBQUAD_VNNI512
/* x's rows rounded to 8 bits as a whole, as the tiles take them: d[m] = max_k |x[m, k]| / 127, c = round(x / d)
 * (to nearest even), u = c + 128 - finer than fbgemm's dynamic product, which rounds all the rows of a call to
 * one scale. K a multiple of 64. */
static void amx_rows(int64_t M, int64_t K, int threads, const float *x, int64_t ldx, uint8_t *u, float *d) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i off = _mm512_set1_epi32(128);
#pragma omp parallel for num_threads(M >= 64 ? threads : 1) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * ldx;
        __m512 mx = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int64_t k = 0; k < K; k += 16) {
            const __m512 v = _mm512_loadu_ps(xm + k);
            mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, v));
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        const float dm = _mm512_reduce_max_ps(mx) / 127.0f;
        const __m512 inv = _mm512_set1_ps(dm > 0.0f ? 1.0f / dm : 0.0f);
        d[m] = nan ? NAN : dm;              /* max skips a NaN: the row's outputs are NaN then, as x W^T's */
        for (int64_t k = 0; k < K; k += 16) {
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xm + k), inv));
            _mm_storeu_si128((__m128i *)(u + m * K + k), _mm512_cvtusepi32_epi8(_mm512_add_epi32(c, off)));
        }
    }
}
#endif

#if SUBQUAD_VNNI512
/* One tile of sums (16 rows from m0 x 16 channels from n0) out: y = d scale (sum - 128 sum(q)) + bias. */
static inline void amx_out(const int32_t *out, int64_t m0, int64_t M, int64_t n0, int64_t N, const float *xd,
                           const float *scale, const int32_t *qsum, const float *bias, float *y) {
    const int64_t nr = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 k = (__mmask16)((1u << nr) - 1);                /* the block's channels that exist */
    const __m512i q128 = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(k, qsum + n0), 7);
    const __m512 sc = _mm512_maskz_loadu_ps(k, scale + n0);
    const __m512 bs = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
    for (int64_t m = m0; m < M && m < m0 + 16; m++) {          /* the same float operations as written out */
        const __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(out + (m - m0) * 16), q128));
        _mm512_mask_storeu_ps(y + m * N + n0, k,
                              _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(xd[m]), sc), t), bs));
    }
}

/* Without the tiles (AVX-512 VNNI alone: AMD's Zen 4, Intel's Ice Lake): the same packed weights and the same
 * integer sums through vectors. A 64-byte row of a weights' tile is 16 channels x 4 k, so one vpdpbusd against
 * x's 4 codes at those k (broadcast) adds 4 products to each of the 16 channels' sums; all R <= 16 rows of x in one
 * pass over a block, 16 accumulators (two passes of 8 took 1.05-1.25x its time at 12-16 rows on the Zen 4 host).
 * out[m][16], as a tile is stored. */
static inline __attribute__((always_inline)) void vnni_block(const int R, int64_t nk, int64_t K, const uint8_t *u,
                                                             const int8_t *pb, int32_t *out) {
    __m512i a[16];
    for (int m = 0; m < R; m++)
        a[m] = _mm512_setzero_si512();
    for (int64_t kb = 0; kb < nk; kb++)
        for (int r = 0; r < 16; r++) {
            const int8_t *wr = pb + kb * 1024 + 64 * r;
            _mm_prefetch((const char *)(wr + PF_BYTES), _MM_HINT_T0);         /* the blocks lie in order */
            const __m512i w = _mm512_loadu_si512(wr);
            for (int m = 0; m < R; m++) {
                int32_t x4;
                memcpy(&x4, u + m * K + 64 * kb + 4 * r, 4);
                a[m] = _mm512_dpbusd_epi32(a[m], _mm512_set1_epi32(x4), w);
            }
        }
    for (int m = 0; m < R; m++)
        _mm512_storeu_si512(out + 16 * m, a[m]);
}

/* M <= 16 rows (amx_rows' u, xd) against the packed weights p, through vnni_block (R a constant in each case:
 * the sums stay in registers); y as int8_amx_gemv's. */
static void int8_vnni_rows(int64_t M, int64_t N, int64_t K, int threads, const int8_t *p, const float *scale,
                           const float *bias, float *y, const uint8_t *u, const float *xd) {
    const int64_t nk = K / 64, nb = (N + 15) / 16;
    const int32_t *qsum = amx_sums(p, N, K);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        int32_t out[16 * 16];
        const int8_t *pb = p + b * nk * 1024;
#define VB(r) vnni_block(r, nk, K, u, pb, out)
        switch (M) {
        case 1: VB(1); break; case 2: VB(2); break; case 3: VB(3); break; case 4: VB(4); break;
        case 5: VB(5); break; case 6: VB(6); break; case 7: VB(7); break; case 8: VB(8); break;
        case 9: VB(9); break; case 10: VB(10); break; case 11: VB(11); break; case 12: VB(12); break;
        case 13: VB(13); break; case 14: VB(14); break; case 15: VB(15); break; default: VB(16);
        }
#undef VB
        amx_out(out, 0, M, 16 * b, N, xd, scale, qsum, bias, y);
    }
}

#endif

#if SUBQUAD_AMX
/* More than 16 rows (a prompt's): per pair of channel blocks and pair of row tiles, four sums' tiles (0-3) over two
 * x tiles (4, 5) and two weight tiles (6, 7) - each tile loaded serves two tdpbusd, half the loads per product of
 * the one-pair loop, whose loads from L2 bound it (benchmarks/RESULTS.md). The same integer sums, so the same y. */
static void int8_amx_many(int64_t M, int64_t N, int64_t K, int threads, const int8_t *p, const float *scale,
                          const float *bias, float *y, const uint8_t *u, const float *xd) {
    const int64_t nk = K / 64, nb = (N + 15) / 16, mt = (M + 15) / 16;
    const int32_t *qsum = amx_sums(p, N, K);
#pragma omp parallel num_threads(threads)
    {
        amx_config c;
        memset(&c, 0, sizeof c);
        c.palette = 1;
        for (int t = 0; t < 8; t++)
            c.rows[t] = 16, c.colsb[t] = 64;
        _tile_loadconfig(&c);
        int32_t out[16 * 16];
#pragma omp for schedule(static)
        for (int64_t bp = 0; bp < (nb + 1) / 2; bp++) {
            const int64_t b = 2 * bp;
            const int two_n = b + 1 < nb;
            const int8_t *p0 = p + b * nk * 1024, *p1 = p0 + nk * 1024;
            for (int64_t t = 0; t < mt; t += 2) {
                const int two_m = t + 1 < mt;
                const uint8_t *u0 = u + 16 * t * K, *u1 = u0 + 16 * K;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kb = 0; kb < nk; kb++) {
                    _tile_loadd(4, u0 + 64 * kb, K);
                    _tile_loadd(6, p0 + kb * 1024, 64);
                    _tile_dpbusd(0, 4, 6);
                    if (two_n) {
                        _tile_loadd(7, p1 + kb * 1024, 64);
                        _tile_dpbusd(1, 4, 7);
                    }
                    if (two_m) {
                        _tile_loadd(5, u1 + 64 * kb, K);
                        _tile_dpbusd(2, 5, 6);
                        if (two_n)
                            _tile_dpbusd(3, 5, 7);
                    }
                }
                _tile_stored(0, out, 64);
                amx_out(out, 16 * t, M, 16 * b, N, xd, scale, qsum, bias, y);
                if (two_n) {
                    _tile_stored(1, out, 64);
                    amx_out(out, 16 * t, M, 16 * (b + 1), N, xd, scale, qsum, bias, y);
                }
                if (two_m) {
                    _tile_stored(2, out, 64);
                    amx_out(out, 16 * (t + 1), M, 16 * b, N, xd, scale, qsum, bias, y);
                    if (two_n) {
                        _tile_stored(3, out, 64);
                        amx_out(out, 16 * (t + 1), M, 16 * (b + 1), N, xd, scale, qsum, bias, y);
                    }
                }
            }
        }
        _tile_release();
    }
}
#endif

/* Up to this many rows int8_amx_gemv takes the vectors where the tiles are granted too (as BLOCK_INT8Q_ROWS in
 * qgemv.py, the rows int8q_gemv took there before). */
#define VECTOR_ROWS 4

void int8_amx_gemv(int64_t M, int64_t N, int64_t K, int threads, const float *x, int64_t ldx, const int8_t *p,
                   const float *scale, const float *bias, float *y, uint8_t *u, float *xd) {
#if SUBQUAD_VNNI512
    amx_rows(M, K, threads, x, ldx, u, xd);
#if SUBQUAD_AMX
    /* a few rows through the vectors even where the tiles are granted: the same integer sums, so the same y (a
     * row's result does not depend on M); those rows took int8q_gemv here before, never measured through tiles */
    if (!amx_granted() || M <= VECTOR_ROWS)
#endif
    {
        for (int64_t m0 = 0; m0 < M; m0 += 16)
            int8_vnni_rows(M - m0 < 16 ? M - m0 : 16, N, K, threads, p, scale, bias, y + m0 * N, u + m0 * K, xd + m0);
        return;
    }
#endif
#if SUBQUAD_AMX
    const int64_t nk = K / 64, nb = (N + 15) / 16;
    const int32_t *qsum = amx_sums(p, N, K);
    if (M > 16) {                                            /* whole tiles: the last one's rows past M zero */
        memset(u + M * K, 0, ((M + 15) / 16 * 16 - M) * K);
        int8_amx_many(M, N, K, threads, p, scale, bias, y, u, xd);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        amx_config c;
        memset(&c, 0, sizeof c);
        c.palette = 1;
        c.rows[0] = c.rows[1] = (uint8_t)M;                 /* 0: the sums, M x 16 int32; 1: x's codes, M x 64 */
        c.rows[2] = 16;                                      /* 2: the weights' tile */
        c.colsb[0] = c.colsb[1] = c.colsb[2] = 64;
        _tile_loadconfig(&c);
        int32_t out[16 * 16];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *pb = p + b * nk * 1024;
            _tile_zero(0);
            for (int64_t kb = 0; kb < nk; kb++) {
                _tile_loadd(1, u + 64 * kb, K);
                _tile_loadd(2, pb + kb * 1024, 64);
                _tile_dpbusd(0, 1, 2);
            }
            _tile_stored(0, out, 64);
            amx_out(out, 0, M, 16 * b, N, xd, scale, qsum, bias, y);
        }
        _tile_release();
    }
#elif !SUBQUAD_VNNI512
    (void)x; (void)ldx; (void)p; (void)scale; (void)bias; (void)u; (void)xd; (void)threads; (void)K;
    for (int64_t i = 0; i < M * N; i++)                       /* never called: int8_amx_init said 0 */
        y[i] = 0.0f;
#endif
}

/* Four channels against up to four rows of x at a time, blocks of four channels spread over ``threads`` (bf16_gemv's
 * vectors, f16_gemv): BLOCK(R, C) fills float out[4][4] for the R rows from m0 and the C channels from n0 - with
 * constants for four channels and 1-4 rows, so the compiler keeps its sums in registers - and the sums are written
 * out with the bias. Up to ONE rows of x take one channel at a time instead, BLOCK(R, 1): each thread then reads
 * one stream of weights in the order they lie, which the hardware prefetcher follows to the read bound, where four
 * channels' rows at once stayed 1.25-1.4x above it at one row on an AMD EPYC (Zen 4) even with their next lines
 * asked for (benchmarks/RESULTS.md, "One stream a thread"); past ONE the blocks' fewer loads a product win. A
 * channel's sum is the same chain of instructions either way (its own accumulator over k in order), so a row's
 * outputs do not depend on M. */
#define FOUR_BY_FOUR(M, N, n_from, bias, y, BLOCK, ONE)                                                            \
    if ((M) <= (ONE)) {                                                                                            \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                          \
        for (int64_t n0 = (n_from); n0 < (N); n0++) {                                                              \
            float out[4][4];                                                                                       \
            for (int64_t m0 = 0; m0 < (M); m0 += 4) {                                                              \
                const int R = (M) - m0 < 4 ? (int)((M) - m0) : 4;                                                  \
                if (R == 1)                                                                                        \
                    BLOCK(1, 1);                                                                                   \
                else if (R == 2)                                                                                   \
                    BLOCK(2, 1);                                                                                   \
                else if (R == 3)                                                                                   \
                    BLOCK(3, 1);                                                                                   \
                else                                                                                               \
                    BLOCK(4, 1);                                                                                   \
                for (int r = 0; r < R; r++)                                                                        \
                    (y)[(m0 + r) * (N) + n0] = out[r][0] + ((bias) ? (bias)[n0] : 0.0f);                           \
            }                                                                                                      \
        }                                                                                                          \
    } else                                                                                                         \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                              \
    for (int64_t b_ = 0; b_ < ((N) - (n_from) + 3) / 4; b_++) {                                                    \
        const int64_t n0 = (n_from) + 4 * b_;                                                                      \
        const int C = (N) - n0 < 4 ? (int)((N) - n0) : 4;                                                          \
        float out[4][4];                                                                                           \
        for (int64_t m0 = 0; m0 < (M); m0 += 4) {                                                                  \
            const int R = (M) - m0 < 4 ? (int)((M) - m0) : 4;                                                      \
            if (C == 4 && R == 4)                                                                                  \
                BLOCK(4, 4);                                                                                       \
            else if (C == 4 && R == 1)                                                                             \
                BLOCK(1, 4);                                                                                       \
            else if (C == 4 && R == 2)                                                                             \
                BLOCK(2, 4);                                                                                       \
            else if (C == 4)                                                                                       \
                BLOCK(3, 4);                                                                                       \
            else                                                                                                   \
                BLOCK(R, C);                                           /* the last channels */                     \
            for (int r = 0; r < R; r++)                                                                            \
                for (int c = 0; c < C; c++)                                                                        \
                    (y)[(m0 + r) * (N) + n0 + c] = out[r][c] + ((bias) ? (bias)[n0 + c] : 0.0f);                   \
        }                                                                                                          \
    }

/* The next block of four channels' lines (16-bit weights: 4 rows of K at w + 4 K) for k .. k + 31, asked for in
 * the order they lie: 256 bytes per 32 k, the four rows one after another. Asking for each of the four rows' lines
 * as the loads go (four streams) left bf16_gemv 1.4x the read bound at one row on an AMD EPYC (Zen 4); in order,
 * 1.07x (benchmarks/RESULTS.md, "Weight rows asked for in order"). Never faults. */
#define NEXT_BLOCK_LINES(w, K, k)                                                                                  \
    for (int j_ = 0; j_ < 4; j_++)                                                                                 \
        _mm_prefetch((const char *)((w) + 4 * (K)) + 8 * (k) + 64 * j_, _MM_HINT_T0)

/* bf16_gemv: y[m, n] = sum_k bf16(x[m, k]) w[n, k] + bias[n] - a bfloat16 model's product (models.quant's
 * Bf16Linear): w (N, K) bfloat16 row-major as stored, each x rounded to bfloat16 to nearest even (as torch's
 * .to(torch.bfloat16); xb, M K halves), float32 sums, y float32 (not rounded to bfloat16 as F.linear's bfloat16
 * output is). K a multiple of 32, M <= 16. Two ways, each reading a channel's row from memory once per call:
 * - vectors (vdpbf16ps, 32 pairs an instruction): per block of four channels up to four rows of x at a time (each
 *   group of four rows reads the block again from L1), the next block's lines asked for meanwhile;
 * - tiles (tdpbf16ps, ``amx`` set, 16 channels x 16 rows x 32 k an instruction): the weights' tile is 16 channels'
 *   rows of 32 k loaded as they lie (stride K), x's tile its rows' pairs k-major (xp: per 32 k, 16 pair-rows of M
 *   words), the sums' tile 16 channels x M rows, stored and written out transposed. Channels past the last 16
 *   take the vectors.
 * bf16_init: 0 neither built, 1 the vectors, 2 the tiles too (built, and Linux granted their state). */
void bf16_init(int32_t *out) {
#if SUBQUAD_AMX_BF16
    *out = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 2 : 1;
#else
    *out = SUBQUAD_BF16;
#endif
}

#if SUBQUAD_BF16
/* R rows of xb against C channels of w (R, C <= 4; constants where inlined): out[r][c]. */
static inline __attribute__((always_inline)) void bf16_block(const int R, const int C, int64_t K, const uint16_t *xb,
                                                             const uint16_t *w, float out[4][4]) {
    __m512 a[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            a[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[4], xv[4];
        for (int c = 0; c < C; c++)
            wv[c] = (__m512bh)_mm512_loadu_si512(w + c * K + k);
        if (C == 4)                                    /* one channel (one row of x) streams without */
            NEXT_BLOCK_LINES(w, K, k);
        for (int r = 0; r < R; r++)
            xv[r] = (__m512bh)_mm512_loadu_si512(xb + r * K + k);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                a[r][c] = _mm512_dpbf16_ps(a[r][c], xv[r], wv[c]);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            out[r][c] = _mm512_reduce_add_ps(a[r][c]);
}

/* Channels [n_from, N) through the vectors, blocks of four spread over the threads. */
static void bf16_vectors(int64_t M, int64_t N, int64_t n_from, int64_t K, int threads, const uint16_t *xb,
                         const uint16_t *w, const float *bias, float *y) {
#define BF16_BLOCK(R_, C_) bf16_block(R_, C_, K, xb + m0 * K, w + n0 * K, out)
    FOUR_BY_FOUR(M, N, n_from, bias, y, BF16_BLOCK, 8);
#undef BF16_BLOCK
}
#endif

#if SUBQUAD_AMX_BF16
/* Channels [0, 16 (N / 16)) through the tiles (the comment above bf16_init). */
static void bf16_tiles(int64_t M, int64_t N, int64_t K, int threads, const uint16_t *xb, const uint16_t *w,
                       const float *bias, float *y, uint32_t *xp) {
    const int64_t nk = K / 32;
    for (int64_t kb = 0; kb < nk; kb++)
        for (int r = 0; r < 16; r++)
            for (int64_t m = 0; m < M; m++)
                memcpy(xp + (kb * 16 + r) * M + m, xb + m * K + 32 * kb + 2 * r, 4);
#pragma omp parallel num_threads(threads)
    {
        amx_config c;
        memset(&c, 0, sizeof c);
        c.palette = 1;
        c.rows[0] = c.rows[1] = c.rows[2] = 16;    /* 0: sums, 16 channels x M; 1: weights, 16 x 32 k; 2: x's pairs */
        c.colsb[0] = c.colsb[2] = (uint16_t)(4 * M);
        c.colsb[1] = 64;
        _tile_loadconfig(&c);
        float out[16 * 16];
#pragma omp for schedule(static)
        for (int64_t b = 0; b < N / 16; b++) {
            const uint16_t *wb = w + 16 * b * K;
            _tile_zero(0);
            for (int64_t kb = 0; kb < nk; kb++) {
                _tile_loadd(1, wb + 32 * kb, 2 * K);
                _tile_loadd(2, xp + kb * 16 * M, 4 * M);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, out, 64);
            for (int64_t m = 0; m < M; m++)
                for (int i = 0; i < 16; i++)
                    y[m * N + 16 * b + i] = out[i * 16 + m] + (bias ? bias[16 * b + i] : 0.0f);
        }
        _tile_release();
    }
}
#endif

void bf16_gemv(int64_t M, int64_t N, int64_t K, int threads, int amx, const float *x, int64_t ldx,
               const uint16_t *w, const float *bias, float *y, uint16_t *xb) {
#if SUBQUAD_BF16
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(xb + m * K + k),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * ldx + k)));
    int64_t n_from = 0;
#if SUBQUAD_AMX_BF16
    if (amx && N >= 16) {
        uint32_t *xp = malloc(M * K * 2);
        bf16_tiles(M, N, K, threads, xb, w, bias, y, xp);
        free(xp);
        n_from = N / 16 * 16;
    }
#endif
    (void)amx;
    if (n_from < N)
        bf16_vectors(M, N, n_from, K, threads, xb, w, bias, y);
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)xb; (void)threads; (void)K; (void)amx;
    for (int64_t i = 0; i < M * N; i++)                       /* never called: bf16_init said 0 */
        y[i] = 0.0f;
#endif
}

/* f16_gemv: y[m, n] = sum_k x[m, k] w[n, k] + bias[n] with w (N, K) float16 row-major as stored (a GGUF file's F16
 * matrices: models.quant.F16Linear) and x float32 exact: each half widened to float32 in registers (vcvtph2ps) and
 * multiplied in float32 - the product of the dequantised matrix, reading two bytes a weight. Four channels against
 * up to four rows of x per register block, as bf16_gemv's vectors; K a multiple of 16 (AVX-512) or 8 (AVX2 + F16C).
 * f16_init: 1 where built with either. */
#if SUBQUAD_AVX512
#define F16_LANES 16
typedef __m512 f16_vec;
#define F16_LOAD(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define F16_X(p) _mm512_loadu_ps(p)
#define F16_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define F16_ZERO() _mm512_setzero_ps()
#define F16_SUM(v) _mm512_reduce_add_ps(v)
#elif SUBQUAD_AVX2 && defined(__F16C__)
#define F16_LANES 8
typedef __m256 f16_vec;
#define F16_LOAD(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define F16_X(p) _mm256_loadu_ps(p)
#define F16_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define F16_ZERO() _mm256_setzero_ps()
#define F16_SUM(v) hsum8(v)
#else
#define F16_LANES 0
#endif

void f16_init(int32_t *out) { *out = F16_LANES; }

#if F16_LANES
static inline __attribute__((always_inline)) void f16_block(const int R, const int C, int64_t K, const float *x,
                                                            int64_t ldx, const uint16_t *w, float out[4][4]) {
    f16_vec a[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            a[r][c] = F16_ZERO();
    for (int64_t k = 0; k < K; k += F16_LANES) {
        f16_vec wv[4];
        for (int c = 0; c < C; c++)
            wv[c] = F16_LOAD(w + c * K + k);
        if (C == 4 && !(k & 31))                       /* one channel (one row of x) streams without */
            NEXT_BLOCK_LINES(w, K, k);
        for (int r = 0; r < R; r++) {
            const f16_vec xv = F16_X(x + r * ldx + k);
            for (int c = 0; c < C; c++)
                a[r][c] = F16_FMA(wv[c], xv, a[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            out[r][c] = F16_SUM(a[r][c]);
}
#endif

void f16_gemv(int64_t M, int64_t N, int64_t K, int threads, const float *x, int64_t ldx, const uint16_t *w,
              const float *bias, float *y) {
#if F16_LANES
#define F16_BLOCK(R_, C_) f16_block(R_, C_, K, x + m0 * ldx, ldx, w + n0 * K, out)
    FOUR_BY_FOUR(M, N, 0, bias, y, F16_BLOCK, 2);   /* widening costs a load more */
#undef F16_BLOCK
#else
    (void)x; (void)ldx; (void)w; (void)bias; (void)threads; (void)K;
    for (int64_t i = 0; i < M * N; i++)                       /* never called: f16_init said 0 */
        y[i] = 0.0f;
#endif
}

/* q4_0_gemv: a GGUF file's Q4_0 matrix as it is stored, times x rounded per block of 32 (quantize_q8) - llama.cpp's
 * Q4_0 x Q8_0 product: y[m, n] = sum_b scale[n, b] d[m, b] ((u - 8) . c)_b + bias[n], with u the block's 32
 * nibbles (q (N, K / 2) bytes, 16 per block: byte j's low nibble is value j, its high nibble value 16 + j) and
 * (u - 8) . c = u . c - 8 sum(c): u is unsigned and c signed, so maddubs takes them as they are.
 *
 * Two blocks per 256-bit load of q: its low nibbles are values 0-15 of block b (lane 0) and of b + 1 (lane 1), its
 * high nibbles values 16-31. x's codes are laid out once per call to match (q4x: per pair of blocks c_b[0:16],
 * c_{b+1}[0:16], c_b[16:32], c_{b+1}[16:32]), so a pair takes two maddubs, one 16-bit add (each 16-bit sum
 * <= 4 x 15 x 127) and one madd - no lane shuffle of q -, madd's four int32 sums per block carry -8 sum(c) in their
 * first (o4, also once per call), and one fma scales the pair by [scale_b d_b x 4, scale_{b+1} d_{b+1} x 4]
 * (d4: d_b four times, then d_{b+1}). The integer sums are exact; an odd last block takes the plain loop. */
typedef struct {
    int8_t *c;                                          /* M K bytes: x's codes, pairs of blocks laid out as above */
    float *d4;                                          /* M (nb / 2) 8: d per block of the pair, four times each */
    int32_t *o4;                                        /* M (nb / 2) 8: -8 sum(c) per block, then three zeros */
} q4x;

static inline q4x q4x_layout(int64_t M, int64_t K, const int8_t *xq, const float *xd) {
    const int64_t nb = K / 32, np = nb / 2;
#if !SIMD
    q4x none = {NULL, NULL, NULL};                      /* the plain loop reads x's codes in order */
    (void)M, (void)np, (void)xq, (void)xd;
    return none;
#endif
    q4x t = {malloc(M * K), malloc(M * np * 8 * sizeof(float)), malloc(M * np * 8 * sizeof(int32_t))};
    for (int64_t m = 0; m < M; m++)
        for (int64_t p = 0; p < np; p++) {
            const int8_t *c0 = xq + m * K + 64 * p, *c1 = c0 + 32;
            int8_t *o = t.c + m * K + 64 * p;
            memcpy(o, c0, 16), memcpy(o + 16, c1, 16), memcpy(o + 32, c0 + 16, 16), memcpy(o + 48, c1 + 16, 16);
            for (int h = 0; h < 2; h++) {
                int32_t sum = 0;
                for (int j = 0; j < 32; j++)
                    sum += (h ? c1 : c0)[j];
                for (int i = 0; i < 4; i++) {
                    t.d4[(m * np + p) * 8 + 4 * h + i] = xd[m * nb + 2 * p + h];
                    t.o4[(m * np + p) * 8 + 4 * h + i] = i ? 0 : -8 * sum;
                }
            }
        }
    return t;
}

#if SIMD
static inline __m256 q4_pair(const uint8_t *q, const int8_t *c, const float *d4, const int32_t *o4, const float *ws,
                             __m256 acc) {
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)q);
    const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)c)),
                                         _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(c + 32))));
    const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)),
                                         _mm256_loadu_si256((const __m256i *)o4));
    const __m256 w = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64(
        (const __m128i *)ws))), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(w, _mm256_loadu_ps(d4)), acc);
}
#endif

/* One row of q (nb blocks) against row m of x: xl its laid-out codes (q4x, row m), c its codes in order, d their
 * scales, ws the row's block scales. */
static inline float q4_dot(const uint8_t *q, int64_t nb, const int8_t *xl, const float *d4, const int32_t *o4,
                           const int8_t *c, const float *d, const float *ws) {
    float s = 0.0f;
    int64_t b = 0;
#if SIMD
    const int64_t np = nb / 2;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 2 <= np; p += 2) {
        _mm_prefetch((const char *)(q + 32 * p + PF_BYTES), _MM_HINT_T0);
        a0 = q4_pair(q + 32 * p, xl + 64 * p, d4 + 8 * p, o4 + 8 * p, ws + 2 * p, a0);
        a1 = q4_pair(q + 32 * p + 32, xl + 64 * p + 64, d4 + 8 * p + 8, o4 + 8 * p + 8, ws + 2 * p + 2, a1);
    }
    if (p < np)
        a0 = q4_pair(q + 32 * p, xl + 64 * p, d4 + 8 * p, o4 + 8 * p, ws + 2 * p, a0);
    s = hsum8(_mm256_add_ps(a0, a1));
    b = 2 * np;
#else
    (void)xl, (void)d4, (void)o4;
#endif
    for (; b < nb; b++) {                               /* the odd block (and every block without AVX2) */
        int32_t t = 0;
        for (int j = 0; j < 16; j++)
            t += ((int32_t)(q[16 * b + j] & 15) - 8) * c[32 * b + j] + ((int32_t)(q[16 * b + j] >> 4) - 8)
                 * c[32 * b + 16 + j];
        s += d[b] * ws[b] * (float)t;
    }
    return s;
}

void q4_0_gemv(int64_t M, int64_t N, int64_t K, int threads, const float *x, int64_t ldx, const uint8_t *q,
               const float *scale, const float *bias, float *y, int8_t *xq, float *xd) {
    quantize_q8(M, K, x, ldx, xq, xd);
#if SUBQUAD_VNNI512
    q4_0_vnni(M, N, K, threads, q, scale, bias, y, xq, xd);
#else
    const int64_t nb = K / 32, np = nb / 2;
    const q4x t = q4x_layout(M, K, xq, xd);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = q4_dot(q + n * (K / 2), nb, t.c + m * K, t.d4 + m * np * 8, t.o4 + m * np * 8, xq + m * K,
                                  xd + m * nb, scale + n * nb) + (bias ? bias[n] : 0.0f);
    free(t.c), free(t.d4), free(t.o4);
#endif
}

#if SIMD
/* A split block of 2h rows (h = 16 or 32) at w against one row of x's codes c (quantize_q8's; xp: c as byte pairs
 * (c[2i], c[2i + 1]) per 16-bit lane, d per block of 32, xc: sum of x~ = c d per group): byte j of each k holds
 * rows j (low nibble) and j + h (high). Two k at a time, each row's two codes are interleaved into adjacent bytes
 * (one permute, one shuffle) so maddubs multiplies them by (c[k], c[k + 1]) and adds the pair in 16 bits
 * (<= 2 x 15 x 127); 16 k sum exactly in 16 bits, then widen to float times d.
 * out[r] = sum_g s[g, r] (sum_{k in g} code[r, k] c[k] d) + (z - 8 s)[g, r] xc[g]. */
static inline __attribute__((always_inline)) void int4_split_q(int64_t K, int64_t G, int64_t Np, int64_t h,
                                                               const int16_t *xp, const float *d, const float *xc,
                                                               const uint8_t *w, const uint16_t *sz, int64_t n0,
                                                               float *out) {
    const int64_t gs = K / G, nv = h / 8;           /* 16-row vectors: 2 (h = 16) or 4 (h = 32) */
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i inter = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                           0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for (int64_t r = 0; r < 2 * h; r++)
        out[r] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        __m256 f[8];                                 /* per 8 rows, lo rows then hi rows: sum code c d */
        for (int i = 0; i < 2 * nv; i++)
            f[i] = _mm256_setzero_ps();
        for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 16) {
            __m256i a[4];                            /* vector v: rows 16v..16v+15 */
            for (int i = 0; i < nv; i++)
                a[i] = _mm256_setzero_si256();
            for (int64_t k = k0; k < k0 + 16; k += 2) {
                const __m256i xv = _mm256_set1_epi16(xp[k / 2]);
                _mm_prefetch((const char *)(w + k * h + PF_BYTES), _MM_HINT_T0);
                for (int64_t ch = 0; ch < h / 16; ch++) {
                    /* [k's 16 bytes | k + 1's]: 64-bit quarters to (0, 2, 1, 3), then bytes interleaved in each
                     * lane, so byte 2j, 2j + 1 are row j's (or j + 8's) codes at k and k + 1 */
                    const __m256i v = h == 16 ? _mm256_loadu_si256((const __m256i *)(w + k * h))
                        : _mm256_loadu2_m128i((const __m128i *)(w + (k + 1) * h + 16 * ch),
                                              (const __m128i *)(w + k * h + 16 * ch));
                    const __m256i p = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v, 0xD8), inter);
                    const __m256i L = _mm256_and_si256(p, m4), H = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
                    a[ch] = _mm256_add_epi16(a[ch], _mm256_maddubs_epi16(L, xv));
                    a[h / 16 + ch] = _mm256_add_epi16(a[h / 16 + ch], _mm256_maddubs_epi16(H, xv));
                }
            }
            const __m256 dv = _mm256_set1_ps(d[k0 / 32]);
            for (int i = 0; i < nv; i++) {
                const __m256i l32 = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a[i]));
                const __m256i h32 = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a[i], 1));
                f[2 * i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l32), dv, f[2 * i]);
                f[2 * i + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h32), dv, f[2 * i + 1]);
            }
        }
        float acc[64];                               /* rows in order: lo rows 0..h-1, hi rows h..2h-1 */
        for (int i = 0; i < 2 * nv; i++)
            _mm256_storeu_ps(acc + 8 * i, f[i]);
        const uint16_t *sg = sz + (g * Np + n0) * 2;
        for (int64_t r = 0; r < 2 * h; r++) {
            const float sc = bf16_f(sg[2 * r]), z = bf16_f(sg[2 * r + 1]);
            out[r] += sc * acc[r] + (z - 8.0f * sc) * xc[g];
        }
    }
}
#endif

#if SUBQUAD_VNNI512 && defined(__AVX512VBMI__)
#define INT4_VNNI 1
/* A group's close for R rows of x: f[r][i] holds outputs 16 i .. 16 i + 15 in order (nv of them), their (s, z)
 * bfloat16 pairs 16 dwords a vector at sg, s the low half: o[r][i] += s f + (z - 8 s) xc[r G + g], 16 outputs an
 * instruction (a scalar loop over them took as many instructions as the group's products; benchmarks/RESULTS.md,
 * "int4's groups closed 16 rows at once"). */
static inline __attribute__((always_inline)) void int4_close(int64_t R, int nv, const uint16_t *sg, const float *xc,
                                                             int64_t G, int64_t g, __m512 (*f)[4], __m512 (*o)[4]) {
    const __m512 eight = _mm512_set1_ps(8.0f);
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int i = 0; i < nv; i++) {
        const __m512i p = _mm512_loadu_si512(sg + 32 * i);
        const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
        const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(p, hi16));
        for (int64_t r = 0; r < R; r++) {
            const __m512 xg = _mm512_set1_ps(xc[r * G + g]);
            o[r][i] = _mm512_add_ps(o[r][i], _mm512_add_ps(_mm512_mul_ps(sc, f[r][i]),
                                    _mm512_mul_ps(_mm512_sub_ps(z, _mm512_mul_ps(eight, sc)), xg)));
        }
    }
}

/* int4_split_q with AVX-512 VNNI and VBMI: four k at a time, the 4 x 16 bytes of a 16-row chunk (byte j of k's row
 * holds rows j and j + h) put in row order by one byte permute (vpermb / vpermt2b: row j's codes at k..k+3 in one
 * dword), then its low and its high nibbles each against x's four codes c[k..k+3] (one broadcast dword) in one
 * vpdpbusd: 16 rows' sums of four products, exact in int32, widened to float times d once per block of 32. */
static inline __attribute__((always_inline)) void int4_split_vnni(const int R, int64_t K, int64_t G, int64_t Np,
                                                                  int64_t h, const int8_t *c, const float *d,
                                                                  const float *xc, const uint8_t *w,
                                                                  const uint16_t *sz, int64_t n0, float *out) {
    /* R <= 4 rows of x at once (a constant where inlined; row r's codes at c + r K, its block scales at
     * d + r K / 32, its group sums at xc + r G, its 2h outputs at out + 64 r): each weight step unpacked once
     * for all R, not row by row (0.67-0.85x the time at 2-8 rows, 0.94x at 16 on Zen 4: benchmarks/RESULTS.md),
     * and each row's sums the same instructions in the same order as alone (its own accumulators): the same bits. */
    const int64_t gs = K / G, nv = h / 16, nb = K / 32;  /* 16-row chunks: 1 (h = 16) or 2 (h = 32) */
    const __m512i m4 = _mm512_set1_epi8(15);
    uint8_t ix[2][64];                                    /* chunk ch's byte 4j + t <- byte t h + 16 ch + j */
    for (int64_t ch = 0; ch < nv; ch++)
        for (int j = 0; j < 16; j++)
            for (int t = 0; t < 4; t++)
                ix[ch][4 * j + t] = (uint8_t)(t * h + 16 * ch + j);
    const __m512i idx0 = _mm512_loadu_si512(ix[0]), idx1 = _mm512_loadu_si512(ix[1]);
    __m512 o[4][4];                                       /* per row, out's 2h rows, 16 a vector */
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2 * nv; i++)
            o[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 f[4][4];                                   /* per row: lo rows by chunk, then hi rows by chunk */
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 2 * nv; i++)
                f[r][i] = _mm512_setzero_ps();
        for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 32) {
            __m512i a[4][4];
            for (int r = 0; r < R; r++)
                for (int i = 0; i < 2 * nv; i++)
                    a[r][i] = _mm512_setzero_si512();
            for (int64_t k = k0; k < k0 + 32; k += 4) {
                _mm_prefetch((const char *)(w + k * h + PF_BYTES), _MM_HINT_T0);
                if (h == 32)        /* a step reads 128 bytes: both lines ahead (only the first: 1.16-1.22x */
                    _mm_prefetch((const char *)(w + k * h + PF_BYTES + 64), _MM_HINT_T0);  /* the time, Zen 4) */
                __m512i lo[2], hi[2];
                for (int64_t ch = 0; ch < nv; ch++) {
                    const __m512i p = h == 16
                        ? _mm512_permutexvar_epi8(idx0, _mm512_loadu_si512(w + k * h))
                        : _mm512_permutex2var_epi8(_mm512_loadu_si512(w + k * h), ch ? idx1 : idx0,
                                                   _mm512_loadu_si512(w + k * h + 64));
                    lo[ch] = _mm512_and_si512(p, m4);
                    hi[ch] = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
                }
                for (int r = 0; r < R; r++) {
                    int32_t x4;
                    memcpy(&x4, c + r * K + k, 4);
                    const __m512i xv = _mm512_set1_epi32(x4);
                    for (int64_t ch = 0; ch < nv; ch++) {
                        a[r][ch] = _mm512_dpbusd_epi32(a[r][ch], lo[ch], xv);
                        a[r][nv + ch] = _mm512_dpbusd_epi32(a[r][nv + ch], hi[ch], xv);
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                const __m512 dv = _mm512_set1_ps(d[r * nb + k0 / 32]);
                for (int i = 0; i < 2 * nv; i++)
                    f[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][i]), dv, f[r][i]);
            }
        }
        int4_close(R, 2 * nv, sz + (g * Np + n0) * 2, xc, G, g, f, o);
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2 * nv; i++)
            _mm512_storeu_ps(out + 64 * r + 16 * i, o[r][i]);
}

/* R rows' products over one unpacked block of 32 k (U), added to their group sums F times each row's block scale;
 * one small function per R (inlined into int4_split_many, GCC kept the accumulators on the stack). */
#define MANY_PASS(R)                                                                                             \
    static __attribute__((noinline)) void many_pass_##R(int64_t K, int64_t nb, int64_t k0, const int8_t *c,    \
                                                        const float *d, const __m512i *U, __m512 (*F)[4]) {    \
        __m512i a[R][4];                                                                                         \
        for (int r = 0; r < R; r++)                                                                              \
            for (int i = 0; i < 4; i++)                                                                          \
                a[r][i] = _mm512_setzero_si512();                                                                \
        for (int s = 0; s < 8; s++) {                                                                            \
            const __m512i u0 = U[4 * s], u1 = U[4 * s + 1], u2 = U[4 * s + 2], u3 = U[4 * s + 3];                \
            for (int r = 0; r < R; r++) {                                                                        \
                int32_t x4;                                                                                      \
                memcpy(&x4, c + r * K + k0 + 4 * s, 4);                                                          \
                const __m512i xv = _mm512_set1_epi32(x4);                                                        \
                a[r][0] = _mm512_dpbusd_epi32(a[r][0], u0, xv);                                                  \
                a[r][1] = _mm512_dpbusd_epi32(a[r][1], u1, xv);                                                  \
                a[r][2] = _mm512_dpbusd_epi32(a[r][2], u2, xv);                                                  \
                a[r][3] = _mm512_dpbusd_epi32(a[r][3], u3, xv);                                                  \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < R; r++) {                                                                            \
            const __m512 dv = _mm512_set1_ps(d[r * nb + k0 / 32]);                                               \
            for (int i = 0; i < 4; i++)                                                                          \
                F[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][i]), dv, F[r][i]);                             \
        }                                                                                                        \
    }
MANY_PASS(1)
MANY_PASS(2)
MANY_PASS(3)
MANY_PASS(4)
#undef MANY_PASS

/* A block of bn = 16, 32 or 48 rows in pairs (byte j of each k holds rows 2j and 2j + 1: a matrix's last, shorter
 * block, or every block of quant.py's third layout) against R <= 4 rows of x, with VNNI (int4_any's sums in
 * floats took a matrix's short last block ~20x a full block's time a row, and a third of a 16-row product of
 * 3,352 x 768: benchmarks/RESULTS.md). Eight pairs (16 rows) at a time: the 4 x 8 bytes of four k put in row
 * order by one byte permute (row pair j's codes at k..k+3 in dword j), the low nibbles rows 2j, the high 2j + 1,
 * each against x's four codes in one vpdpbusd; per block of 32 k widened to float times d, per group closed as
 * int4_any closes it. Each row's sums are the same instructions whatever R: the same bits as alone. */
static inline __attribute__((always_inline)) void int4_pairs_vnni(const int R, int64_t K, int64_t G, int64_t Np,
                                                                  int64_t bn, const int8_t *c, const float *d,
                                                                  const float *xc, const uint8_t *w,
                                                                  const uint16_t *sz, int64_t n0, float *out) {
    const int64_t gs = K / G, nb = K / 32, h = bn / 2;
    const __m256i m4 = _mm256_set1_epi8(15);
    uint8_t ix[32];                                       /* byte 4j + t <- byte 8t + j */
    for (int j = 0; j < 8; j++)
        for (int t = 0; t < 4; t++)
            ix[4 * j + t] = (uint8_t)(8 * t + j);
    const __m256i idx = _mm256_loadu_si256((const __m256i *)ix);
    for (int r = 0; r < R; r++)
        for (int64_t j = 0; j < bn; j++)
            out[64 * r + j] = 0.0f;
    for (int64_t ch = 0; ch < h / 8; ch++) {              /* rows 16 ch .. 16 ch + 15 */
        for (int64_t g = 0; g < G; g++) {
            __m256 f[4][2];                               /* per row: even rows, odd rows of the chunk */
            for (int r = 0; r < R; r++)
                f[r][0] = f[r][1] = _mm256_setzero_ps();
            for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 32) {
                __m256i a[4][2];
                for (int r = 0; r < R; r++)
                    a[r][0] = a[r][1] = _mm256_setzero_si256();
                for (int64_t k = k0; k < k0 + 32; k += 4) {
                    int64_t q[4];
                    for (int t = 0; t < 4; t++)
                        memcpy(&q[t], w + (k + t) * h + 8 * ch, 8);
                    const __m256i p = _mm256_permutexvar_epi8(idx, _mm256_setr_epi64x(q[0], q[1], q[2], q[3]));
                    const __m256i lo = _mm256_and_si256(p, m4), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
                    for (int r = 0; r < R; r++) {
                        int32_t x4;
                        memcpy(&x4, c + r * K + k, 4);
                        const __m256i xv = _mm256_set1_epi32(x4);
                        a[r][0] = _mm256_dpbusd_epi32(a[r][0], lo, xv);
                        a[r][1] = _mm256_dpbusd_epi32(a[r][1], hi, xv);
                    }
                }
                for (int r = 0; r < R; r++) {
                    const __m256 dv = _mm256_set1_ps(d[r * nb + k0 / 32]);
                    f[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][0]), dv, f[r][0]);
                    f[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][1]), dv, f[r][1]);
                }
            }
            const uint16_t *sg = sz + (g * Np + n0 + 16 * ch) * 2;
            for (int r = 0; r < R; r++) {
                float acc[16];                            /* rows 2j from f[r][0], 2j + 1 from f[r][1] */
                _mm256_storeu_ps(acc, f[r][0]);
                _mm256_storeu_ps(acc + 8, f[r][1]);
                for (int j = 0; j < 16; j++) {
                    const float v = acc[(j & 1) * 8 + j / 2];
                    const float sc = bf16_f(sg[2 * j]), z = bf16_f(sg[2 * j + 1]);
                    out[64 * r + 16 * ch + j] += sc * v + (z - 8.0f * sc) * xc[r * G + g];
                }
            }
        }
    }
}

/* int4_split_vnni for M of 5..16 rows of x (h = 32): each block of 32 k is unpacked once into U (2 KB, L1) and
 * every row's products read it from there, four rows a pass (int4_split_vnni unpacks the weights again for each
 * four rows: 1.5-2.3x int8's time at 16 rows on Zen 4, where the unpacking took the vector units' slots; see
 * benchmarks/RESULTS.md). Each row's float sums are int4_split_vnni's for that row, in the same order: the same
 * bits as alone. F and O: the rows' group sums and outputs, in memory (16 rows x 4 vectors each). */
static void int4_split_many(int64_t M, int64_t K, int64_t G, int64_t Np, const int8_t *c, const float *d,
                            const float *xc, const uint8_t *w, const uint16_t *sz, int64_t n0, float *out) {
    const int64_t gs = K / G, nb = K / 32;
    const __m512i m4 = _mm512_set1_epi8(15);
    uint8_t ix[2][64];
    for (int ch = 0; ch < 2; ch++)
        for (int j = 0; j < 16; j++)
            for (int t = 0; t < 4; t++)
                ix[ch][4 * j + t] = (uint8_t)(t * 32 + 16 * ch + j);
    const __m512i idx0 = _mm512_loadu_si512(ix[0]), idx1 = _mm512_loadu_si512(ix[1]);
    __m512i U[8][4];                                      /* step s of 4 k: lo chunk 0, 1, hi chunk 0, 1 */
    __m512 F[16][4], O[16][4];
    for (int64_t r = 0; r < M; r++)
        for (int i = 0; i < 4; i++)
            O[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int64_t r = 0; r < M; r++)
            for (int i = 0; i < 4; i++)
                F[r][i] = _mm512_setzero_ps();
        for (int64_t k0 = g * gs; k0 < (g + 1) * gs; k0 += 32) {
            for (int s = 0; s < 8; s++) {
                const uint8_t *wk = w + (k0 + 4 * s) * 32;
                _mm_prefetch((const char *)(wk + PF_BYTES), _MM_HINT_T0);
                _mm_prefetch((const char *)(wk + PF_BYTES + 64), _MM_HINT_T0);
                const __m512i v0 = _mm512_loadu_si512(wk), v1 = _mm512_loadu_si512(wk + 64);
                const __m512i p0 = _mm512_permutex2var_epi8(v0, idx0, v1), p1 = _mm512_permutex2var_epi8(v0, idx1, v1);
                U[s][0] = _mm512_and_si512(p0, m4);
                U[s][1] = _mm512_and_si512(p1, m4);
                U[s][2] = _mm512_and_si512(_mm512_srli_epi16(p0, 4), m4);
                U[s][3] = _mm512_and_si512(_mm512_srli_epi16(p1, 4), m4);
            }
            for (int64_t m0 = 0; m0 < M; m0 += 4)
                switch (M - m0) {
                    case 1: many_pass_1(K, nb, k0, c + m0 * K, d + m0 * nb, U[0], F + m0); break;
                    case 2: many_pass_2(K, nb, k0, c + m0 * K, d + m0 * nb, U[0], F + m0); break;
                    case 3: many_pass_3(K, nb, k0, c + m0 * K, d + m0 * nb, U[0], F + m0); break;
                    default: many_pass_4(K, nb, k0, c + m0 * K, d + m0 * nb, U[0], F + m0);
                }
        }
        int4_close(M, 4, sz + (g * Np + n0) * 2, xc, G, g, F, O);
    }
    for (int64_t r = 0; r < M; r++)
        for (int i = 0; i < 4; i++)
            _mm512_storeu_ps(out + 64 * r + 16 * i, O[r][i]);
}
#else
#define INT4_VNNI 0
#endif

/* Any block of bn <= 64 rows, byte j of each k holding rows 2j and 2j + 1 (split = 0) or j and j + bn / 2. */
static void int4_any(int64_t K, int64_t G, int64_t Np, int64_t bn, int split, const float *x, const float *xs,
                     const uint8_t *w, const uint16_t *sz, int64_t n0, float *out) {
    const int64_t gs = K / G, h = bn / 2;
    float acc[64];
    for (int64_t r = 0; r < bn; r++)
        out[r] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        for (int64_t r = 0; r < bn; r++)
            acc[r] = 0.0f;
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
            const uint8_t *b = w + k * h;
            for (int64_t j = 0; j < h; j++) {
                acc[split ? j : 2 * j] += (float)(b[j] & 15) * x[k];
                acc[split ? j + h : 2 * j + 1] += (float)(b[j] >> 4) * x[k];
            }
        }
        const uint16_t *sg = sz + (g * Np + n0) * 2;
        for (int64_t r = 0; r < bn; r++) {
            const float s = bf16_f(sg[2 * r]), z = bf16_f(sg[2 * r + 1]);
            out[r] += s * acc[r] + (z - 8.0f * s) * xs[g];
        }
    }
}

/* int4_gemv's rows with VNNI: any number (a prompt's too), 16 or 4 at a time; without it at most 16 (qgemv.py). */
void int4_init(int32_t *out) { *out = INT4_VNNI; }

/* x rounded per block of 32 first (quantize_q8); with VNNI a block's rows in chunks (int4_split_many, _vnni,
 * int4_pairs_vnni), else two k per maddubs in a split block (int4_split_q), other blocks through int4_any with
 * x~ = c d as floats. */
void int4_gemv(int64_t M, int64_t N, int64_t Np, int64_t K, int64_t G, int64_t BN, int split, int threads,
               const float *x, int64_t ldx, const uint8_t *w, const uint16_t *sz, const float *bias, float *y) {
    const int64_t full = Np / BN, nb = K / 32;
    int8_t *c = malloc(M * K + (M * nb + M * K + M * G) * sizeof(float));
    float *d = (float *)(c + M * K), *xr = d + M * nb, *xc = xr + M * K;   /* xr: x~ = c d, xc: its group sums */
    quantize_q8(M, K, x, ldx, c, d);
    for (int64_t i = 0; i < M * K; i++)
        xr[i] = (float)c[i] * d[i / 32];
    group_sums(M, G, K / G, xr, K, xc);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < full + (full * BN < Np); blk++) {
        const int64_t n0 = blk * BN, bn = blk < full ? BN : Np - n0;
        const uint8_t *wb = w + n0 * K / 2;
        float out[16 * 64];
#if INT4_VNNI
        const int many = split && bn == BN && BN == 64, four = split && bn == BN && BN == 32,
                  pairs = !(split && bn == BN) && bn % 16 == 0 && bn <= 48;
        if (many || four || pairs) {                /* rows in chunks: up to 16 (a 64-row block), else 4 a pass */
            for (int64_t m0 = 0, R; m0 < M; m0 += R) {
                const int8_t *cm = c + m0 * K;
                const float *dm = d + m0 * nb, *xm = xc + m0 * G;
                if (many && M - m0 > 4) {           /* the block unpacked once for all the chunk's rows */
                    R = M - m0 < 16 ? M - m0 : 16;
                    int4_split_many(R, K, G, Np, cm, dm, xm, wb, sz, n0, out);
                } else {
                    R = M - m0 < 4 ? M - m0 : 4;
#define I4V(R_, H_) int4_split_vnni(R_, K, G, Np, H_, cm, dm, xm, wb, sz, n0, out)  /* constants: registers */
#define I4P(R_) int4_pairs_vnni(R_, K, G, Np, bn, cm, dm, xm, wb, sz, n0, out)
                    if (pairs)
                        switch (R) { case 1: I4P(1); break; case 2: I4P(2); break; case 3: I4P(3); break;
                                     default: I4P(4); }
                    else if (many)
                        switch (R) { case 1: I4V(1, 32); break; case 2: I4V(2, 32); break; case 3: I4V(3, 32); break;
                                     default: I4V(4, 32); }
                    else
                        switch (R) { case 1: I4V(1, 16); break; case 2: I4V(2, 16); break; case 3: I4V(3, 16); break;
                                     default: I4V(4, 16); }
#undef I4V
#undef I4P
                }
                for (int64_t r = 0; r < R; r++)
                    for (int64_t j = 0; j < bn && n0 + j < N; j++)
                        y[(m0 + r) * N + n0 + j] = out[64 * r + j] + (bias ? bias[n0 + j] : 0.0f);
            }
            continue;
        }
#endif
        for (int64_t m = 0; m < M; m++) {
#if SIMD && !INT4_VNNI
            if (split && bn == BN && BN == 64)             /* h a constant in each call: registers, not memory */
                int4_split_q(K, G, Np, 32, (const int16_t *)(c + m * K), d + m * nb, xc + m * G, wb, sz, n0, out);
            else if (split && bn == BN && BN == 32)
                int4_split_q(K, G, Np, 16, (const int16_t *)(c + m * K), d + m * nb, xc + m * G, wb, sz, n0, out);
            else                                           /* a last, shorter block is in pairs */
#endif
                int4_any(K, G, Np, bn, split && bn == BN, xr + m * K, xc + m * G, wb, sz, n0, out);
            for (int64_t r = 0; r < bn && n0 + r < N; r++)
                y[m * N + n0 + r] = out[r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
    free(c);
}

/* One row of x is bound by reading w: each 64-byte line of the rows PF_ROWS ahead (the next block of four) is
 * asked for while this block's are summed - 5-8% off a float32 decoding step on the Sapphire Rapids host
 * (benchmarks/RESULTS.md); 0 turns it off. */
#define PF_ROWS 4
/* Four rows of w against two rows of x (x1 NULL: one), k in steps of 8 then a scalar tail: out[j][r]. */
static inline void f32_dot4(const float *w, int64_t K, const float *x0, const float *x1, float out[2][4]) {
    int64_t k = 0;
#if SIMD
    __m256 a[2][4];
    for (int r = 0; r < 4; r++)
        a[0][r] = a[1][r] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(x0 + k);
        const __m256 v1 = x1 ? _mm256_loadu_ps(x1 + k) : v0;
        if (PF_ROWS && !(k & 15))                     /* the next rows' 4 x 64 bytes for these 16 k, in order */
            for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)(w + PF_ROWS * K) + 16 * k + 64 * j, _MM_HINT_T0);
        for (int r = 0; r < 4; r++) {
            const __m256 wr = _mm256_loadu_ps(w + r * K + k);
            a[0][r] = _mm256_fmadd_ps(wr, v0, a[0][r]);
            a[1][r] = _mm256_fmadd_ps(wr, v1, a[1][r]);
        }
    }
    for (int j = 0; j < 2; j++)
        for (int r = 0; r < 4; r++)
            out[j][r] = hsum8(a[j][r]);
#else
    for (int j = 0; j < 2; j++)
        for (int r = 0; r < 4; r++)
            out[j][r] = 0.0f;
    for (; k + 8 <= K; k += 8)
        for (int r = 0; r < 4; r++) {
            float s0 = 0, s1 = 0;
            for (int i = 0; i < 8; i++) {
                s0 += w[r * K + k + i] * x0[k + i];
                s1 += w[r * K + k + i] * (x1 ? x1[k + i] : 0.0f);
            }
            out[0][r] += s0, out[1][r] += s1;
        }
#endif
    for (; k < K; k++)
        for (int r = 0; r < 4; r++) {
            out[0][r] += w[r * K + k] * x0[k];
            out[1][r] += w[r * K + k] * (x1 ? x1[k] : 0.0f);
        }
}

/* From TILE_ROWS rows on, outer products against x^T: the matrix's rows stream through broadcasts, x^T packed
 * k-major (xp, W = 8 or 16 columns: every row of x) stays in the cache, and each output is its own fma chain in
 * k order, summed per block of KB inputs (float32's error grows with KB + K / KB terms, not K). A tile of 6
 * weight rows x 16 rows of x holds 12 accumulators (the FMA units' latency times their count): compute-bound
 * at 16 rows where the dot products above were at ~half the matmul rate (benchmarks/RESULTS.md). The
 * entries do not depend on the other rows of x either, but differ in the last bits from the dot products'. Each
 * line of the next tile's rows (``next``) is asked for while this tile's are summed - a tile's rows are as many
 * streams as it has rows, more than the hardware prefetcher follows - and tile12x16 / tile12x8 take 16 inputs a
 * step, the rows' pointers held apart from the loop (tile6x16, AVX2 only, one a step): a 16-row product
 * 1.3-1.55x faster from the prefetches, 1.25x more from the 16-input steps, on the Sapphire Rapids host
 * (benchmarks/RESULTS.md). */
#define TILE_ROWS 3
#define KB 128

#if SIMD
/* xp[k * W + m] = x[m, k], zero past M. */
static void pack_xt(int64_t M, int64_t K, int64_t W, const float *x, int64_t ldx, float *xp) {
    for (int64_t k = 0; k < K; k++)
        for (int64_t m = 0; m < W; m++)
            xp[k * W + m] = m < M ? x[m * ldx + k] : 0.0f;
}

/* rows w[0..5] against 16 columns of xp: out[i][m] = sum_k w[i K + k] xp[k 16 + m], one fma chain per entry. */
static inline void tile6x16(int64_t K, const float *w, const float *next, const float *xp, float out[6][16]) {
    for (int i = 0; i < 6; i++)
        for (int m = 0; m < 16; m++)
            out[i][m] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        __m256 a[6][2];
        for (int i = 0; i < 6; i++)
            a[i][0] = a[i][1] = _mm256_setzero_ps();
        for (int64_t k = k0; k < k1; k++) {
            const __m256 b0 = _mm256_load_ps(xp + k * 16), b1 = _mm256_load_ps(xp + k * 16 + 8);
            if (!(k & 15))
                for (int i = 0; i < 6; i++)
                    _mm_prefetch((const char *)(next + i * K + k), _MM_HINT_T0);
            for (int i = 0; i < 6; i++) {
                const __m256 v = _mm256_broadcast_ss(w + i * K + k);
                a[i][0] = _mm256_fmadd_ps(v, b0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(v, b1, a[i][1]);
            }
        }
        for (int i = 0; i < 6; i++) {
            _mm256_storeu_ps(out[i], _mm256_add_ps(_mm256_loadu_ps(out[i]), a[i][0]));
            _mm256_storeu_ps(out[i] + 8, _mm256_add_ps(_mm256_loadu_ps(out[i] + 8), a[i][1]));
        }
    }
}

#if SUBQUAD_AVX512
/* tile6x16 with 512-bit vectors (AVX-512): 12 rows of w against the 16 columns in one vector each, 12 chains, one
 * load of xp per k for 192 products; the same chain per entry, so the same bits as tile6x16 and rows_chain. */
static inline void tile12x16(int64_t K, const float *w, const float *next, const float *xp, float out[12][16]) {
    for (int i = 0; i < 12; i++)
        for (int m = 0; m < 16; m++)
            out[i][m] = 0.0f;
    const float *r[12];
    for (int i = 0; i < 12; i++)
        r[i] = w + i * K;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        __m512 a[12];
        for (int i = 0; i < 12; i++)
            a[i] = _mm512_setzero_ps();
        int64_t k = k0;
        for (; k + 16 <= k1; k += 16) {
            for (int i = 0; i < 12; i++)
                _mm_prefetch((const char *)(next + i * K + k), _MM_HINT_T0);
#pragma GCC unroll 16
            for (int kk = 0; kk < 16; kk++) {
                const __m512 b = _mm512_loadu_ps(xp + (k + kk) * 16);
                for (int i = 0; i < 12; i++)
                    a[i] = _mm512_fmadd_ps(_mm512_set1_ps(r[i][k + kk]), b, a[i]);
            }
        }
        for (; k < k1; k++) {
            const __m512 b = _mm512_loadu_ps(xp + k * 16);
            for (int i = 0; i < 12; i++)
                a[i] = _mm512_fmadd_ps(_mm512_set1_ps(r[i][k]), b, a[i]);
        }
        for (int i = 0; i < 12; i++)
            _mm512_storeu_ps(out[i], _mm512_add_ps(_mm512_loadu_ps(out[i]), a[i]));
    }
}
#endif

static inline void tile12x8(int64_t K, const float *w, const float *next, const float *xp, float out[12][8]) {
    for (int i = 0; i < 12; i++)
        for (int m = 0; m < 8; m++)
            out[i][m] = 0.0f;
    const float *r[12];
    for (int i = 0; i < 12; i++)
        r[i] = w + i * K;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        __m256 a[12];
        for (int i = 0; i < 12; i++)
            a[i] = _mm256_setzero_ps();
        int64_t k = k0;
        for (; k + 16 <= k1; k += 16) {
            for (int i = 0; i < 12; i++)
                _mm_prefetch((const char *)(next + i * K + k), _MM_HINT_T0);
#pragma GCC unroll 16
            for (int kk = 0; kk < 16; kk++) {
                const __m256 b = _mm256_load_ps(xp + (k + kk) * 8);
                for (int i = 0; i < 12; i++)
                    a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(r[i] + k + kk), b, a[i]);
            }
        }
        for (; k < k1; k++) {
            const __m256 b = _mm256_load_ps(xp + k * 8);
            for (int i = 0; i < 12; i++)
                a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(r[i] + k), b, a[i]);
        }
        for (int i = 0; i < 12; i++)
            _mm256_storeu_ps(out[i], _mm256_add_ps(_mm256_loadu_ps(out[i]), a[i]));
    }
}
#endif

/* Rows n0 .. n0 + nr of w against every row of x, the tiles' sums written out (the last rows, no AVX2). */
static void rows_chain(int64_t M, int64_t K, int64_t n0, int64_t nr, const float *x, int64_t ldx, const float *w,
                       const float *bias, int64_t N, float *y) {
    for (int64_t i = 0; i < nr; i++)
        for (int64_t m = 0; m < M; m++) {
            float s = 0.0f;
            for (int64_t k0 = 0; k0 < K; k0 += KB) {
                float p = 0.0f;
                for (int64_t k = k0; k < K && k < k0 + KB; k++)
                    p = fmaf(w[(n0 + i) * K + k], x[m * ldx + k], p);
                s += p;
            }
            y[m * N + n0 + i] = s + (bias ? bias[n0 + i] : 0.0f);
        }
}

static void f32_tiles(int64_t M, int64_t N, int64_t K, int threads, const float *x, int64_t ldx, const float *w,
                      const float *bias, float *y) {
#if SIMD
    const int64_t W = M > 8 ? 16 : 8, R = W == 16 && !SUBQUAD_AVX512 ? 6 : 12, tiles = N / R;
    float *xp = aligned_alloc(32, (K * W * sizeof(float) + 31) / 32 * 32);
    pack_xt(M, K, W, x, ldx, xp);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t <= tiles; t++) {
        const int64_t n0 = t * R;
        if (t == tiles) {
            rows_chain(M, K, n0, N - n0, x, ldx, w, bias, N, y);
            continue;
        }
        float out[12 * 16];
        const float *next = w + (t + 1 < tiles ? n0 + R : n0) * K;   /* the next tile's rows (the last: its own) */
        if (W == 16)
#if SUBQUAD_AVX512
            tile12x16(K, w + n0 * K, next, xp, (float (*)[16])out);
#else
            tile6x16(K, w + n0 * K, next, xp, (float (*)[16])out);
#endif
        else
            tile12x8(K, w + n0 * K, next, xp, (float (*)[8])out);
        for (int64_t i = 0; i < R; i++)
            for (int64_t m = 0; m < M; m++)
                y[m * N + n0 + i] = out[i * W + m] + (bias ? bias[n0 + i] : 0.0f);
    }
    free(xp);
#else
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        rows_chain(M, K, n, 1, x, ldx, w, bias, N, y);
#endif
}

void f32_gemv(int64_t M, int64_t N, int64_t K, int threads, const float *x, int64_t ldx, const float *w,
              const float *bias, float *y) {
    if (M >= TILE_ROWS) {
        f32_tiles(M, N, K, threads, x, ldx, w, bias, y);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n4 = 0; n4 < (N + 3) / 4; n4++) {
        const int64_t n0 = n4 * 4;
        if (n0 + 4 > N) {                            /* the last 1-3 rows: plain sums */
            for (int64_t n = n0; n < N; n++)
                for (int64_t m = 0; m < M; m++) {
                    float s = 0.0f;
                    for (int64_t k = 0; k < K; k++)
                        s += w[n * K + k] * x[m * ldx + k];
                    y[m * N + n] = s + (bias ? bias[n] : 0.0f);
                }
            continue;
        }
        for (int64_t m = 0; m < M; m += 2) {        /* the block stays in L1 for every pair of rows of x */
            float out[2][4];
            f32_dot4(w + n0 * K, K, x + m * ldx, m + 1 < M ? x + (m + 1) * ldx : NULL, out);
            for (int64_t j = 0; j < 2 && m + j < M; j++)
                for (int64_t r = 0; r < 4; r++)
                    y[(m + j) * N + n0 + r] = out[j][r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
}

void f32_gemv_cm(int64_t M, int64_t N, int64_t K, int threads, const float *x, int64_t ldx, const float *wt,
                 const float *bias, float *y) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n64 = 0; n64 < (N + 63) / 64; n64++) {      /* 64 outputs, every k, 16 rows of x at a time */
        const int64_t n0 = n64 * 64, nn = N - n0 < 64 ? N - n0 : 64;
        float acc[16][64];
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int64_t mm = M - m0 < 16 ? M - m0 : 16;
            for (int64_t m = 0; m < mm; m++)
                for (int64_t j = 0; j < 64; j++)
                    acc[m][j] = 0.0f;
            for (int64_t k = 0; k < K; k++) {
                const float *wk = wt + k * N + n0;
                for (int64_t m = 0; m < mm; m++) {
                    const float xv = x[(m0 + m) * ldx + k];
                    if (nn == 64) {
#pragma omp simd
                        for (int64_t j = 0; j < 64; j++)
                            acc[m][j] += wk[j] * xv;
                    } else
                        for (int64_t j = 0; j < nn; j++)
                            acc[m][j] += wk[j] * xv;
                }
            }
            for (int64_t m = 0; m < mm; m++)
                for (int64_t j = 0; j < nn; j++)
                    y[(m0 + m) * N + n0 + j] = acc[m][j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
}

/* The blocks' projections (mamba_block.c, mamba2_block.c): y = x W^T + bias, W float32 row-major (kind 0),
 * column-major (kind 1: w holds W^T), int8 codes per output channel times scale (kind 2, int8q_gemv, K a
 * multiple of 32), int4 in torch's packed layout with ``groups`` bfloat16 scales and zeros per row in scale
 * (int4_gemv; kind 3: blocks of 64 rows split, 4: of 32 split, 5: of 32 in pairs - quant.py's LAYOUTS 1-3), or
 * int8 codes times ``groups`` float32 scales per row (kind 6, int8_gemv, x exact: a GGUF file's Q6_K matrices,
 * or Q8_0's where asked; kind 7, Q8_0's blocks of 32 with x rounded per block by int8q_gemv, as llama.cpp does;
 * kind 8, Q4_0's nibbles as the file packs them, by q4_0_gemv; kind 9, int8_amx_pack's tiles; kind 10, bfloat16
 * row-major, bf16_gemv, groups 1 through its tiles; kind 11, float16 row-major, f16_gemv).
 * The scratch each needs is allocated here. */
enum { PROJ_F32 = 0, PROJ_F32_CM = 1, PROJ_INT8 = 2, PROJ_INT4 = 3, PROJ_INT8_BLOCKS = 6, PROJ_Q8_0 = 7,
       PROJ_Q4_0 = 8, PROJ_INT8_AMX = 9, PROJ_BF16 = 10, PROJ_F16 = 11 };

static void proj_gemv(int kind, int64_t groups, int64_t M, int64_t N, int64_t K, int threads, const float *x,
                      int64_t ldx, const void *w, const void *scale, const float *bias, float *y) {
    if (kind == PROJ_Q4_0) {                                  /* Q4_0's nibbles as stored, x rounded per block */
        int8_t *xq = malloc(M * K + M * (K / 32) * sizeof(float));
        q4_0_gemv(M, N, K, threads, x, ldx, w, scale, bias, y, xq, (float *)(xq + M * K));
        free(xq);
    } else if (kind == PROJ_Q8_0) {                           /* x rounded per block, as llama.cpp does */
        int8_t *xq = malloc(M * K + M * (K / 32) * sizeof(float));
        int8q_gemv(M, N, K, groups, threads, x, ldx, w, scale, bias, y, xq, (float *)(xq + M * K));
        free(xq);
    } else if (kind == PROJ_INT8_BLOCKS) {
        float *xs = malloc(M * groups * sizeof(float));       /* int8_gemv's group sums: unused without offsets */
        int8_gemv(M, N, K, groups, threads, x, ldx, w, scale, NULL, bias, y, xs);
        free(xs);
    } else if (kind == PROJ_INT8_AMX) {                       /* int8_amx_pack's tiles, the rows' sums after them */
        uint8_t *u = malloc(M * K + M * sizeof(float));
        int8_amx_gemv(M, N, K, threads, x, ldx, w, scale, bias, y, u, (float *)(u + M * K));
        free(u);
    } else if (kind == PROJ_BF16) {                           /* bfloat16 weights; groups 1: through the tiles */
        uint16_t *xb = malloc(M * K * sizeof(uint16_t));
        bf16_gemv(M, N, K, threads, (int)groups, x, ldx, w, bias, y, xb);
        free(xb);
    } else if (kind == PROJ_F16) {                            /* float16 weights, x exact */
        f16_gemv(M, N, K, threads, x, ldx, w, bias, y);
    } else if (kind == PROJ_INT8) {
        int8_t *xq = malloc(M * K + M * (K / 32) * sizeof(float));
        int8q_gemv(M, N, K, 1, threads, x, ldx, w, scale, bias, y, xq, (float *)(xq + M * K));
        free(xq);
    } else if (kind >= PROJ_INT4)
        int4_gemv(M, N, (N + 15) / 16 * 16, K, groups, kind == PROJ_INT4 ? 64 : 32, kind < PROJ_INT4 + 2, threads,
                  x, ldx, w, scale, bias, y);
    else
        (kind == PROJ_F32_CM ? f32_gemv_cm : f32_gemv)(M, N, K, threads, x, ldx, w, bias, y);
}

#endif
