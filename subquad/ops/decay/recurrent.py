"""Decayed linear attention, recurrent form: the token loop (the spec). O(T K V).

    S_t = exp(g_t) * S_{t-1} + k_t v_t^T      (exp(g_t) a scalar per head, or a K-vector scaling rows)
    o_t = scale * q_t^T S_t
"""

from __future__ import annotations

import torch

from subquad.ops.common.expo import exp_decay


def recurrent_decay_attention(q, k, v, g, *, scale, chunk_size=None, initial_state=None):
    B, T, H, K = q.shape
    sd = g.dtype
    S = torch.zeros(B, H, K, v.shape[-1], dtype=sd, device=q.device) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        a = exp_decay(g[:, t])                                               # (B, H) or (B, H, K)
        a = a[..., None, None] if a.dim() == 2 else a[..., None]
        S = a * S + k[:, t].to(sd).unsqueeze(-1) * v[:, t].to(sd).unsqueeze(-2)
        outs.append((q[:, t].to(sd).unsqueeze(-2) @ S).squeeze(-2) * scale)
    return torch.stack(outs, 1), S
