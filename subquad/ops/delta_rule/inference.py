"""The (gated) delta rule, chunkwise, without a gradient: the fast path of the chunk form.

The algebra of ``chunk.py`` (README.md here), reordered so that everything that does not depend on
the state carried in is computed for a whole *group* of chunks at once, leaving one matmul per chunk
in the loop. Per group of n chunks of C tokens (chunk-major copies in buffers reused between groups):

    batched:  A      = I + strictly_lower(diag(b) (K K^T) o Dm)           one bmm
              [W, U] = A^{-1} diag(b) [exp(gamma) o K, V]                one batched triangular solve
              P      = tril(Q K^T) o Dm,   Q~ = exp(gamma) o Q,   K^ = exp(gamma_C - gamma) o K
              each chunk as an affine map of its incoming state, since
              S' = exp(gamma_C) S + K^^T (U - W S) = M S + R:
              M      = exp(gamma_C) I - K^^T W,   R = K^^T U              two bmms
    loop:     S_{c+1} = M_c S_c + R_c                                     one baddbmm per chunk
    batched:  D      = U - W S_c                                          (pseudo-values)
              O      = scale * (Q~ S_c + P D)                             three bmms

Every exponent is a difference of cumulative log-decays <= 0. About 30 tensor ops per group plus one
per chunk (the autograd loop of chunk.py makes ~20 per chunk), and no T-sized temporaries.
"""

from __future__ import annotations

import torch

TOKEN_HEADS = 4096  # group size: about this many (token, head) pairs per group


def delta_rule_inference(q, k, v, beta, g, *, scale, chunk_size, initial_state=None, group=None):
    """q, k (B, T, H, K); v (B, T, H, V); beta, g (B, T, H) (g None for the plain rule).
    Returns o (B, T, H, V) in beta's dtype and the final state (B, H, K, V)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt, dev = beta.dtype, q.device
    C = min(chunk_size, T)
    BH = B * H
    L = group if group is not None else max(1, TOKEN_HEADS // BH // C) * C
    L = min(-(-L // C) * C, -(-T // C) * C)
    n = L // C
    N = BH * n

    def buf(*shape):
        return torch.empty(*shape, dtype=dt, device=dev)

    # Chunk-major buffers: index [j] is chunk j of the group for every (batch, head), contiguous, so the
    # loop's matmuls take plain (B H, C, *) batches; flat views (N, C, *) serve the batched steps.
    qb, kb, vb, bb = buf(n, B, H, C, K), buf(n, B, H, C, K), buf(n, B, H, C, V), buf(n, B, H, C, 1)
    gb = None if g is None else buf(n, B, H, C, 1)                  # tails zeroed below
    A, P, rhs = buf(N, C, C), buf(N, C, C), buf(N, C, K + V)
    M, R, Dv, ob, kh = buf(n, BH, K, K), buf(n, BH, K, V), buf(n, BH, C, V), buf(N, C, V), buf(n, BH, C, K)
    states = buf(n + 1, BH, K, V)                                   # states[j]: the state before chunk j
    states[0] = 0 if initial_state is None else initial_state.reshape(BH, K, V)
    lower = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    o = torch.empty(B, T, H, V, dtype=dt, device=dev)

    def chunked(x, l):
        """Tokens [s, s + l) of a (B, T, H, *) tensor as (n', B, H, C, *), n' = l / C."""
        return x.view(B, l // C, C, H, x.shape[-1]).permute(1, 0, 3, 2, 4)

    for s in range(0, T, L):
        e = min(s + L, T)
        full = (e - s) // C * C                                       # tokens in whole chunks
        loads = [(qb, q), (kb, k), (vb, v), (bb, beta.unsqueeze(-1))] + ([] if g is None else [(gb, g.unsqueeze(-1))])
        if e - s < L:                                               # zero tail: beta = k = 0 adds nothing
            for x, _ in loads:
                x.zero_()
        for x, src in loads:
            if full:
                x[:full // C].copy_(chunked(src[:, s:s + full], full))
            if s + full < e:                                        # a last, partial chunk
                x[full // C, :, :, :e - s - full].copy_(src[:, s + full:e].transpose(1, 2))
        qc, kc, vc = qb.view(N, C, K), kb.view(N, C, K), vb.view(N, C, V)
        bc = bb.view(N, C, 1)
        torch.bmm(kc, kc.transpose(1, 2), out=A)
        torch.bmm(qc, kc.transpose(1, 2), out=P)
        if g is None:
            A.tril_(-1)
            torch.mul(kc, bc, out=rhs[..., :K])
            qt, decay, kt = qc, None, kb.view(n, BH, C, K)
        else:
            gam = gb.view(N, C).cumsum(1)                            # chunk-local, <= 0
            Dm = (gam.unsqueeze(-1) - gam.unsqueeze(-2)).masked_fill_(~lower, float("-inf")).exp_()
            A.mul_(Dm).tril_(-1)
            P.mul_(Dm)
            eg = gam.exp().unsqueeze(-1)
            torch.mul(kc, eg * bc, out=rhs[..., :K])
            qt = qc * eg
            torch.mul(kc, (gam[:, -1:] - gam).exp().unsqueeze(-1), out=kh.view(N, C, K))
            decay, kt = gam[:, -1].exp(), kh
        A.mul_(bc).diagonal(dim1=1, dim2=2).fill_(1)
        P.tril_()
        torch.mul(vc, bc, out=rhs[..., K:])
        WU = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        W, U = WU[..., :K], WU[..., K:]                                 # (N, C, K), (N, C, V)
        # each chunk as an affine map of its incoming state: S' = M S + R, M = a I - K^^T W, R = K^^T U
        ktT = kt.reshape(N, C, K).transpose(1, 2)
        torch.bmm(ktT, W, out=M.view(N, K, K)).neg_()
        M.view(N, K, K).diagonal(dim1=1, dim2=2).add_(1.0 if decay is None else decay.view(N, 1))
        torch.bmm(ktT, U, out=R.view(N, K, V))
        for j in range(n):
            torch.baddbmm(R[j], M[j], states[j], out=states[j + 1])
        before = states[:n].view(N, K, V)
        torch.baddbmm(U, W, before, alpha=-1, out=Dv.view(N, C, V))   # D = U - W S
        torch.bmm(qt, before, out=ob)
        ob.baddbmm_(P, Dv.view(N, C, V))
        out = ob.view(n, B, H, C, V)
        if full:
            chunked(o[:, s:s + full], full).copy_(out[:full // C])
        if s + full < e:
            o[:, s + full:e].copy_(out[full // C, :, :, :e - s - full].transpose(1, 2))
        states[0] = states[n]                                        # padded chunks leave the state as it was
    o.mul_(scale)
    return o, states[0].view(B, H, K, V).clone()
