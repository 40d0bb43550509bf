"""Linear attention, chunkwise form: the fast path for training and prefill. O(T C K + T K V).

The chunk engine of the decayed family (``subquad/ops/decay/chunk.py``) with no decay. For chunk c
with rows Q_c, K_c (C, K), V_c (C, V) of one head and the state S_{c-1} (K, V) carried in:

    1. intra-chunk:  O_c  = scale * tril(Q_c K_c^T) V_c        (C x C matmuls)
    2. inter-chunk:  O_c += scale * Q_c S_{c-1}                 (state to output)
    3. state pass:   S_c  = S_{c-1} + K_c^T V_c

No per-token K x V outer product is ever formed (that is the textbook cumsum formulation, O(T K V)
memory, kept only as a baseline in benchmarks/). Normalised attention runs the same engine on v
augmented with a column of ones, so the normaliser z rides along as the last column of the state.
The backward is the engine's (hand-written: the chunks in reverse with the state's gradient carried).

Routes (``route=``, recorded by ``routes.took``): "chunk" (the engine), or "token" (the token loop of
``recurrent.py``), which calls of fewer than SHORT tokens without a gradient (a decoding step) take.
"""

from __future__ import annotations

import torch

from subquad.ops.common.autograd import wants_grad
from subquad.ops.common.precision import amp_op
from subquad.ops.common.routes import SHORT, took
from subquad.ops.common.varlen import varlen
from subquad.ops.decay.chunk import chunk_engine
from subquad.ops.linear.recurrent import recurrent_linear_attention
from subquad.ops.linear.state import pack_state
from subquad.ops.linear.prepare import prepare_form



@amp_op()
@varlen("q", "k", "v")
def chunk_linear_attention(q, k, v, *, normalize=True, eps=1e-6, chunk_size=64, scale=None,
                           initial_state=None, output_final_state=False, route=None):
    """Chunkwise linear attention; same signature as ``linear_attention``."""
    scale, S0, z0, dt, eps = prepare_form(q, k, v, scale, chunk_size, initial_state, normalize, eps,
                                           output_final_state, route, "chunk")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if route == "token" or (route is None and T < SHORT and not wants_grad(q, k, v, S0, z0)):
        took("linear_attention", "token")
        return recurrent_linear_attention(q, k, v, normalize=normalize, eps=eps, chunk_size=chunk_size,
                                          scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state)
    qf, kf, vf = (x.to(dt) for x in (q, k, v))                             # (B, T, H, *)
    S = S0
    if normalize:
        # The normaliser is the same engine applied to a column of ones: z is S's extra column.
        vf = torch.cat([vf, vf.new_ones(B, T, H, 1)], dim=-1)
        z = torch.zeros(B, H, K, dtype=dt, device=q.device) if z0 is None else z0
        S = torch.cat([torch.zeros(B, H, K, V, dtype=dt, device=q.device) if S0 is None else S0,
                       z.unsqueeze(-1)], dim=-1)
    o, S_final = chunk_engine(qf, kf, vf, None, scale=scale, chunk_size=chunk_size, initial_state=S,
                              op="linear_attention")
    z_final = None
    if normalize:
        o = o[..., :V] / (o[..., V:] + eps)
        S_final, z_final = S_final[..., :V], S_final[..., V]
    o = o.to(q.dtype)                                                     # (B, T, H, V)
    return o, (pack_state(S_final, z_final, normalize) if output_final_state else None)
