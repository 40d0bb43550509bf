"""The (gated) delta rule, chunkwise, without a gradient: the fast path of the chunk form.

The algebra of ``chunk.py`` (README.md here), reordered so that everything that does not depend on
the state carried in is computed for a whole *group* of chunks at once, and only the two state
products stay in the loop over chunks. Per group of n chunks of C tokens (chunk-major copies in
buffers reused between groups):

    batched:  A      = I + strictly_lower(diag(b) (K K^T) o Dm)           one bmm
              T      = A^{-1}                                             LAPACK trsm on I
              [W, U] = T diag(b) [exp(gamma) o K, V]                      one bmm (the WY factors)
              P      = tril(Q K^T) o Dm,   Q~ = exp(gamma) o Q,   K^ = exp(gamma_C - gamma) o K
    loop:     D_c     = U_c - W_c S_c                                     (pseudo-values)
              S_{c+1} = exp(gamma_C) S_c + K^_c^T D_c                     two baddbmms per chunk
    batched:  O      = scale * (Q~ S_c + P D)                             two bmms

A decay per key channel (KDA, g (B, T, H, K)) takes the same steps with the decayed scores K K^T and
Q K^T built by GLA's sub-chunked factors (``decay.intra._intra_vector_rows``) instead of one bmm times
Dm, and a state decay exp(gamma_C) per key row. Every exponent is a difference of cumulative
log-decays <= 0. Chunks are at most ``DELTA_CHUNK`` tokens here (``subquad.ops.common.routes`` says why;
the result does not depend on it beyond rounding), ~30 tensor ops per group plus 2-3 per chunk, no
T-sized temporaries.
"""

from __future__ import annotations

import torch

from subquad.ops.common.chunking import chunk_view, decay_mask, put_chunks, token_slice
from subquad.ops.decay.intra import SUB, _intra_vector_rows

from subquad.ops.common.routes import DELTA_CHUNK as CHUNK, TOKEN_HEADS_DELTA as TOKEN_HEADS
from subquad.ops.common.expo import exp_decay


def delta_inference(q, k, v, g, beta, *, scale, chunk_size, initial_state=None, group=None):
    """q, k (B, T, H, K); v (B, T, H, V); beta (B, T, H); g (B, T, H), (B, T, H, K) for a decay per key
    channel (KDA), or None for the plain rule. Returns o (B, T, H, V) in beta's dtype and the final state
    (B, H, K, V)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt, dev = beta.dtype, q.device
    vector = g is not None and g.dim() == 4
    C = min(chunk_size, CHUNK, T)
    if vector:                                                      # KDA's scores use sub-chunks of SUB
        C = max(SUB, -(-C // SUB) * SUB)
    BH = B * H
    L = group if group is not None else max(1, TOKEN_HEADS // max(BH, 1) // C) * C      # BH = 0: an empty batch
    L = min(-(-L // C) * C, -(-T // C) * C)
    n = L // C
    N = BH * n

    def buf(*shape):
        return torch.empty(*shape, dtype=dt, device=dev)

    # Chunk-major buffers: index [j] is chunk j of the group for every (batch, head), contiguous, so the
    # loop's matmuls take plain (B H, C, *) batches; flat views (N, C, *) serve the batched steps.
    qb, kb, bb = buf(n, B, H, C, K), buf(n, B, H, C, K), buf(n, B, H, C, 1)
    gb = None if g is None else buf(n, B, H, C, K if vector else 1)
    rv = buf(n, B, H, C, V)                                         # diag(b) V, read straight from v
    A, P, rk, W = buf(N, C, C), buf(N, C, C), buf(N, C, K), buf(n, BH, C, K)
    Dv, ob, kh = buf(n, BH, C, V), buf(N, C, V), buf(n, BH, C, K)
    states = buf(n + 1, BH, K, V)                                   # states[j]: the state before chunk j
    states[0] = 0 if initial_state is None else initial_state.reshape(BH, K, V)
    eye = torch.eye(C, dtype=dt, device=dev).expand(N, C, C)   # A^{-1} solves A X = I
    o = torch.empty(B, T, H, V, dtype=dt, device=dev)

    for s in range(0, T, L):
        e = min(s + L, T)
        # a last, partial group is zero-padded: beta = k = 0 adds nothing
        gsrc = [] if g is None else [(gb, g if vector else g.unsqueeze(-1))]
        for x, src in [(qb, q), (kb, k), (bb, beta.unsqueeze(-1))] + gsrc:
            x.copy_(chunk_view(token_slice(src, s, e, L), C))
        torch.mul(chunk_view(token_slice(v, s, e, L), C), bb, out=rv)    # v multiplied by beta as it is read
        qc, kc = qb.view(N, C, K), kb.view(N, C, K)
        bc = bb.view(N, C, 1)
        if vector:                                                    # decayed scores per key channel
            gam = gb.view(N, C, K).cumsum(1)                          # chunk-local, <= 0
            KP = _intra_vector_rows(torch.stack([kc, qc], 1), kc, gam)   # (N, 2, C, C), causal
            A.copy_(KP[:, 0])
            P.copy_(KP[:, 1])
        else:
            torch.bmm(kc, kc.transpose(1, 2), out=A)
            torch.bmm(qc, kc.transpose(1, 2), out=P)
        if g is None:
            A.tril_(-1)
            torch.mul(kc, bc, out=rk)
            qt, decay, kt = qc, None, kb.view(n, BH, C, K)
        else:
            if not vector:                                            # a scalar decay: one channel, broadcast
                gam = gb.view(N, C, 1).cumsum(1)
                Dm = decay_mask(gam[..., 0])
                A.mul_(Dm)
                P.mul_(Dm)
            A.tril_(-1)
            eg = exp_decay(gam)
            torch.mul(kc, eg * bc, out=rk)
            qt = qc * eg
            torch.mul(kc, exp_decay(gam[:, -1:] - gam), out=kh.view(N, C, K))
            decay, kt = exp_decay(gam[:, -1]).view(n, BH, gam.shape[-1], 1), kh
        A.mul_(bc).diagonal(dim1=1, dim2=2).fill_(1)
        P.tril_()
        Ti = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
        torch.bmm(Ti, rk, out=W.view(N, C, K))                         # the WY factors
        torch.bmm(Ti, rv.view(N, C, V), out=Dv.view(N, C, V))          # U, made D in the loop
        for j in range(n):                                            # the only sequential part
            Dv[j].baddbmm_(W[j], states[j], alpha=-1)                 # D = U - W S
            if decay is None:
                torch.baddbmm(states[j], kt[j].transpose(1, 2), Dv[j], out=states[j + 1])
            else:
                torch.mul(states[j], decay[j], out=states[j + 1]).baddbmm_(kt[j].transpose(1, 2), Dv[j])
        before = states[:n].view(N, K, V)
        ob.baddbmm_(qt, before, beta=0, alpha=scale)
        ob.baddbmm_(P, Dv.view(N, C, V), alpha=scale)
        put_chunks(o, s, e, ob.view(n, B, H, C, V))
        states[0] = states[n]                                        # padded chunks leave the state as it was
    return o, states[0].view(B, H, K, V).clone()
