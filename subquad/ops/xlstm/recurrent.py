"""The mLSTM, recurrent form: the token loop (the spec), step for step transformers' ``mlstm_recurrent_step_native``.

    m_t = max(g_t + m_{t-1}, i_t)
    C_t = exp(g_t + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T          (B, H, K, V)
    n_t = exp(g_t + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t                (B, H, K)
    h_t = (s q_t)^T C_t / (max(|(s q_t)^T n_t|, exp(-m_t)) + eps)              (B, H, V)

q, k (B, T, H, K); v (B, T, H, V); g, i (B, T, H) in the state's dtype; state (C, n, m (B, H)).
"""

from __future__ import annotations

import torch


def mlstm_step(q, k, v, g, i, C, n, m, scale, eps):
    """One token: q, k (B, H, K), v (B, H, V), g, i (B, H), state (C, n, m) -> (h (B, H, V), (C, n, m))."""
    m_new = torch.maximum(g + m, i).detach()                                 # a constant to autograd (README)
    decay = torch.exp(g + m - m_new)                                          # (B, H)
    write = torch.exp(i - m_new)
    C = decay[..., None, None] * C + write[..., None, None] * (k[..., :, None] * v[..., None, :])
    n = decay[..., None] * n + write[..., None] * k
    qs = q * scale
    num = torch.einsum("bhk,bhkv->bhv", qs, C)
    den = torch.maximum((qs * n).sum(-1).abs(), torch.exp(-m_new)) + eps      # (B, H)
    return num / den[..., None], (C, n, m_new)


def mlstm_recurrent(q, k, v, g, i, *, scale, eps, chunk_size=None, initial_state):
    C, n, m = initial_state
    hs = []
    for t in range(q.shape[1]):
        h, (C, n, m) = mlstm_step(q[:, t], k[:, t], v[:, t], g[:, t], i[:, t], C, n, m, scale, eps)
        hs.append(h)
    return torch.stack(hs, 1), (C, n, m)
