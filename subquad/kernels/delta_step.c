/* One decoding step of a (Gated) DeltaNet layer between its input products and o_proj, fused
 * (subquad/ops/delta/fused_step.py states the math and shapes; layers/deltanet.py's PyTorch step is the
 * reference). float32, row-major.
 *
 *   q, k, v = split(silu(sum_j conv_w[:, j] [conv_state; (q, k, v)]_j), [Hk K, Hk K, H V])
 *   q, k    = l2(q), l2(k) per key head            (qk_eps 0: x / max(|x|, 1e-12); else x rsqrt(|x|^2 + eps))
 *   beta    = sigmoid(b) (x 2 with neg_eigval);  a = exp(-exp(A_log) softplus(a_raw + dt_bias)) (gated; else 1)
 *   S'      = a S + k (beta (v - a S^T k))^T       per value head h, key head h / (H / Hk); S (K, V)
 *   o       = rmsnorm(scale S'^T q) * norm_w       (gated: * silu(gate + gate_bias), or sigmoid)
 *
 * One OpenMP team of the runtime torch loaded: channels split for the convolution, value heads for the rest;
 * one barrier. exp written out in common.h (no -ffast-math). */

#include "common.h"

static void l2(float *x, int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    float inv;
    if (eps > 0.0f) {
        inv = 1.0f / sqrtf(ss + eps);
    } else {
        float norm = sqrtf(ss);
        inv = 1.0f / (norm > 1e-12f ? norm : 1e-12f);
    }
    for (int64_t i = 0; i < n; i++)
        x[i] *= inv;
}

void delta_step(int64_t B, int64_t H, int64_t Hk, int64_t K, int64_t V, int64_t W, int threads,
                const float *q_in, const float *k_in, const float *v_in, int64_t q_row, int64_t k_row,
                int64_t v_row,                                        /* (B, Hk K), (B, Hk K), (B, H V) */
                const float *conv_state, const float *conv_w,         /* (B, W-1, C), (C, W); C = 2 Hk K + H V */
                const float *b_in, int64_t b_row, int neg_eigval,     /* (B, H) */
                const float *a_in, int64_t a_row,                     /* (B, H), or NULL: not gated */
                const float *A_log, const float *dt_bias,             /* (H,) */
                const float *gate, int64_t gate_row, const float *gate_bias,   /* (B, H V) or NULL, (H V) or NULL */
                int gate_sigmoid,                                     /* the gate's activation: silu or sigmoid */
                const float *S, float qk_eps, float scale,            /* (B, H, K, V) */
                const float *norm_w, float norm_eps,                  /* (V,) */
                float *out, float *conv_out, float *S_out,            /* (B, H V), (B, W-1, C), like S */
                float *scratch)                                       /* B C + threads (2 K + V) floats */
{
    const int64_t QK = Hk * K, C = 2 * QK + H * V, per_key = H / Hk;
    float *qkv = scratch;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t c0, c1;
        span(C, nt, t, &c0, &c1);
        for (int64_t b = 0; b < B; b++) {                   /* the convolution over [q, k, v], its new tail */
            const float *st = conv_state + b * (W - 1) * C;
            float *so = conv_out + b * (W - 1) * C, *xb = qkv + b * C;
            for (int64_t c = c0; c < c1; c++) {
                const float x = c < QK ? q_in[b * q_row + c]
                              : c < 2 * QK ? k_in[b * k_row + c - QK] : v_in[b * v_row + c - 2 * QK];
                float acc = conv_w[c * W + W - 1] * x;
                for (int64_t j = 0; j < W - 1; j++)
                    acc += conv_w[c * W + j] * st[j * C + c];
                xb[c] = acc;
                if (W > 1)
                    so[(W - 2) * C + c] = x;
            }
            silu_n(xb + c0, c1 - c0);
            for (int64_t j = 0; j + 1 < W - 1; j++)
                memcpy(so + j * C + c0, st + (j + 1) * C + c0, (c1 - c0) * sizeof(float));
        }
#pragma omp barrier
        float *qn = scratch + B * C + (int64_t)t * (2 * K + V), *kn = qn + K, *u = kn + K;
        const int64_t h0 = H * t / nt, h1 = H * (t + 1) / nt;
        for (int64_t b = 0; b < B; b++) {
            const float *xb = qkv + b * C;
            for (int64_t h = h0; h < h1; h++) {
                const int64_t kh = h / per_key;
                memcpy(qn, xb + kh * K, K * sizeof(float));
                memcpy(kn, xb + QK + kh * K, K * sizeof(float));
                l2(qn, K, qk_eps);
                l2(kn, K, qk_eps);
                const float *vh = xb + 2 * QK + h * V;
                float beta = 1.0f / (1.0f + exp_f(-b_in[b * b_row + h]));
                if (neg_eigval)
                    beta *= 2.0f;
                float a = 1.0f;
                if (a_in)
                    a = exp_f(-exp_f(A_log[h]) * softplus_f(a_in[b * a_row + h] + dt_bias[h]));
                const float *s = S + ((b * H + h) * K) * V;
                float *so = S_out + ((b * H + h) * K) * V, *o = out + b * H * V + h * V;
                for (int64_t j = 0; j < V; j++)
                    u[j] = 0.0f;
                for (int64_t i = 0; i < K; i++) {           /* a S^T k */
                    const float ki = a * kn[i];
                    const float *si = s + i * V;
#pragma omp simd
                    for (int64_t j = 0; j < V; j++)
                        u[j] += ki * si[j];
                }
                for (int64_t j = 0; j < V; j++) {
                    u[j] = beta * (vh[j] - u[j]);          /* u = beta (v - a S^T k) */
                    o[j] = 0.0f;
                }
                for (int64_t i = 0; i < K; i++) {           /* S' = a S + k u^T, and o = scale S'^T q */
                    const float *si = s + i * V;
                    float *oi = so + i * V;
                    const float kk = kn[i], qi = scale * qn[i];
#pragma omp simd
                    for (int64_t j = 0; j < V; j++) {
                        const float x = a * si[j] + kk * u[j];
                        oi[j] = x;
                        o[j] += qi * x;
                    }
                }
                float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
                for (int64_t j = 0; j < V; j++)
                    ss += o[j] * o[j];
                const float inv = 1.0f / sqrtf(ss / (float)V + norm_eps);
                if (gate && !gate_bias && !gate_sigmoid) {          /* silu(gate), 8 at a time */
                    for (int64_t j = 0; j < V; j++)
                        o[j] *= inv * norm_w[j];
                    mul_silu_n(o, gate + b * gate_row + h * V, V);
                } else
                    for (int64_t j = 0; j < V; j++) {
                        float y = o[j] * inv * norm_w[j];
                        if (gate) {
                            float r = gate[b * gate_row + h * V + j] + (gate_bias ? gate_bias[h * V + j] : 0.0f);
                            y *= gate_sigmoid ? 1.0f / (1.0f + exp_f(-r)) : silu_f(r);
                        }
                        o[j] = y;
                    }
            }
        }
    }
}
