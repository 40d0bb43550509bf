/* One decoding step of a whole pre-norm Mamba-1 block without an MLP (the mamba and mamba-130m layer), in one
 * call: the norm, in_proj, the step between the products (mamba_step.c), out_proj and the residual.
 *
 *   x  = h / sqrt(mean(h^2) + eps) * norm_w                h (B, d): the residual stream, one token per row
 *   xz = x W_in^T + b_in                                   W_in (2D, d), b_in (2D,) or NULL
 *   y  = mamba_step(xz, ...)                               (B, D), the new conv state and h (mamba_step.c)
 *   h' = h + y W_out^T + b_out                             W_out (d, D), b_out (d,) or NULL
 * Each W float32 row-major, column-major (decode_layout's small wide matrices), int8 per output channel times
 * s_in / s_out, or int4 with groups of scales and zeros, as its kind and groups say (qgemv.c's proj_gemv);
 * B <= 16.
 *
 * mamba_block_tokens runs T consecutive tokens of B sequences at once: T = 1 a decoding step, T > 1 a speculative
 * verification. Rows t-major (row t B + b of h is token t of sequence b); the products over all T B rows at once,
 * the step between them token by token from the state the previous token left (mamba_step.c's mamba_rows), and
 * every token's states written out: conv_out (T, B, K-1, D), ssm_out (T, B, D, N) - the state after each token,
 * as layers/rollback.py's PerToken keeps it. T B <= 16.
 *
 * ops/mamba/fused_block.py states it once more with the Python side; the block's own PyTorch forward is the
 * reference. The products are qgemv.c's: each weight read once for all B rows. */

#include "mamba_step.c"
#include "qgemv.c"

void mamba_block_tokens(int64_t T, int64_t B, int64_t d, int64_t D, int64_t N, int64_t R, int64_t K, int64_t heads,
                        int threads, const float *h, const float *norm_w, float eps, const void *w_in,
                        const void *s_in, const float *b_in, const void *w_out, const void *s_out,
                        const float *b_out, int in_kind, int out_kind, int64_t in_groups, int64_t out_groups,
                        const float *conv_state, const float *conv_w, const float *conv_b, const float *wx,
                        const float *wdt, int64_t wdt_s0, int64_t wdt_s1, const float *bdt, const float *A_log,
                        const float *Dp, const float *ssm,
                        float *h_out, float *conv_out, float *ssm_out,
                        float *scratch)  /* T B (d + 5D + heads (R + 2N)) floats */
{
    const int64_t M = T * B;
    float *x = scratch, *xz = x + M * d, *y = xz + M * 2 * D, *rest = y + M * D;
    rms_rows(M, d, h, norm_w, eps, x);
    proj_gemv(in_kind, in_groups, M, 2 * D, d, threads, x, d, w_in, s_in, b_in, xz);
    mamba_rows(M, B, D, N, R, K, heads, threads, xz, 2 * D, conv_state, conv_w, conv_b, wx, wdt, wdt_s0, wdt_s1, bdt,
               A_log, Dp, ssm, y, conv_out, ssm_out, rest);           /* token t from the states token t - 1 left */
    proj_gemv(out_kind, out_groups, M, d, D, threads, y, D, w_out, s_out, b_out, h_out);
    for (int64_t i = 0; i < M * d; i++)
        h_out[i] += h[i];
}

/* mamba_block_stack: L such blocks one after another, one token of B rows each (a whole model's blocks in a
 * decoding step: models/stack.py), in one call instead of L. args (L, 37) int64: each layer's mamba_block_tokens
 * arguments in its order as 64-bit words (pointers, integers; eps a float's bits); the ones every layer shares
 * come here: threads, h (B, d) the first layer reads, h_out (B, d) the last one writes, scratch (the largest
 * layer's). Layer l reads the h' layer l - 1 wrote. */
void mamba_block_stack(int64_t L, const int64_t *args, int threads, const float *h, float *h_out, float *scratch)
{
    const int64_t B = args[1], d = args[2];
    float *buf = malloc(2 * B * d * sizeof(float));
    const float *in = h;
    for (int64_t l = 0; l < L; l++) {
        const int64_t *a = args + 37 * l;
        float *out = l == L - 1 ? h_out : buf + (l % 2) * B * d;
#define P(i) ((void *)(intptr_t)a[i])
        mamba_block_tokens(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], threads, in, P(10), f_bits(a[11]), P(12),
                           P(13), P(14), P(15), P(16), P(17), (int)a[18], (int)a[19], a[20], a[21], P(22), P(23),
                           P(24), P(25), P(26), a[27], a[28], P(29), P(30), P(31), P(32), out, P(34), P(35), scratch);
#undef P
        in = out;
    }
    free(buf);
}
