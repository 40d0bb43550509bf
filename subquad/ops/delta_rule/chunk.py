"""The (gated) delta rule, chunkwise (WY representation; the derivation is in README.md here).

Per chunk of C tokens with state S_0 carried in, gamma the chunk-local cumulative
log-decay (0 for the plain rule) and Dm_ri = exp(gamma_r - gamma_i) for i <= r:

    1. A  = (I + strictly_lower(diag(b) (K K^T) o Dm))^{-1} diag(b)      (one C x C triangular solve)
    2. W  = A (exp(gamma) o K),  U = A V                                 (WY factors)
    3. D  = U - W S_0                                                    (pseudo-values)
    4. O  = scale * ((exp(gamma) o Q) S_0 + (tril(Q K^T) o Dm) D)        (state to output + intra-chunk)
    5. S  = exp(gamma_C) S_0 + (exp(gamma_C - gamma) o K)^T D           (state passing)

``parallel`` is the same algebra with one chunk spanning the whole sequence.
"""

from __future__ import annotations

import torch

from subquad.ops.common.autograd import wants_grad
from subquad.ops.delta_rule.inference import delta_rule_inference


def _heads(x):
    """A chunk (B, c, H, *rest) as (B*H, c, *rest)."""
    B, c, H = x.shape[:3]
    return x.transpose(1, 2).reshape(B * H, c, *x.shape[3:])


def _chunk_step(qc, kc, vc, bc, gc, S, scale):
    """One chunk: qc, kc (BH, c, K); vc (BH, c, V); bc (BH, c); gc (BH, c) or None; S (BH, K, V)."""
    c = qc.shape[1]
    eye = torch.eye(c, dtype=qc.dtype, device=qc.device)
    lower = torch.ones(c, c, dtype=torch.bool, device=qc.device).tril()
    if gc is None:
        Dm = lower.to(qc.dtype)
        gam = None
    else:
        gam = gc.cumsum(1)                                                    # (BH, c)
        Dm = torch.exp((gam.unsqueeze(-1) - gam.unsqueeze(-2)).masked_fill(~lower, float("-inf")))
    KK = kc @ kc.transpose(1, 2)                                              # (BH, c, c)
    L = (bc.unsqueeze(-1) * KK * Dm).tril(-1)
    Ik = eye + L
    kg = kc if gam is None else kc * torch.exp(gam).unsqueeze(-1)
    rhs = torch.cat([kg, vc], dim=-1) * bc.unsqueeze(-1)                      # diag(b) [K', V]
    WU = torch.linalg.solve_triangular(Ik, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :kc.shape[-1]], WU[..., kc.shape[-1]:]
    D = U - W @ S                                                             # (BH, c, V)
    qg = qc if gam is None else qc * torch.exp(gam).unsqueeze(-1)
    o = (qg @ S + ((qc @ kc.transpose(1, 2)) * Dm) @ D) * scale
    if gam is None:
        S = S + kc.transpose(1, 2) @ D
    else:
        gl = gam[:, -1:]                                                      # (BH, 1)
        S = torch.exp(gl).unsqueeze(-1) * S + (kc * torch.exp(gl - gam).unsqueeze(-1)).transpose(1, 2) @ D
    return o, S


def chunk_delta_rule(q, k, v, beta, g, *, scale, chunk_size=64, initial_state=None):
    if not wants_grad(q, k, v, beta, g, initial_state):
        return delta_rule_inference(q, k, v, beta, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = beta.dtype
    S = torch.zeros(B * H, K, V, dtype=dt, device=q.device) if initial_state is None \
        else initial_state.reshape(B * H, K, V)
    outs = []
    gs = g.split(chunk_size, 1) if g is not None else [None] * -(-T // chunk_size)
    # split, not slicing: its backward is one concatenation (slices would be quadratic in T)
    for qc, kc, vc, bc, gc in zip(q.split(chunk_size, 1), k.split(chunk_size, 1), v.split(chunk_size, 1),
                                  beta.split(chunk_size, 1), gs):
        c = qc.shape[1]
        o, S = _chunk_step(_heads(qc).to(dt), _heads(kc).to(dt), _heads(vc).to(dt), _heads(bc),
                           None if gc is None else _heads(gc), S, scale)
        outs.append(o.view(B, H, c, V))
    return torch.cat(outs, 2).transpose(1, 2), S.view(B, H, K, V)


def parallel_delta_rule(q, k, v, beta, g, *, scale, chunk_size=None, initial_state=None):
    """The whole sequence as one chunk: a T x T triangular solve. O(T^2 K + T^3) - a reference for short T."""
    return chunk_delta_rule(q, k, v, beta, g, scale=scale, chunk_size=q.shape[1], initial_state=initial_state)
