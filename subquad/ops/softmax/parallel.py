"""Softmax attention, parallel form through ``F.scaled_dot_product_attention`` (the fast O(T^2) path).

Without a cache or window it uses SDPA's own causal kernel; with a cache or a
window it passes an explicit (T, L) boolean mask.
"""

from __future__ import annotations

import torch.nn.functional as F

from subquad.ops.softmax.naive import visible_mask


def parallel_softmax_attention(q, k, v, *, causal=True, window=None, scale=None, chunk_size=None,
                               initial_state=None, output_final_state=False, return_lse=False):
    """SDPA softmax attention; same signature as ``softmax_attention``."""
    from subquad.ops.softmax import _prepare, _finish

    if return_lse:
        raise ValueError("return_lse=True is not available in mode='parallel' (SDPA does not expose it); use mode='chunk'")
    scale, cache, kk, vv, q_start = _prepare(q, k, v, causal, window, scale, chunk_size, initial_state)
    qh, kh, vh = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
    T, L = q.shape[1], kk.shape[1]
    if window is None and (not causal or L == T):
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    else:
        m = visible_mask(T, L, causal=causal, window=window, q_start=q_start, k_start=q_start - len(cache) if cache is not None else 0, device=q.device)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m, scale=scale)
    return _finish(o.transpose(1, 2), None, cache, k, v, window, output_final_state, False)
