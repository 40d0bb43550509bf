"""Decayed linear attention, parallel form: the explicit decayed causal mask. O(T^2 K).

    G_t  = sum_{r <= t} g_r                                  (cumulative log-decay)
    D_ts = prod_{r=s+1..t} a_r = exp(G_t - G_s),  s <= t     (0 above the diagonal)
    o_t  = scale * [ sum_{s<=t} (q_t . (D_ts * k_s)) v_s + (q_t * exp(G_t)) S_0 ]
    S_T  = diag(exp(gc_T)) S_0 + sum_s (exp(gc_T - G_s) * k_s) v_s^T

A scalar decay (B, T, H) builds a (T, T) mask per head; a per-key-dim decay
(B, T, H, K) builds (T, T, K). The exponent is masked to -inf above the diagonal
before exp, so only differences <= 0 are ever exponentiated. The reference for
short T.
"""

from __future__ import annotations

import torch


def parallel_decay_attention(q, k, v, g, *, scale, chunk_size=None, initial_state=None):
    sd = g.dtype
    qf, kf, vf = (x.to(sd).transpose(1, 2) for x in (q, k, v))              # (B, H, T, *)
    T = q.shape[1]
    gc = g.cumsum(1).transpose(1, 2)                                          # (B, H, T[, K])
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if g.dim() == 3:                                                         # scalar decay per head
        diff = gc.unsqueeze(-1) - gc.unsqueeze(-2)                             # (B, H, T, S)
        D = torch.exp(diff.masked_fill(~causal, float("-inf")))
        A = (qf @ kf.transpose(-1, -2)) * D
        gck = gc.unsqueeze(-1)                                                 # (B, H, T, 1)
    else:                                                                    # per key dim
        diff = gc.unsqueeze(3) - gc.unsqueeze(2)                               # (B, H, T, S, K)
        D = torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))
        A = torch.einsum("bhtk,bhsk,bhtsk->bhts", qf, kf, D)
        gck = gc
    o = A @ vf                                                               # (B, H, T, V)
    if initial_state is not None:
        o = o + (qf * torch.exp(gck)) @ initial_state
    o = o.transpose(1, 2) * scale
    gc_T = gck[:, :, -1:]                                                      # (B, H, 1, K|1)
    S = (kf * torch.exp(gc_T - gck)).transpose(-1, -2) @ vf                   # (B, H, K, V)
    if initial_state is not None:
        S = S + torch.exp(gc_T).transpose(-1, -2) * initial_state
    return o, S
