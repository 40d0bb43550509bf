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

from subquad.ops.common.checks import check_bool, check_chunk_size, check_mode, check_qkv, default_scale, describe
from subquad.ops.common.precision import causal_guard
from subquad.ops.softmax.cache import KVCache
from subquad.ops.softmax.chunk import blockwise_softmax_attention, chunk_softmax_attention
from subquad.ops.softmax.naive import naive_softmax_attention
from subquad.ops.softmax.parallel import parallel_softmax_attention
from subquad.ops.softmax.recurrent import recurrent_softmax_attention, softmax_attention_step
from subquad.ops.common.varlen import varlen


def check_flags(causal, output_final_state, return_lse):
    check_bool("causal", causal)
    check_bool("output_final_state", output_final_state)
    check_bool("return_lse", return_lse)


def _check_common(q, k, v, causal, window, scale, chunk_size):
    check_qkv(q, k, v, same_length=causal)  # non-causal (cross) attention may have L != T keys
    if q.shape[1] < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {tuple(q.shape)}")
    check_chunk_size(chunk_size)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be a non-negative int or None, got {describe(window)}")
        if not causal:
            raise ValueError("window is a causal sliding window; it needs causal=True")
    return default_scale(scale, q.shape[-1])


def _as_cache(initial_state, q, v, window):
    """initial_state may be a KVCache or a pair (k (B, L, H, K), v (B, L, H, V))."""
    if initial_state is None:
        return None
    if isinstance(initial_state, KVCache):
        cache = initial_state
    elif isinstance(initial_state, (tuple, list)) and len(initial_state) == 2:
        if not all(isinstance(t, torch.Tensor) for t in initial_state):
            raise ValueError("initial_state must be a KVCache or a pair of tensors (k (B, L, H, K), v (B, L, H, V)), "
                             f"got a pair of {type(initial_state[0]).__name__} and {type(initial_state[1]).__name__}")
        try:
            cache = KVCache(*initial_state, window=window)
        except ValueError as e:
            raise ValueError(f"initial_state: {e}") from None
    else:
        raise ValueError(f"initial_state must be a KVCache or a pair (k, v), got {describe(initial_state)}")
    ck, cv = cache.k, cache.v
    if ck.shape[0] != q.shape[0] or ck.shape[2:] != q.shape[2:] or cv.shape[2:] != v.shape[2:]:
        raise ValueError(f"initial_state's keys/values must be (B, L, H, K)/(B, L, H, V) matching q {tuple(q.shape)} "
                         f"and v {tuple(v.shape)}, got {tuple(ck.shape)} and {tuple(cv.shape)}")
    for name, t in (("keys", ck), ("values", cv)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"initial_state's {name} must have q's dtype and device ({q.dtype}, {q.device}), got "
                             f"({t.dtype}, {t.device})")
    return cache


def _prepare(q, k, v, causal, window, scale, chunk_size, initial_state):
    """Checks; returns scale, the cache, keys and values including the cache, and the first query's position."""
    scale = _check_common(q, k, v, causal, window, scale, chunk_size)
    if initial_state is not None and not causal:
        raise ValueError("initial_state (a KV cache) needs causal=True: a non-causal query sees future keys no cache holds")
    cache = _as_cache(initial_state, q, v, window)
    if cache is None or len(cache) == 0:
        return scale, cache, k, v, (cache.seen if cache is not None else 0)
    return scale, cache, torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1), cache.seen


def _finish(o, lse, cache, k, v, window, output_final_state, return_lse):
    state = None
    if output_final_state:
        if cache is None:
            state = KVCache(k, v, window=window)
        else:
            state = KVCache(torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1), window=window,
                            seen=cache.seen + k.shape[1])
    return (o, state, lse) if return_lse else (o, state)


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
