"""The RG-LRU, parallel form: the decayed T x T form per channel, for short T (a reference).

    L[t, s] = sum_{s < r <= t} g_r                 (B, T, S, H, P), the log-decay from token s to token t
    h_t     = sum_{s <= t} exp(L[t, s]) u_s + exp(sum_{r <= t} g_r) h_0

L is a masked cumulative sum, not a difference of cumulative sums: G_t - G_s would cancel catastrophically
when a reset (g = -1000) lies before s.
"""

from __future__ import annotations

import torch

from subquad.ops.common.expo import exp_decay


def parallel_lru(u, g, *, chunk_size=None, initial_state=None):
    T = u.shape[1]
    after = torch.ones(T, T, dtype=torch.bool, device=u.device).tril(-1)     # r > s: g_r counts toward L[., s]
    rep = g[:, :, None].masked_fill(~after[None, :, :, None, None], 0.0)    # (B, R, S, H, P): g_r where r > s
    L = torch.cumsum(rep, dim=1)                                               # (B, T, S, H, P)
    upper = ~torch.ones(T, T, dtype=torch.bool, device=u.device).tril()
    decay = exp_decay(L).masked_fill(upper[None, :, :, None, None], 0.0)
    h = torch.einsum("btshp,bshp->bthp", decay, u)
    if initial_state is not None:
        h = h + exp_decay(torch.cumsum(g, 1)) * initial_state[:, None]
    return h, h[:, -1]
