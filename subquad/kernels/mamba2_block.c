/* One decoding step of a whole pre-norm Mamba-2 block without an MLP (the mamba2 checkpoints' layer), in one
 * call: the norm, in_proj, the step between the products (mamba2_step.c, its gated norm applied before out_proj),
 * out_proj and the residual.
 *
 *   x  = h / sqrt(mean(h^2) + eps) * norm_w                h (B, d): the residual stream, one token per row
 *   in = x W_in^T + b_in                                   W_in (2 Dn + 2 G N + H, d), b_in or NULL
 *   y  = mamba2_step(in, ...)                              (B, Dn), the new conv state and S (mamba2_step.c)
 *   h' = h + y W_out^T + b_out                             W_out (d, Dn), b_out (d,) or NULL
 * Each W float32 row- or column-major, int8 or int4, as its kind says (mamba_block.c); B <= 16.
 * mamba2_block_tokens runs T consecutive tokens of B sequences at once (T = 1 a decoding step, T > 1 a
 * speculative verification), rows t-major, as mamba_block.c's mamba_block_tokens: the products over all T B rows,
 * the step token by token from the states the token before left (mamba2_step.c's mamba2_rows), every token's
 * states written out: conv_out (T, B, K-1, C), S_out (T, B, H, N, P).
 * ops/decay/fused_block.py is the Python side;
 * the block's own PyTorch forward is the reference. */

#include "mamba2_step.c"
#include "mlp_block.c"

void mamba2_block_tokens(int64_t T, int64_t B, int64_t d, int64_t Dn, int64_t G, int64_t N, int64_t H, int64_t P,
                         int64_t K, int threads, const float *h, const float *norm_w, float eps, const void *w_in,
                         const void *s_in, const float *b_in, const void *w_out, const void *s_out,
                         const float *b_out, int in_kind, int out_kind, int64_t in_groups, int64_t out_groups,
                         const float *conv_state, const float *conv_w, const float *conv_b, const float *dt_bias,
                         const float *A_log, const float *Dp, float dt_lo, float dt_hi, const float *S,
                         const float *gnorm_w, int64_t norm_group, float geps,
                         float *h_out, float *conv_out, float *S_out,
                         float *scratch)   /* T B (d + W + Dn + Dn / norm_group + Dn + 2GN) floats */
{
    const int64_t W = 2 * Dn + 2 * G * N + H, M = T * B;
    float *x = scratch, *in = x + M * d, *y = in + M * W, *inv = y + M * Dn, *rest = inv + M * (Dn / norm_group);
    rms_rows(M, d, h, norm_w, eps, x);
    proj_gemv(in_kind, in_groups, M, W, d, threads, x, d, w_in, s_in, b_in, in);
    mamba2_rows(M, B, Dn, G, N, H, P, K, threads, in, W, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, dt_lo, dt_hi,
                S, gnorm_w, norm_group, geps, 0, inv, y, conv_out, S_out, rest);
    proj_gemv(out_kind, out_groups, M, d, Dn, threads, y, Dn, w_out, s_out, b_out, h_out);
    for (int64_t i = 0; i < M * d; i++)
        h_out[i] += h[i];
}

/* mamba2_block_stack: L such blocks one after another, one token of B rows each, in one call (as mamba_block.c's
 * mamba_block_stack): args (L, STACK_ROW) int64, each layer's mamba2_block_tokens arguments as 64-bit words (eps,
 * dt's limits and the gated norm's eps floats' bits), then 1 where the block has an MLP (Bamba's, Nemotron-H's)
 * and mlp_block_rows' arguments for it (its norm's eps as bits), else 0; threads, h, h_out and scratch shared
 * (scratch: the most any layer's mixer or MLP needs). */
#define MIXER_ARGS 39
#define STACK_ROW (MIXER_ARGS + 1 + 25)

/* One layer of such a table: the block's mixer half from `in`, then its MLP where it has one (writing `mid`
 * between them), into `out`; layer_stack.c runs it beside attention layers. */
static void mamba2_stack_layer(const int64_t *a, int threads, const float *in, float *mid, float *out,
                               float *scratch)
{
    if (!a[MIXER_ARGS])
        mid = out;
#define P(i) ((void *)(intptr_t)a[i])
    mamba2_block_tokens(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], threads, in, P(11), f_bits(a[12]),
                        P(13), P(14), P(15), P(16), P(17), P(18), (int)a[19], (int)a[20], a[21], a[22], P(23),
                        P(24), P(25), P(26), P(27), P(28), f_bits(a[29]), f_bits(a[30]), P(31), P(32), a[33],
                        f_bits(a[34]), mid, P(36), P(37), scratch);
#undef P
    if (a[MIXER_ARGS])
        mlp_block_words(a + MIXER_ARGS + 1, threads, mid, out, scratch);
}

void mamba2_block_stack(int64_t L, const int64_t *args, int threads, const float *h, float *h_out, float *scratch)
{
    const int64_t B = args[1], d = args[2];
    float *buf = malloc(3 * B * d * sizeof(float));
    const float *in = h;
    for (int64_t l = 0; l < L; l++) {
        float *out = l == L - 1 ? h_out : buf + (l % 2) * B * d;
        mamba2_stack_layer(args + STACK_ROW * l, threads, in, buf + 2 * B * d, out, scratch);
        in = out;
    }
    free(buf);
}
