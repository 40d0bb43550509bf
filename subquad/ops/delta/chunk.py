"""The (gated) delta rule, chunkwise (WY representation; the derivation is in README.md here).

Per chunk of C tokens with state S_0 carried in, gamma the chunk-local cumulative
log-decay (0 for the plain rule) and Dm_ri = exp(gamma_r - gamma_i) for i <= r:

    1. A  = (I + strictly_lower(diag(b) (K K^T) o Dm))^{-1} diag(b)      (one C x C triangular solve)
    2. W  = A (exp(gamma) o K),  U = A V                                 (WY factors)
    3. D  = U - W S_0                                                    (pseudo-values)
    4. O  = scale * ((exp(gamma) o Q) S_0 + (tril(Q K^T) o Dm) D)        (state to output + intra-chunk)
    5. S  = exp(gamma_C) S_0 + (exp(gamma_C - gamma) o K)^T D           (state passing)

Steps 1, 2 and the state-free halves of 4 hold no S_0, so a differentiable call computes them for
every chunk at once (one batched triangular solve) and loops over chunks only for 3-5; a call longer
than PIECE tokens runs piece by piece with the state carried, which keeps autograd's temporaries
piece-sized. Without a gradient, ``inference.py`` runs the fast path. ``parallel.py`` is the same algebra with
one chunk spanning the whole sequence.

A per-key-channel decay g (B, T, H, K) (Kimi's KDA) is the same algebra with gamma a vector per token:
exp(gamma) scales K and Q channel-wise, the state decays by diag(exp(gamma_C)), and Dm turns into
exp(gamma_ik - gamma_jk) inside the sums over k - K K^T o Dm and Q K^T o Dm become GLA's sub-chunked
decayed scores (``decay/intra.py``: every exponent a difference <= 0), so chunks are rounded up to a
multiple of its 16-token sub-chunk.
"""

from __future__ import annotations

import torch

from subquad.ops.common.autograd import inference_path, wants_grad
from subquad.ops.common.chunking import decay_mask, in_pieces
from subquad.ops.common.routes import PIECE, SHORT
from subquad.ops.delta.inference import delta_inference
from subquad.ops.delta.recurrent import recurrent_delta
from subquad.ops.delta.triangular import unit_lower_solve
from subquad.ops.common.expo import exp_decay
from subquad.ops.decay.intra import SUB, _intra_vector_rows




def _by_chunk(x, C):
    """(B, T, H, *rest) with T a multiple of C -> (B*H, n, C, *rest), head-major."""
    B, T, H = x.shape[:3]
    return x.transpose(1, 2).reshape(B * H, T // C, C, *x.shape[3:])


def _chunkwise(q, k, v, g, beta, scale, C, initial_state):
    """Steps 1, 2 and the state-free parts of 4 for every chunk at once (one batched triangular solve);
    steps 3-5 in the loop over chunks. Differentiable by autograd."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = beta.dtype
    vector = g is not None and g.dim() == 4               # KDA: a decay per key channel
    if vector:
        C = -(-C // SUB) * SUB
    pad = -T % C
    if pad:                                                # zero keys, values and beta add nothing
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
        g = None if g is None else torch.nn.functional.pad(g, (0, 0) * (g.dim() - 2) + (0, pad))
    qc, kc, vc = (_by_chunk(x.to(dt), C) for x in (q, k, v))               # (BH, n, C, K|V)
    bc = _by_chunk(beta, C).unsqueeze(-1)                                   # (BH, n, C, 1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if g is None:
        Dm = lower.to(dt)
        kg, qg, kd = kc, qc, kc
    elif vector:
        gam = _by_chunk(g, C).cumsum(2)                                    # (BH, n, C, K), chunk-local
        eg = exp_decay(gam)
        kg, qg = kc * eg, qc * eg
        kd = kc * exp_decay(gam[:, :, -1:] - gam)
        decay = exp_decay(gam[:, :, -1]).unsqueeze(-1).unbind(1)          # n x (BH, K, 1)
        flat = (lambda x: x.reshape(-1, C, K))
        # k_i . (e^(g_i - g_j) k_j) and q_i . (e^(g_i - g_j) k_j), their decay factors built once
        KK, P = _intra_vector_rows(torch.stack([flat(kc), flat(qc)], 1), flat(kc), flat(gam)).view(
            B * H, -1, 2, C, C).unbind(2)
    else:
        gam = _by_chunk(g, C).cumsum(-1)                                   # (BH, n, C), chunk-local
        Dm = decay_mask(gam)
        eg = exp_decay(gam).unsqueeze(-1)
        kg, qg = kc * eg, qc * eg
        kd = kc * exp_decay(gam[..., -1:] - gam).unsqueeze(-1)
        decay = exp_decay(gam[..., -1]).unbind(1)                          # n x (BH,)
    if not vector:
        KK = (kc @ kc.transpose(-1, -2)) * Dm
        P = (qc @ kc.transpose(-1, -2)) * Dm                              # (BH, n, C, C)
    A = torch.eye(C, dtype=dt, device=q.device) + (bc * KK).tril(-1)
    WU = unit_lower_solve(A, torch.cat([kg, vc], -1) * bc)
    S = torch.zeros(B * H, K, V, dtype=dt, device=q.device) if initial_state is None \
        else initial_state.reshape(B * H, K, V)
    Ss, Ds = [], []
    # unbind, not slicing: its backward is one stack (slices would be quadratic in T)
    for j, (Wj, Uj, kdj) in enumerate(zip(WU[..., :K].unbind(1), WU[..., K:].unbind(1), kd.unbind(1))):
        D = Uj - Wj @ S
        Ss.append(S)
        Ds.append(D)
        S = S if g is None else (decay[j] if vector else decay[j].view(-1, 1, 1)) * S
        S = S + kdj.transpose(1, 2) @ D
    o = qg @ torch.stack(Ss, 1) + P @ torch.stack(Ds, 1)                  # (BH, n, C, V), batched
    o = o.view(B, H, T + pad, V)[:, :, :T].transpose(1, 2) * scale
    return o, S.view(B, H, K, V)


def chunk_delta(q, k, v, g, beta, *, scale, chunk_size=64, initial_state=None):
    if q.shape[1] < SHORT and not wants_grad(q, k, v, g, beta, initial_state):   # a decoding step, compiled or not
        return recurrent_delta(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
    if inference_path(q, k, v, g, beta, initial_state):
        return delta_inference(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
    C = min(chunk_size, q.shape[1])
    L = max(1, PIECE // C) * C
    if q.shape[1] <= L:
        return _chunkwise(q, k, v, g, beta, scale, C, initial_state)
    # pieces of L tokens in turn, the state carried: autograd's temporaries stay piece-sized
    return in_pieces(lambda *x: _chunkwise(*x[:5], scale, C, x[5]), (q, k, v, g, beta), L, initial_state)
