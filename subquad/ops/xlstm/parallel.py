"""The mLSTM, parallel form: the stabilised T x T form (Beck et al. 2024, appendix "parallel formulation"),
from an initial state (C_0, n_0, m_0). With L[t, s] = sum_{s < r <= t} g_r (-inf for s > t) and b_t = sum_{r <= t} g_r:

    log D[t, s] = L[t, s] + i_s                                   the write of token s as seen at t
    m_t         = max(b_t + m_0, max_{s <= t} log D[t, s])       = the recurrent form's m_t
    w_t         = exp(b_t + m_0 - m_t)                            the initial state's weight
    S[t, s]     = (s q_t . k_s) exp(log D[t, s] - m_t)
    h_t         = (w_t (s q_t)^T C_0 + sum_s S[t, s] v_s) / (max(|w_t (s q_t)^T n_0 + sum_s S[t, s]|, exp(-m_t)) + eps)

and the final state from the last row: m_T, C_T = w_T C_0 + sum_s exp(log D[T, s] - m_T) k_s v_s^T, n_T likewise.
L is a masked cumulative sum (``segsum``), not b_t - b_s, which would lose digits under strong forget gates.
O(T^2): the reference for short T.
"""

from __future__ import annotations

import torch


def segsum(g):
    """L[..., t, s] = sum_{s < r <= t} g[..., r] for s <= t, -inf above the diagonal; g (..., T) -> (..., T, T)."""
    T = g.shape[-1]
    below = torch.ones(T, T, dtype=torch.bool, device=g.device).tril(-1)              # r > s
    L = torch.cumsum(g.unsqueeze(-1).expand(*g.shape, T).masked_fill(~below, 0.0), dim=-2)
    return L.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=g.device).tril(), float("-inf"))


def mlstm_parallel(q, k, v, g, i, *, scale, eps, chunk_size=None, initial_state):
    C0, n0, m0 = initial_state
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                                  # (B, H, T, .)
    g, i = g.transpose(1, 2), i.transpose(1, 2)                                       # (B, H, T)
    logD = segsum(g) + i.unsqueeze(-2)                                                # (B, H, T, S)
    inter = torch.cumsum(g, -1) + m0.unsqueeze(-1)                                    # (B, H, T)
    m = torch.maximum(inter, logD.amax(-1)).detach()                                 # a constant to autograd
    D = torch.exp(logD - m.unsqueeze(-1))
    w = torch.exp(inter - m).unsqueeze(-1)                                            # (B, H, T, 1)
    qs = q * scale
    S = (qs @ k.transpose(-1, -2)) * D
    num = w * (qs @ C0) + S @ v
    den = torch.maximum((w * (qs @ n0.unsqueeze(-1)) + S.sum(-1, keepdim=True)).abs(), torch.exp(-m).unsqueeze(-1))
    h = num / (den + eps)
    mT = m[..., -1]
    last = torch.exp(logD[..., -1, :] - mT.unsqueeze(-1)).unsqueeze(-1) * k          # (B, H, T, K)
    wT = w[..., -1, :].unsqueeze(-1)                                                  # (B, H, 1, 1)
    C = wT * C0 + last.transpose(-1, -2) @ v
    n = wT[..., 0] * n0 + last.sum(-2)
    return h.transpose(1, 2), (C, n, mT)
