"""Linear attention, chunkwise form: the fast path for training and prefill. O(T C K + T K V).

The sequence is cut into chunks of C tokens (the last may be shorter). For chunk
c with rows Q_c, K_c (C, K), V_c (C, V) of one head and the state S_{c-1} (K, V) carried in:

    1. intra-chunk:  O_c  = scale * tril(Q_c K_c^T) V_c        (C x C matmuls)
    2. inter-chunk:  O_c += scale * Q_c S_{c-1}                 (state to output)
    3. state pass:   S_c  = S_{c-1} + K_c^T V_c                 (in place)

No per-token K x V outer product is ever formed (that is the textbook cumsum
formulation, O(T K V) memory, kept only as a baseline in benchmarks/).
Normalised attention runs the same kernel on v augmented with a column of ones,
so the normaliser z rides along as the last column of the state.

Backward is hand-written (``_ChunkLinearAttn``), sweeping the chunks in reverse
with the state gradient G_c = dL/dS_c:

    dA    = scale * tril(dO_c V_c^T)
    dQ_c  = dA K_c + scale * dO_c S_{c-1}^T
    dK_c  = dA^T Q_c + V_c G_c^T
    dV_c  = scale * tril(Q_c K_c^T)^T dO_c + K_c G_c
    G_{c-1} = G_c + scale * Q_c^T dO_c                          (dS_0 = G_0)
"""

from __future__ import annotations

import torch

from subquad.ops.common.precision import amp_op
from subquad.ops.linear.state import pack_state
from subquad.ops.common.precision import autocast_off
from subquad.ops.common.varlen import varlen


def _chunks(T: int, C: int):
    return [(s, min(s + C, T)) for s in range(0, T, C)]


def _heads(x, s: int, e: int):
    """Rows s:e of x (B, T, H, D) as (B*H, e-s, D): a chunk-sized copy, never a whole-sequence transpose."""
    B, _, H, D = x.shape
    return x[:, s:e].transpose(1, 2).reshape(B * H, e - s, D)


def _put(out, s: int, e: int, xc):
    """Write xc (B*H, e-s, D) into rows s:e of out (B, T, H, D)."""
    B, _, H, D = out.shape
    out[:, s:e] = xc.view(B, H, e - s, D).transpose(1, 2)


def _fwd(q, k, v, S, scale: float, C: int, save_states: bool):
    """q, k (B, T, H, K); v (B, T, H, V); S (B*H, K, V) updated in place. Returns o (B, T, H, V), states."""
    B, T, H, _ = q.shape
    o = q.new_empty(B, T, H, v.shape[-1])
    mask = torch.ones(C, C, dtype=q.dtype, device=q.device).tril_().mul_(scale)
    chunks = _chunks(T, C)
    states = S.new_empty(len(chunks), *S.shape) if save_states else None
    for i, (s, e) in enumerate(chunks):
        c = e - s
        qc, kc, vc = _heads(q, s, e), _heads(k, s, e), _heads(v, s, e)
        if save_states:
            states[i] = S
        A = torch.bmm(qc, kc.transpose(1, 2)).mul_(mask[:c, :c])          # (BH, c, c)
        oc = torch.bmm(qc, S).mul_(scale)                                 # scale * Q S_{c-1}
        oc.baddbmm_(A, vc)                                                # += scale * tril(QK^T) V
        _put(o, s, e, oc)
        S.baddbmm_(kc.transpose(1, 2), vc)                                # S += K^T V
    return o, states


def _bwd(q, k, v, do, states, dS, scale: float, C: int):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    mask = torch.ones(C, C, dtype=q.dtype, device=q.device).tril_().mul_(scale)
    G = dS.clone()                                                        # dL/dS after the last chunk
    for i, (s, e) in reversed(list(enumerate(_chunks(q.shape[1], C)))):
        c = e - s
        m = mask[:c, :c]
        qc, kc, vc, doc = _heads(q, s, e), _heads(k, s, e), _heads(v, s, e), _heads(do, s, e)
        Sp = states[i]                                                    # S_{c-1}
        dA = torch.bmm(doc, vc.transpose(1, 2)).mul_(m)                  # (BH, c, c)
        A = torch.bmm(qc, kc.transpose(1, 2)).mul_(m)
        _put(dq, s, e, torch.baddbmm(torch.bmm(doc, Sp.transpose(1, 2)), dA, kc, beta=scale))
        _put(dk, s, e, torch.baddbmm(torch.bmm(vc, G.transpose(1, 2)), dA.transpose(1, 2), qc))
        _put(dv, s, e, torch.baddbmm(torch.bmm(kc, G), A.transpose(1, 2), doc))
        G.baddbmm_(qc.transpose(1, 2), doc, alpha=scale)
    return dq, dk, dv, G


class _ChunkLinearAttn(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, S0, scale, C):
        S = S0.clone()
        need = any(ctx.needs_input_grad[:4])
        o, states = _fwd(q, k, v, S, scale, C, save_states=need)
        if need:
            ctx.save_for_backward(q, k, v, states)
        ctx.scale, ctx.C = scale, C
        return o, S

    @staticmethod
    @autocast_off
    def backward(ctx, do, dS):
        q, k, v, states = ctx.saved_tensors
        if dS is None:
            dS = torch.zeros_like(states[0])
        # .contiguous(): a gradient from .sum() arrives as a stride-0 expand, which batched matmuls crawl over
        dq, dk, dv, dS0 = _bwd(q, k, v, do.contiguous(), states, dS, ctx.scale, ctx.C)
        return dq, dk, dv, dS0, None, None


@amp_op()
@varlen("q", "k", "v")
def chunk_linear_attention(q, k, v, *, normalize=True, eps=1e-6, chunk_size=64, scale=None,
                           initial_state=None, output_final_state=False):
    """Chunkwise linear attention; same signature as ``linear_attention``."""
    from subquad.ops.linear import prepare_form

    scale, S0, z0, dt, eps = prepare_form(q, k, v, scale, chunk_size, initial_state, normalize, eps,
                                           output_final_state)
    B, T, H, K = q.shape
    V = v.shape[-1]

    qf, kf, vf = (x.to(dt) for x in (q, k, v))                             # (B, T, H, *)
    S = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if S0 is None else S0
    if normalize:
        # The normaliser is the same kernel applied to a column of ones: z is S's extra column.
        vf = torch.cat([vf, vf.new_ones(B, T, H, 1)], dim=-1)
        z = torch.zeros(B, H, K, dtype=dt, device=q.device) if z0 is None else z0
        S = torch.cat([S, z.unsqueeze(-1)], dim=-1)
    Vs = S.shape[-1]                                                      # V, or V + 1 with z riding along
    C = min(chunk_size, T)                                                # past T: one chunk of T
    o, S_final = _ChunkLinearAttn.apply(qf, kf, vf, S.reshape(B * H, K, Vs), scale, C)
    S_final = S_final.reshape(B, H, K, Vs)
    z_final = None
    if normalize:
        o = o[..., :V] / (o[..., V:] + eps)
        S_final, z_final = S_final[..., :V], S_final[..., V]
    o = o.to(q.dtype)                                                     # (B, T, H, V)
    return o, (pack_state(S_final, z_final, normalize) if output_final_state else None)
