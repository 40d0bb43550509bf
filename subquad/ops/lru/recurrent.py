"""The RG-LRU, recurrent form: the token loop (the spec). The op passes u_t = sqrt(1 - a_t^2) x_t.

    h_t = exp(g_t) * h_{t-1} + u_t,    o_t = h_t           every tensor (B, T, H, P), h (B, H, P)
"""

from __future__ import annotations

import torch

from subquad.ops.common.expo import exp_decay


def recurrent_lru(u, g, *, chunk_size=None, initial_state=None):
    B, T, H, P = u.shape
    h = u.new_zeros(B, H, P) if initial_state is None else initial_state
    a = exp_decay(g)
    hs = []
    for t in range(T):
        h = torch.addcmul(u[:, t], a[:, t], h)                                # a_t h + u_t
        hs.append(h)
    return torch.stack(hs, 1), h
