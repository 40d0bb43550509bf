"""Decayed linear attention, chunkwise, without a gradient: the fast path of the chunk form.

The same three steps as ``chunk.py`` (intra-chunk scores, state to output, state passing), with the
work batched over a *group* of chunks and only the state recurrence left sequential:

    per group of n chunks of C tokens (v and g copied head-major into reused buffers; q and k
    read in place by the multiplies that scale them):
      b    = chunk-local cumulative log-decay                       (BH, n, C[, K])
      q~   = q * exp(b)                                             exponent <= 0
      A    = causal scores of every chunk                          one (BH n, C, C) bmm
      KV_c = (k * exp(b_C - b))^T v                                 one (BH n, K, V) bmm
      S_c  = exp(b_C) * S_{c-1} + KV_c                              n in-place addcmuls (the only loop)
      o    = scale * (A v + q~ S_{c-1})                             two (BH n) bmms

Every buffer is reused from group to group, so a long sequence does not page-fault on T-sized
temporaries (see BENCHMARKS.md), and a call makes ~20 + T/C tensor ops instead of ~15 per chunk.

Scores. With k~ = k * exp(-b), A_ij = q~_i . k~_j for j <= i is exactly sum_k q_ik k_jk exp(b_ik - b_jk):
one plain matmul for a scalar or a per-key-dim decay alike. exp(-b) is a *positive* exponent, so it is
used only when every chunk of the group decays by at most ``LIMIT`` (|b_C| <= 30: factors below e^30,
far from float32's e^88); the upper triangle, where the factors do not cancel, is masked to exact zeros.
That holds for the decays trained models use (RetNet's 1 - 2^-5 gives |b_C| = 2 over 64 tokens).
A group with a stronger decay takes the exact route of ``chunk.py``: the (C, C) matrix exp(b_i - b_j)
for a scalar decay, sub-chunks of 16 for a per-key-dim decay. Both routes agree to rounding.
"""

from __future__ import annotations

import torch

from subquad.ops.common import memory
from subquad.ops.common.chunking import token_slice
from subquad.ops.gla.intra import SUB, _intra_scalar, _intra_vector

LIMIT = 30.0       # largest positive exponent the factorised scores may use
TOKEN_HEADS = 4096  # group size: about this many (token, head) pairs per group


def decay_attention_inference(q, k, v, g, *, scale, chunk_size, initial_state=None, group=None):
    """q, k (B, T, H, K); v (B, T, H, V); g (B, T, H) or (B, T, H, K) log-decays <= 0.
    Returns o (B, T, H, V) in g's dtype and the final state (B, H, K, V). ``group``: tokens per group
    (a multiple of the chunk size; by default about TOKEN_HEADS / (B H))."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt, dev = g.dtype, q.device
    vector = g.dim() == 4
    C = min(chunk_size, T)
    if vector:                               # the exact route needs whole sub-chunks
        C = max(SUB, -(-C // SUB) * SUB)
    BH = B * H
    L = group if group is not None else max(1, TOKEN_HEADS // BH // C) * C
    L = min(-(-L // C) * C, -(-T // C) * C)
    n = L // C
    Kg = K if vector else 1

    def buf(*shape):
        return torch.empty(*shape, dtype=dt, device=dev)

    qb, kb, vb, gb = buf(B, H, L, K), buf(B, H, L, K), buf(B, H, L, V), buf(B, H, L, Kg)   # head-major copies
    qt, kt = buf(BH * n, C, K), buf(BH * n, C, K)
    scores, ob, kv = buf(BH * n, C, C), buf(BH, n, C, V), buf(BH, n, K, V)
    states = buf(BH, n, K, V)                                      # states[:, j]: the state before chunk j
    S = buf(BH, K, V).zero_() if initial_state is None else initial_state.reshape(BH, K, V).to(dt).clone()
    o = memory.empty(B, T, H, V, dtype=dt, device=dev)

    def piece(x, s, e):
        """Tokens [s, e) of a (B, T, H, *) tensor as (B, H, L, *), zero-padded to L; a view when whole."""
        return token_slice(x, s, e, L).transpose(1, 2)

    G = -(-T // L)                                                   # groups
    gp = token_slice(g, 0, T, G * L)                                 # zero-padded: padding decays nothing
    if vector:                                                       # per group, below
        sums = gp.reshape(B, G, n, C, H, K).sum(3)
        ball = None
    else:                                                            # every chunk's cumulative sum at once
        ball = gp.transpose(1, 2).reshape(BH, G * n, C, 1).cumsum(2)
        eball = ball.exp()
        sums = ball[:, :, -1].view(B, H, G, n).transpose(1, 2)
    factorised = (sums.reshape(B, G, -1).amin(dim=(0, 2)) >= -LIMIT).tolist()   # one sync for the call

    for s in range(0, T, L):
        e = min(s + L, T)
        vb.copy_(piece(v, s, e))
        if vector:
            gb.copy_(piece(g, s, e))
            b = gb.view(BH, n, C, Kg).cumsum(2)                      # chunk-local, <= 0
            eb = b.exp()
        else:
            b, eb = ball[:, s // C:s // C + n], eball[:, s // C:s // C + n]
        vc = vb.view(BH * n, C, V)
        qs, ks = piece(q, s, e), piece(k, s, e)                       # read in place, not copied
        eb5 = eb.view(B, H, n, C, Kg)
        torch.mul(qs.view(B, H, n, C, K), eb5 * scale, out=qt.view(B, H, n, C, K))   # q~ = scale q exp(b)
        b_last = b[:, :, -1:]                                        # (BH, n, 1, Kg)
        if factorised[s // L]:                                       # every chunk decays by <= e^LIMIT
            torch.div(ks.view(B, H, n, C, K), eb5, out=kt.view(B, H, n, C, K))
            torch.bmm(qt, kt.transpose(1, 2), out=scores).tril_()
            torch.bmm(kt.transpose(1, 2), vc, out=kv.view(BH * n, K, V))
            kv.mul_(eb[:, :, -1].unsqueeze(-1))                      # rows scaled by exp(b_C)
        else:                                                        # exact: exponents are differences <= 0
            qb.copy_(qs)
            kb.copy_(ks)
            qc, kc = qb.view(BH * n, C, K), kb.view(BH * n, C, K)
            intra = _intra_vector(qc, kc, b.reshape(BH * n, C, K)) if vector else _intra_scalar(qc, kc, b.reshape(BH * n, C))
            torch.mul(intra, scale, out=scores)
            torch.mul(kb.view(BH, n, C, K), (b_last - b).exp(), out=kt.view(BH, n, C, K))
            torch.bmm(kt.transpose(1, 2), vc, out=kv.view(BH * n, K, V))
        decay = eb[:, :, -1].unsqueeze(-1)                           # (BH, n, Kg, 1)
        states[:, 0].copy_(S)
        for j in range(n - 1):
            torch.addcmul(kv[:, j], decay[:, j], states[:, j], out=states[:, j + 1])
        torch.addcmul(kv[:, -1], decay[:, -1], states[:, -1], out=S)  # padded chunks leave S unchanged
        obf = ob.view(BH * n, C, V)
        torch.bmm(scores, vc, out=obf)
        obf.baddbmm_(qt, states.view(BH * n, K, V))
        o[:, s:e].copy_(ob.view(B, H, L, V)[:, :, :e - s].transpose(1, 2))
    return o, S.view(B, H, K, V)
