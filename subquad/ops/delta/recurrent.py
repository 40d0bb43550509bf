"""The (gated) delta rule, recurrent form: the token loop (the spec).

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T
    (KDA: a_t a vector per key channel, S_t = (I - b_t k_t k_t^T) diag(a_t) S_{t-1} + b_t k_t v_t^T)
    o_t = scale * S_t^T q_t
"""

from __future__ import annotations

import torch

from subquad.ops.common.expo import exp_decay


def recurrent_delta(q, k, v, g, beta, *, scale, chunk_size=None, initial_state=None):
    B, T, H, K = q.shape
    sd = beta.dtype
    S = torch.zeros(B, H, K, v.shape[-1], dtype=sd, device=q.device) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        kt, vt, bt = k[:, t].to(sd), v[:, t].to(sd), beta[:, t]             # (B, H, K), (B, H, V), (B, H)
        if g is not None:
            a = exp_decay(g[:, t])                                            # (B, H) or (B, H, K): KDA
            S = (a[..., None, None] if a.dim() == 2 else a[..., None]) * S
        pred = (kt.unsqueeze(-2) @ S).squeeze(-2)                             # S^T k  (B, H, V)
        S = S + kt.unsqueeze(-1) * (bt[..., None] * (vt - pred)).unsqueeze(-2)
        outs.append((q[:, t].to(sd).unsqueeze(-2) @ S).squeeze(-2) * scale)
    return torch.stack(outs, 1), S


def recurrent_dplr(q, k, v, w, a, b, *, scale, chunk_size=None, initial_state=None):
    """The generalised delta rule's token loop (the spec of ``generalized_delta_rule``):

        S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T = exp(w_t) o S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T
        o_t = scale * S_t^T q_t
    with S (B, H, K, V), w the log-decay per key channel; a^T S reads the state before it decays.
    """
    B, T, H, K = q.shape
    sd = w.dtype
    S = torch.zeros(B, H, K, v.shape[-1], dtype=sd, device=q.device) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        kt, vt, at, bt = (x[:, t].to(sd) for x in (k, v, a, b))              # (B, H, K) / (B, H, V)
        read = (at.unsqueeze(-2) @ S).squeeze(-2)                            # a^T S  (B, H, V)
        S = exp_decay(w[:, t])[..., None] * S + bt.unsqueeze(-1) * read.unsqueeze(-2) \
            + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        outs.append((q[:, t].to(sd).unsqueeze(-2) @ S).squeeze(-2) * scale)
    return torch.stack(outs, 1), S
