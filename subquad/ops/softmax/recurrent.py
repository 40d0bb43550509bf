"""Softmax attention, recurrent form: decoding with a KV cache, one token at a time.

    cache <- cache + (k_t, v_t)            (the last W only, with a window)
    o_t    = softmax(scale * q_t K_cache^T) V_cache

Each step costs O(L) in the cache length L: the cost linear attention removes.
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import state_dtype
from subquad.ops.softmax.cache import KVCache
from subquad.ops.common.precision import amp_op
from subquad.ops.common.varlen import varlen
from subquad.ops.softmax.ragged import takes_ragged_caches
from subquad.ops.softmax.prepare import as_cache, check_common, check_flags


def softmax_attention_step(q_t, k_t, v_t, cache: KVCache, *, scale: float) -> torch.Tensor:
    """One decoding step: q_t, k_t (B, H, K), v_t (B, H, V) -> o_t (B, H, V); appends (k_t, v_t) to ``cache``.

    The query sees the cached keys (the last W with a window) and its own key.
    """
    sd = state_dtype(q_t.dtype)                                   # scores and sums in float32 for 16-bit
    kh = cache.k.transpose(1, 2).to(sd)                           # (B, H, L, K)
    vh = cache.v.transpose(1, 2).to(sd)                           # (B, H, L, V)
    qf, kf, vf = q_t.to(sd), k_t.to(sd), v_t.to(sd)
    s_past = (qf.unsqueeze(-2) @ kh.transpose(-1, -2)).squeeze(-2) * scale    # (B, H, L)
    s_self = (qf * kf).sum(-1, keepdim=True) * scale                          # (B, H, 1)
    p = torch.softmax(torch.cat([s_past, s_self], -1), dim=-1)
    o = (p[..., :-1].unsqueeze(-2) @ vh).squeeze(-2) + p[..., -1:] * vf
    cache.append(k_t.unsqueeze(1), v_t.unsqueeze(1))
    return o.to(q_t.dtype)


@amp_op()
@varlen("q", "k", "v", states="caches")
@takes_ragged_caches
def recurrent_softmax_attention(q, k, v, *, causal=True, window=None, chunk_size=64, scale=None,
                                initial_state=None, output_final_state=False, return_lse=False):
    """Token-by-token KV-cache attention; same signature as ``softmax_attention``."""

    check_flags(causal, output_final_state, return_lse)
    if not causal:
        raise ValueError("mode='recurrent' is causal decoding; causal=False has no recurrent form")
    if return_lse:
        raise ValueError("return_lse=True is only available in mode='chunk'")
    scale = check_common(q, k, v, causal, window, scale, chunk_size)
    B, T, H, K = q.shape
    cache = as_cache(initial_state, q, v, window)
    if cache is not None and cache.window != window and cache.pad is None:
        # the call's window decides what a query sees, as in the other forms: the cache's keys kept under it (a
        # cache trimmed or reallocated before the first append, so the caller's buffers are never written)
        cache = KVCache(cache.k, cache.v, window=window, seen=cache.seen)
    cache = KVCache.empty(B, H, K, v.shape[-1], dtype=q.dtype, device=q.device, window=window,
                          capacity=max(T + (len(cache) if cache else 0), 1)) if cache is None else cache.clone()
    # With autograd, keep every step's keys as separate tensors (no in-place buffer writes).
    graph = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, cache.k))
    outs = []
    for t in range(T):
        if graph:  # an exact-size cache makes append reallocate: no in-place write autograd saw
            cache = KVCache(cache.k, cache.v, window=window, seen=cache.seen)
        outs.append(softmax_attention_step(q[:, t], k[:, t], v[:, t], cache, scale=scale))
    o = torch.stack(outs, dim=1)
    return o, (cache if output_final_state else None)
