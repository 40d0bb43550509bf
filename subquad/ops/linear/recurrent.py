"""Linear attention, recurrent form: token by token with a fixed-size state. O(T K V).

    S_t = S_{t-1} + k_t v_t^T        (B, H, K, V)
    z_t = z_{t-1} + k_t              (B, H, K)      (when normalize)
    o_t = scale * q_t^T S_t  [ / (scale * q_t . z_t + eps) ]

This is generation: memory does not grow with T.
"""

from __future__ import annotations

import torch

from subquad.ops.common.precision import amp_op
from subquad.ops.linear.state import pack_state
from subquad.ops.common.varlen import varlen
from subquad.ops.linear.prepare import prepare_form


@amp_op()
@varlen("q", "k", "v")
def recurrent_linear_attention(q, k, v, *, normalize=True, eps=1e-6, chunk_size=64, scale=None,
                               initial_state=None, output_final_state=False, route=None):
    """Recurrent (token loop) linear attention; same signature as ``linear_attention``."""
    scale, S0, z0, dt, eps = prepare_form(q, k, v, scale, chunk_size, initial_state, normalize, eps,
                                           output_final_state, route, "recurrent")
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if S0 is None else S0.clone()
    z = None
    if normalize:
        z = torch.zeros(B, H, K, dtype=dt, device=q.device) if z0 is None else z0.clone()
    # In-place updates when no graph is recorded (decoding); out-of-place for autograd.
    inplace = not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, S, *( [z] if z is not None else []))))
    outs = []
    for t in range(T):
        qt, kt, vt = q[:, t].to(dt), k[:, t].to(dt), v[:, t].to(dt)      # (B, H, K|V)
        kv = kt.unsqueeze(-1) * vt.unsqueeze(-2)                          # (B, H, K, V)
        if inplace:
            S.add_(kv)
        else:
            S = S + kv
        ot = scale * (qt.unsqueeze(-2) @ S).squeeze(-2)                   # (B, H, V)
        if normalize:
            z = z.add_(kt) if inplace else z + kt
            ot = ot / (scale * (qt * z).sum(-1, keepdim=True) + eps)
        outs.append(ot)
    o = torch.stack(outs, dim=1).to(q.dtype)                              # (B, T, H, V)
    return o, (pack_state(S, z, normalize) if output_final_state else None)


@torch.no_grad()
def linear_attention_step(q_t, k_t, v_t, state, *, scale=None, eps=1e-6):
    """One decoding step: q_t, k_t (B, H, K), v_t (B, H, V); ``state`` S (B, H, K, V), or (S, z (B, H, K))
    normalised - the state ``linear_attention(..., output_final_state=True)`` returns.

    Returns (o_t (B, H, V), the new state, of the same kind); the state passed in is left as it was, so it
    can be reused (a second sample from one prompt). The cost is O(K V) whatever the context: the point of
    a fixed state. No checks and no autograd: this is the generation hot path.

        >>> o, state = linear_attention(q, k, v, output_final_state=True)      # prefill
        >>> o_t, state = linear_attention_step(q_t, k_t, v_t, state)           # then one token at a time
    """
    S, z = state if isinstance(state, tuple) else (state, None)
    scale = k_t.shape[-1] ** -0.5 if scale is None else scale
    B, H, K, V = S.shape
    S = torch.baddbmm(S.reshape(B * H, K, V), k_t.reshape(B * H, K, 1), v_t.reshape(B * H, 1, V)).view(B, H, K, V)
    o = (q_t.unsqueeze(-2) @ S).squeeze(-2).mul_(scale)                  # S = S + k v^T, a new tensor
    if z is None:
        return o, S
    z = z + k_t
    o.div_((q_t * z).sum(-1, keepdim=True).mul_(scale).add_(eps))
    return o, (S, z)
