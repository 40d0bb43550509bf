"""Softmax attention, the quadratic baseline, in the same three forms as every other op.

    o_t = sum_j softmax_j(scale * q_t . k_j) v_j   over the visible keys j:
          j <= t when causal, and t - j <= W with a sliding window W

Its "state" is the ``KVCache`` of every key and value seen (the last W with a
window), which grows with T: the thing linear attention's fixed state replaces.
Shapes: q, k (B, T, H, K); v, o (B, T, H, V); lse (B, T, H).

Forms: ``parallel`` (SDPA; ``naive_softmax_attention`` is the written-out T x T
spec), ``recurrent`` (KV-cache decoding), ``chunk`` (blockwise online softmax,
never T x T; ``return_lse=True`` adds the log-sum-exp for exact merging).

Example:
    >>> import torch
    >>> from subquad.ops import softmax_attention
    >>> q, k, v = (torch.randn(1, 50, 2, 16) for _ in range(3))
    >>> o, cache = softmax_attention(q, k, v, mode="chunk", window=8, output_final_state=True)
    >>> o.shape, cache.k.shape
    (torch.Size([1, 50, 2, 16]), torch.Size([1, 8, 2, 16]))
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import check_chunk_size, check_mode
from subquad.ops.common.precision import causal_guard
from subquad.ops.softmax.cache import KVCache
from subquad.ops.softmax.prepare import as_cache, check_common, check_flags, finish, prepare
from subquad.ops.softmax.chunk import blockwise_softmax_attention, chunk_softmax_attention
from subquad.ops.softmax.naive import naive_softmax_attention
from subquad.ops.softmax.parallel import parallel_softmax_attention
from subquad.ops.softmax.recurrent import recurrent_softmax_attention, softmax_attention_step
from subquad.ops.common.varlen import varlen


_FORMS = {
    "parallel": parallel_softmax_attention,
    "recurrent": recurrent_softmax_attention,
    "chunk": chunk_softmax_attention,
}


@varlen("q", "k", "v", states="caches")
def softmax_attention(q, k, v, *, causal=True, window=None, mode="chunk", chunk_size=64, scale=None,
                      initial_state=None, output_final_state=False, return_lse=False):
    """Softmax attention.

    Args:
        q, k: (B, T, H, K); v: (B, T, H, V).
        causal: mask future keys.
        window: sliding window W (a query sees itself and the W keys before it); needs causal.
        mode: "parallel" (SDPA), "recurrent" (KV-cache loop), "chunk" (blockwise online softmax).
        chunk_size: block size C of mode="chunk".
        scale: on the scores; None means K ** -0.5.
        initial_state: a KVCache, or a pair (k_cache, v_cache), of earlier tokens (causal only).
        output_final_state: also return the KVCache after the last token.
        return_lse: mode="chunk" only: also return lse (B, T, H) = log sum_j exp(scale q_t . k_j).
    Returns:
        (o, final_state) or, with return_lse, (o, final_state, lse).
    """
    check_mode(mode)
    check_chunk_size(chunk_size)
    check_flags(causal, output_final_state, return_lse)

    def run(form):
        return _FORMS[form](q, k, v, causal=causal, window=window, scale=scale, chunk_size=chunk_size,
                            initial_state=initial_state, output_final_state=output_final_state,
                            return_lse=return_lse)

    out = run(mode)
    if mode == "recurrent" or not causal or return_lse:
        return out
    # non-finite input stays causal: a masked weight of 0 times a NaN value would reach earlier queries
    return causal_guard(out, out[0], lambda: run("recurrent"), q.shape[1])


__all__ = ["KVCache", "softmax_attention", "naive_softmax_attention", "parallel_softmax_attention",
           "recurrent_softmax_attention", "chunk_softmax_attention", "softmax_attention_step",
           "blockwise_softmax_attention"]
