/* One decoding step of a pre-norm block's MLP half, in one call:
 *
 *   x  = h / sqrt(mean(h^2) + eps) * norm_w        h (M, d): the residual stream, one token per row
 *   a  = silu(x W_g^T + b_g) * (x W_u^T + b_u)     SwiGLU (act 0): W_g, W_u (F, d), biases (F,) or NULL
 *   a  = relu(x W_u^T + b_u)^2                     ReLU^2, ungated (act 1: Nemotron-H's; W_g unused)
 *   h' = h + a W_d^T + b_d                          W_d (d, F), b_d (d,) or NULL
 *
 * Each W float32 row- or column-major, int8 or int4, as its kind says (qgemv.c's proj_gemv); M <= 16.
 * ops/mlp_block.py is the Python side; layers.mlp.SwiGLU's forward after the block's RMSNorm is the reference.
 * mamba2_block.c's stack runs it after a layer's mixer half. */

#ifndef SUBQUAD_KERNELS_MLP_BLOCK_C
#define SUBQUAD_KERNELS_MLP_BLOCK_C

#include "qgemv.c"

void mlp_block_rows(int64_t M, int64_t d, int64_t F, int act, int threads, const float *h, const float *norm_w,
                    float eps,
                    const void *w_g, const void *s_g, const float *b_g, int g_kind, int64_t g_groups,
                    const void *w_u, const void *s_u, const float *b_u, int u_kind, int64_t u_groups,
                    const void *w_d, const void *s_d, const float *b_d, int d_kind, int64_t d_groups,
                    float *h_out, float *scratch)                      /* M (d + 2 F) floats */
{
    float *x = scratch, *g = x + M * d, *u = g + M * F;
    rms_rows(M, d, h, norm_w, eps, x);
    proj_gemv(u_kind, u_groups, M, F, d, threads, x, d, w_u, s_u, b_u, u);
    if (act == 0) {
        proj_gemv(g_kind, g_groups, M, F, d, threads, x, d, w_g, s_g, b_g, g);
        mul_silu_n(u, g, M * F);                                      /* u * silu(g): the product commutes */
    } else
        for (int64_t i = 0; i < M * F; i++) {
            const float r = u[i] > 0.0f ? u[i] : 0.0f;
            u[i] = r * r;
        }
    proj_gemv(d_kind, d_groups, M, d, F, threads, u, F, w_d, s_d, b_d, h_out);
    for (int64_t i = 0; i < M * d; i++)
        h_out[i] += h[i];
}

/* mlp_block_rows with its arguments as a table's 64-bit words (the stacked blocks': mamba2_block.c, layer_stack.c),
 * m[0..22] in its order (threads, h, h_out and scratch unused: given here), the norm's eps as its float's bits. */
static void mlp_block_words(const int64_t *m, int threads, const float *h, float *h_out, float *scratch)
{
#define P(i) ((void *)(intptr_t)m[i])
    mlp_block_rows(m[0], m[1], m[2], (int)m[3], threads, h, P(6), f_bits(m[7]), P(8), P(9), P(10), (int)m[11], m[12],
                   P(13), P(14), P(15), (int)m[16], m[17], P(18), P(19), P(20), (int)m[21], m[22], h_out, scratch);
#undef P
}

#endif
