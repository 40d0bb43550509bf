/* The short causal depthwise convolution over whole prompts, silu after it where asked (layers/conv.py states the
 * math; its torch form is the reference). float32.
 *
 *   y_t[d] = b[d] + sum_i w[i][d] x_{t-W+1+i}[d]      before the row's first token x is its tail (W-1, D), or 0
 *   y_t    = silu(y_t)                                where asked (Mamba's, Mamba-2's: no second pass over y)
 *   tail'  = the row's last W-1 inputs                the decoding state after the prompt
 *
 * x (Bz, T, D) is read through its row and token strides (unit stride within a token: in_proj's output split
 * without a copy); w (W, D) taps-major; y (Bz, T, D), tail and tail' (Bz, W-1, D) contiguous. Packed prompts
 * (seg, Bz + 1 cumulative lengths, or NULL): row b is tokens seg[b] .. seg[b + 1] of x's and y's one row, from
 * tail row b, so a packed batch is one call. Work items are (row, CB channels), handed out one at a time across
 * one OpenMP team (packed prompts of unequal lengths are unequal items);
 * each token's taps are summed in the torch form's order (bias and the last tap first). */

#include "common.h"

#define CB 256

void short_conv(int64_t Bz, int64_t T, int64_t D, int64_t W, int threads, const float *x, int64_t x_b, int64_t x_t,
                const float *w, const float *bias, const float *tail, float *y, float *tail_out, int silu,
                const int64_t *seg)
{
    const int64_t blocks = (D + CB - 1) / CB, items = Bz * blocks;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / blocks, c0 = it % blocks * CB, nc = D - c0 < CB ? D - c0 : CB;
        const int64_t t0 = seg ? seg[b] : 0, Tb = seg ? seg[b + 1] - seg[b] : T, r = seg ? 0 : b;
        const float *xb = x + r * x_b + t0 * x_t + c0, *tb = tail ? tail + b * (W - 1) * D + c0 : NULL;
        const float *wl = w + (W - 1) * D + c0;
        float *yb = y + (r * T + t0) * D + c0, acc[CB];
        for (int64_t t = 0; t < Tb; t++) {
            const float *xt = xb + t * x_t;
            for (int64_t c = 0; c < nc; c++)
                acc[c] = (bias ? bias[c0 + c] : 0.0f) + wl[c] * xt[c];
            for (int64_t i = 0; i < W - 1; i++) {
                const int64_t s = t - (W - 1) + i;                 /* the token tap i reads: < 0 is the tail */
                const float *src = s >= 0 ? xb + s * x_t : (tb ? tb + (W - 1 + s) * D : NULL);
                if (!src)
                    continue;
                const float *wi = w + i * D + c0;
                for (int64_t c = 0; c < nc; c++)
                    acc[c] += wi[c] * src[c];
            }
            if (silu)
                silu_n(acc, nc);
            memcpy(yb + t * D, acc, sizeof(float) * nc);
        }
        for (int64_t j = 0; j < W - 1; j++) {                      /* the last W-1 inputs, older ones first */
            const int64_t s = Tb - (W - 1) + j;
            const float *src = s >= 0 ? xb + s * x_t : (tb ? tb + (W - 1 + s) * D : NULL);
            float *dst = tail_out + (b * (W - 1) + j) * D + c0;
            if (src)
                memcpy(dst, src, sizeof(float) * nc);
            else
                memset(dst, 0, sizeof(float) * nc);
        }
    }
}
