/* One decoding token of a pre-norm softmax attention block (grouped-query heads, rotary over the first R dims of
 * each head or none, q / k norms per head or none, an output gate or none; no window) in two calls around the
 * cache's append, which stays Python's (ops/softmax/cache.py's KVCache):
 *
 * attn_in_rows    x = h / sqrt(mean(h^2) + eps) * norm_w            h (B, d): the residual stream
 *                 q = x W_q^T + b_q (B, H K),  k = x W_k^T + b_k,  v = x W_v^T + b_v (B, Hk K); gated: W_q's
 *                 rows per head are the query's K, then its gate's K (gate (B, H K))
 *                 q, k = rmsnorm per head (weights qn_w, kn_w (K,); NULL: none)
 *                 q and k rotated at pos[b] (layers/rotary.py's half-split layout: dims i and i + R/2 of a head
 *                 by the angle pos w_i, w_i = base^(-2i/R), cos and sin in double rounded to float)
 * attn_out_rows   o[b, h] = sum_j p_j v[b, j, g],  p = softmax_j(scale q[b, h] . k[b, j, g]),  g = h / (H / Hk),
 *                 j from start[b] (a ragged batch's left padding; 0 without) to L - 1;  o *= sigmoid(gate) (or not)
 *                 h' = h + o W_o^T + b_o
 *
 * k and v (B, L, Hk, K) with row strides kb and vb (floats: the cache's buffer holds more columns than L).
 * Each W float32 row- or column-major, int8 or int4, as its kind says (qgemv.c's proj_gemv); B <= 16.
 * layers/attention_step.py is the Python side; the block's PyTorch forward (SoftmaxAttention.attend through
 * SDPA) is the reference. */

#include <math.h>

#include "qgemv.c"

static void rotate_rows(int64_t B, int64_t heads, int64_t K, int64_t R, double base, const int64_t *pos, float *x) {
    const int64_t half = R / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < half; i++) {
            const double ang = (double)pos[b] * pow(base, -(double)i / (double)half);
            const float c = (float)cos(ang), s = (float)sin(ang);
            for (int64_t h = 0; h < heads; h++) {
                float *v = x + (b * heads + h) * K;
                const float x1 = v[i], x2 = v[half + i];
                v[i] = x1 * c - x2 * s;
                v[half + i] = x1 * s + x2 * c;
            }
        }
}

void attn_in_rows(int64_t B, int64_t d, int64_t H, int64_t Hk, int64_t K, int64_t R, double base, int gated,
                  int threads, const float *h, const float *norm_w, float eps,
                  const void *w_q, const void *s_q, const float *b_q, int q_kind, int64_t q_groups,
                  const void *w_k, const void *s_k, const float *b_k, int k_kind, int64_t k_groups,
                  const void *w_v, const void *s_v, const float *b_v, int v_kind, int64_t v_groups,
                  const float *qn_w, float qn_eps, const float *kn_w, float kn_eps,
                  const int64_t *pos, float *q, float *gate, float *k, float *v,
                  float *scratch)                                     /* B (d + 2 H K) floats */
{
    float *x = scratch, *qg = x + B * d;
    rms_rows(B, d, h, norm_w, eps, x);
    proj_gemv(q_kind, q_groups, B, H * K * (gated ? 2 : 1), d, threads, x, d, w_q, s_q, b_q, gated ? qg : q);
    if (gated)                                        /* each head's query, then its gate */
        for (int64_t bh = 0; bh < B * H; bh++) {
            memcpy(q + bh * K, qg + bh * 2 * K, K * sizeof(float));
            memcpy(gate + bh * K, qg + bh * 2 * K + K, K * sizeof(float));
        }
    proj_gemv(k_kind, k_groups, B, Hk * K, d, threads, x, d, w_k, s_k, b_k, k);
    proj_gemv(v_kind, v_groups, B, Hk * K, d, threads, x, d, w_v, s_v, b_v, v);
    if (qn_w) {                                       /* rms_rows reads a row whole before it writes it */
        rms_rows(B * H, K, q, qn_w, qn_eps, q);
        rms_rows(B * Hk, K, k, kn_w, kn_eps, k);
    }
    if (R > 0) {
        rotate_rows(B, H, K, R, base, pos, q);
        rotate_rows(B, Hk, K, R, base, pos, k);
    }
}

void attn_out_rows(int64_t B, int64_t d, int64_t H, int64_t Hk, int64_t K, int64_t L, int threads, const float *q,
                   const float *kc, int64_t kb, const float *vc, int64_t vb, const int64_t *start, float scale,
                   const float *gate, const float *h, const void *w_o, const void *s_o, const float *b_o, int o_kind,
                   int64_t o_groups, float *h_out,
                   float *scratch)                                    /* B H (K + L) floats */
{
    float *o = scratch, *scores = o + B * H * K;
    const int64_t rep = H / Hk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, g = (bh % H) / rep, j0 = start ? start[b] : 0;
        const float *qv = q + bh * K, *kr = kc + b * kb + g * K, *vr = vc + b * vb + g * K;
        float *s = scores + bh * L, *out = o + bh * K, m = -INFINITY, sum = 0.0f;
        for (int64_t j = j0; j < L; j++) {
            const float *kj = kr + j * Hk * K;
            float dot = 0.0f;
#pragma omp simd reduction(+:dot)
            for (int64_t i = 0; i < K; i++)
                dot += qv[i] * kj[i];
            s[j] = dot * scale;
            m = s[j] > m ? s[j] : m;
        }
        for (int64_t i = 0; i < K; i++)
            out[i] = 0.0f;
        for (int64_t j = j0; j < L; j++) {
            const float p = exp_f(s[j] - m), *vj = vr + j * Hk * K;
            sum += p;
#pragma omp simd
            for (int64_t i = 0; i < K; i++)
                out[i] += p * vj[i];
        }
        const float r = 1.0f / sum;
        for (int64_t i = 0; i < K; i++)
            out[i] *= r;
        if (gate)
            for (int64_t i = 0; i < K; i++)
                out[i] *= 1.0f / (1.0f + exp_f(-gate[bh * K + i]));
    }
    proj_gemv(o_kind, o_groups, B, d, H * K, threads, o, H * K, w_o, s_o, b_o, h_out);
    for (int64_t i = 0; i < B * d; i++)
        h_out[i] += h[i];
}
