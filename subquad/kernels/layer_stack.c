/* A decoding token's run of consecutive pre-norm blocks - Mamba-2 blocks and softmax attention blocks mixed, each
 * with a SwiGLU / ReLU^2 MLP or none (a hybrid's: Bamba's, Granite 4's, Nemotron-H's; a transformer's) - in one
 * call: each layer the same C functions its block's own kept calls run (mamba2_block.c, attention_step.c,
 * mlp_block.c), so the result is the blocks' one by one, bit for bit. The attention layer's append to its KV cache
 * is done here too: the caller opens the cache's next column (ops/softmax/cache.py's ``KVCache.opened``) and
 * this writes the token's key and value there before attending.
 *
 * layer_stack   args (L, LAYER_ROW) int64: per layer a kind word, then
 *               kind 0  a Mamba-2 layer: mamba2_block.c's stack row (STACK_ROW words)
 *               kind 1  an attention layer: attn_in_rows' 37 arguments (the rotary base a double's bits, the
 *                       eps floats' bits; threads, h, q, gate, k, v and scratch unused), attn_out_rows' 23 (L: the
 *                       opened cache's length, kc / kb / vc / vb its buffers at its first entry and their row
 *                       strides, start a ragged cache's first column per row or NULL, the scale's bits; the rest
 *                       unused), the position of every row where attn_in_rows' pos is NULL, then 1 and
 *                       mlp_block_rows' words (mlp_block.c's mlp_block_words) or 0
 *               threads, h (B, d), h_out (B, d) and scratch shared (scratch: the most any layer needs; an
 *               attention layer 2 B H K + 2 B Hk K + B max(d + 2 H K, H (K + L)) floats).
 * models/layer_stack.py is the Python side; the blocks one by one are the reference. */

#include "mamba2_block.c"
#include "attention_step.c"

#define ATTN_IN 37
#define ATTN_OUT 23
#define ATTN_ARGS (ATTN_IN + ATTN_OUT + 1)
#define LAYER_ROW (1 + ATTN_ARGS + 1 + 25)

static void attention_stack_layer(const int64_t *a, int threads, const float *in, float *mid, float *out,
                                  float *scratch)
{
    const int64_t *o = a + ATTN_IN;
    const int64_t B = a[0], d = a[1], H = a[2], Hk = a[3], K = a[4], L = o[5], kb = o[9], vb = o[11];
    const int gated = (int)a[7];
    float *q = scratch, *gate = q + B * H * K, *k = gate + B * H * K, *v = k + B * Hk * K, *rest = v + B * Hk * K;
    float *kc = (float *)(intptr_t)o[8], *vc = (float *)(intptr_t)o[10];
    int64_t same[16];                                   /* B <= 16 (layers/linear.py's C_ROWS) */
    const int64_t *pos = (const int64_t *)(intptr_t)a[31];
    if (!pos) {
        for (int64_t b = 0; b < B; b++)
            same[b] = a[ATTN_IN + ATTN_OUT];
        pos = same;
    }
    if (!a[ATTN_ARGS])
        mid = out;
#define P(i) ((void *)(intptr_t)a[i])
    attn_in_rows(B, d, H, Hk, K, a[5], d_bits(a[6]), gated, threads, in, P(10), f_bits(a[11]),
                 P(12), P(13), P(14), (int)a[15], a[16], P(17), P(18), P(19), (int)a[20], a[21],
                 P(22), P(23), P(24), (int)a[25], a[26], P(27), f_bits(a[28]), P(29), f_bits(a[30]),
                 pos, q, gated ? gate : NULL, k, v, rest);
#undef P
    for (int64_t b = 0; b < B; b++) {                   /* the cache's append: its opened last column */
        memcpy(kc + b * kb + (L - 1) * Hk * K, k + b * Hk * K, Hk * K * sizeof(float));
        memcpy(vc + b * vb + (L - 1) * Hk * K, v + b * Hk * K, Hk * K * sizeof(float));
    }
#define P(i) ((void *)(intptr_t)o[i])
    attn_out_rows(B, d, H, Hk, K, L, threads, q, kc, kb, vc, vb, P(12), f_bits(o[13]), gated ? gate : NULL, in,
                  P(16), P(17), P(18), (int)o[19], o[20], mid, rest);
#undef P
    if (a[ATTN_ARGS])
        mlp_block_words(a + ATTN_ARGS + 1, threads, mid, out, scratch);
}

void layer_stack(int64_t L, int64_t B, int64_t d, const int64_t *args, int threads, const float *h, float *h_out,
                 float *scratch)
{
    float *buf = malloc(3 * B * d * sizeof(float));
    const float *in = h;
    for (int64_t l = 0; l < L; l++) {
        const int64_t *a = args + LAYER_ROW * l;
        float *out = l == L - 1 ? h_out : buf + (l % 2) * B * d, *mid = buf + 2 * B * d;
        if (a[0] == 0)
            mamba2_stack_layer(a + 1, threads, in, mid, out, scratch);
        else
            attention_stack_layer(a + 1, threads, in, mid, out, scratch);
        in = out;
    }
    free(buf);
}

/* head_rows: a decoding token's end, logits = rmsnorm(h) W^T + b for B rows (the model's final norm and its head's
 * product in one call: models/token_step.py). W float32 row- or column-major or quantised as its kind says (qgemv.c's
 * proj_gemv); scratch B d floats. */
void head_rows(int64_t B, int64_t d, int64_t V, int threads, const float *h, const float *norm_w, float eps,
               const void *w, const void *s, const float *b, int kind, int64_t groups, float *logits,
               float *scratch)
{
    rms_rows(B, d, h, norm_w, eps, scratch);
    proj_gemv(kind, groups, B, V, d, threads, scratch, d, w, s, b, logits);
}
