"""Softmax attention, parallel form through ``F.scaled_dot_product_attention`` (the fast O(T^2) path).

Without a cache or window it uses SDPA's own causal kernel; with a cache it passes an
explicit (T, L) boolean mask; with a sliding window W it runs query blocks against the
keys they can see, so time and memory are O(T W), never T x T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from subquad.ops.common.precision import amp_op
from subquad.ops.common.varlen import varlen
from subquad.ops.softmax.ragged import takes_ragged_caches
from subquad.ops.common.routes import FLASH_16BIT
from subquad.ops.softmax.prepare import check_flags, finish, prepare, visible_mask


@amp_op()
@varlen("q", "k", "v", states="caches")
@takes_ragged_caches
def parallel_softmax_attention(q, k, v, *, causal=True, window=None, chunk_size=64, scale=None,
                               initial_state=None, output_final_state=False, return_lse=False):
    """SDPA softmax attention; same signature as ``softmax_attention``."""

    check_flags(causal, output_final_state, return_lse)
    if return_lse:
        raise ValueError("return_lse=True is not available in mode='parallel' (SDPA does not expose it); use mode='chunk'")
    scale, cache, kk, vv, q_start = prepare(q, k, v, causal, window, scale, chunk_size, initial_state)
    qh, kh, vh = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
    T, L = q.shape[1], kk.shape[1]
    k_start = q_start - len(cache) if cache is not None else 0
    if window is None and (not causal or L == T):
        o = _sdpa(qh, kh, vh, is_causal=causal, scale=scale)
    elif window is not None:
        o = _windowed(qh, kh, vh, scale, window, q_start, k_start)
    else:
        m = visible_mask(T, L, causal=causal, window=window, q_start=q_start, k_start=k_start, device=q.device)
        o = _sdpa(qh, kh, vh, attn_mask=m, scale=scale)
    return finish(o.transpose(1, 2), None, cache, k, v, window, output_final_state, False)


def _sdpa(qh, kh, vh, scale, **kw):
    """SDPA with the value head dim padded to the key's (or the key's to the value's) when they differ:
    CPU's flash kernel needs them equal and the fallback is the T x T math path, which materialises the
    scores (multi-head latent attention's K 80, V 64 hit it). Zero columns change no score and no output.
    For 16-bit inputs only from FLASH_16BIT score entries on: the flash kernel rounds the probabilities to
    16 bits (0.004 off at K 8, V 4 in tests/ops/test_precision.py) where the math path keeps them in
    float32, but the math path's T x T scores cost several times the time at long T (benchmarks/RESULTS.md,
    "SDPA with K != V") - and flash's rounding is what attention with K = V gets in 16 bits anyway. A scale
    <= 0 (0: uniform attention over the visible keys) is folded into the queries."""
    if scale <= 0:          # SDPA's causal kernel scales its -inf mask too: 0 or -|s| times -inf is NaN or +inf
        qh, scale = qh * scale, 1.0
    K, V = qh.shape[-1], vh.shape[-1]
    small = qh.shape[-2] * kh.shape[-2] < FLASH_16BIT
    if K == V or (qh.dtype in (torch.float16, torch.bfloat16) and small):
        return F.scaled_dot_product_attention(qh, kh, vh, scale=scale, **kw)
    if V < K:
        return F.scaled_dot_product_attention(qh, kh, F.pad(vh, (0, K - V)), scale=scale, **kw)[..., :V]
    qh, kh = F.pad(qh, (0, V - K)), F.pad(kh, (0, V - K))
    return F.scaled_dot_product_attention(qh, kh, vh, scale=scale, **kw)


def _windowed(qh, kh, vh, scale, window, q_start, k_start):
    """Sliding-window SDPA in O(T W) time and memory: query blocks of max(64, W) rows, each against the
    keys its window can reach (at most block + W of them) with a (block, block + W) mask."""
    T, L = qh.shape[2], kh.shape[2]
    Cq = max(64, window)
    outs = []
    for qs in range(0, T, Cq):
        qe = min(qs + Cq, T)
        ks = max(0, q_start + qs - window - k_start)             # first key the block's first query sees
        ke = min(L, q_start + qe - k_start)                      # one past the last query's own key
        m = visible_mask(qe - qs, ke - ks, causal=True, window=window, q_start=q_start + qs,
                         k_start=k_start + ks, device=qh.device)
        outs.append(_sdpa(qh[:, :, qs:qe], kh[:, :, ks:ke], vh[:, :, ks:ke], attn_mask=m, scale=scale))
    return torch.cat(outs, 2)
