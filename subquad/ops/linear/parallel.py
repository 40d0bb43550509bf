"""Linear attention, parallel form: the T x T reference. O(T^2 K).

    A_ts = scale * (q_t . k_s) for s <= t, else 0            (B, H, T, T)
    o_t  = sum_s A_ts v_s + scale * q_t S_0                  (numerator)
    d_t  = sum_s A_ts     + scale * q_t . z_0                (normaliser)
    o_t  = o_t / (d_t + eps)                                 (when normalize)

Katharopoulos et al., "Transformers are RNNs", ICML 2020.
"""

from __future__ import annotations

import torch

from subquad.ops.common.precision import amp_op
from subquad.ops.linear.state import pack_state
from subquad.ops.common.varlen import varlen
from subquad.ops.linear.prepare import prepare_form


@amp_op()
@varlen("q", "k", "v")
def parallel_linear_attention(q, k, v, *, normalize=True, eps=1e-6, chunk_size=64, scale=None,
                              initial_state=None, output_final_state=False, route=None):
    """Parallel (masked T x T) linear attention; same signature as ``linear_attention``."""
    scale, S0, z0, dt, eps = prepare_form(q, k, v, scale, chunk_size, initial_state, normalize, eps,
                                           output_final_state, route, "parallel")
    qf, kf, vf = (x.to(dt).transpose(1, 2) for x in (q, k, v))  # (B, H, T, *)
    T = q.shape[1]
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    A = (qf @ kf.transpose(-1, -2)) * scale                       # (B, H, T, T)
    A = A.masked_fill(~mask, 0.0)
    o = A @ vf                                                    # (B, H, T, V)
    if S0 is not None:
        o = o + scale * (qf @ S0)
    if normalize:
        d = A.sum(-1)                                             # (B, H, T)
        if z0 is not None:
            d = d + scale * (qf @ z0.unsqueeze(-1)).squeeze(-1)
        o = o / (d.unsqueeze(-1) + eps)
    o = o.transpose(1, 2).to(q.dtype)
    if not output_final_state:
        return o, None
    S = kf.transpose(-1, -2) @ vf                                 # (B, H, K, V)
    if S0 is not None:
        S = S + S0
    z = None
    if normalize:
        z = kf.sum(-2) if z0 is None else kf.sum(-2) + z0
    return o, pack_state(S, z, normalize)
