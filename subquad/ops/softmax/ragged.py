"""Softmax attention over a ragged KV cache: a batch of sequences of different lengths, left-padded
(``KVCache.stack``), as batched decoding after a packed prefill holds it.

    s_btj = scale * q_bt . k_bj,   visible iff  causal / window in columns  and  column j of row b is
    not padding;   o_bt = sum_j softmax_j(s_btj) v_bj,   lse_bt = log sum_j exp(s_btj)

One route for every form (``takes_ragged_caches`` sends each form here when its cache is ragged):
the scores are written out, T x (L + T) per row - a decoding step is T = 1. Computed in the state's
precision (float32 for 16-bit inputs).
"""

from __future__ import annotations

import functools

import torch

from subquad.ops.common.checks import state_dtype
from subquad.ops.softmax.prepare import check_common, check_flags, check_window, visible_mask


def ragged_attention(q, k, v, cache, *, causal=True, window=None, chunk_size=64, scale=None, output_final_state=False,
                     return_lse=False, **_):
    from subquad.ops.softmax.cache import KVCache

    check_flags(causal, output_final_state, return_lse)
    scale = check_common(q, k, v, causal, window, scale, chunk_size)
    if not causal:
        raise ValueError("a KV cache (initial_state) needs causal=True")
    check_window(cache, window)
    B, T = q.shape[:2]
    if cache.k.shape[0] != B or cache.k.shape[2:] != k.shape[2:]:
        raise ValueError(f"initial_state keys must be (B={B}, L, H, K) like k {tuple(k.shape)}, got "
                         f"{tuple(cache.k.shape)}")
    if cache.k.dtype != q.dtype or cache.k.device != q.device:
        raise ValueError(f"initial_state must have q's dtype and device ({q.dtype}, {q.device}), got "
                         f"({cache.k.dtype}, {cache.k.device})")
    sd = state_dtype(q.dtype)
    kk, vv = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
    L = kk.shape[1]
    vis = visible_mask(T, L, causal=True, window=window, q_start=cache.seen, k_start=cache.offset, device=q.device)
    valid = torch.cat([cache.key_mask(), torch.ones(B, T, dtype=torch.bool, device=q.device)], 1)   # (B, L)
    m = vis.unsqueeze(0).unsqueeze(0) & valid[:, None, None, :]                                    # (B, 1, T, L)
    s = torch.einsum("bthk,blhk->bhtl", q.to(sd), kk.to(sd)) * scale
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, -1)                                                                   # (B, H, T)
    o = torch.einsum("bhtl,blhv->bthv", torch.exp(s - lse.unsqueeze(-1)), vv.to(sd)).to(q.dtype)
    final = None
    if output_final_state:
        final = KVCache(kk, vv, window=window, seen=cache.seen + T, pad=cache.pad, row_seen=cache.row_seen + T)
    return (o, final, lse.transpose(1, 2)) if return_lse else (o, final)


def takes_ragged_caches(form):
    """Send a form's call with a ragged cache (``KVCache.ragged``) to ``ragged_attention``."""
    @functools.wraps(form)
    def run(q, k, v, **kw):
        cache = kw.get("initial_state")
        if cache is not None and getattr(cache, "ragged", False):
            return ragged_attention(q, k, v, cache, **kw)
        return form(q, k, v, **kw)
    return run
