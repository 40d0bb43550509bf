"""Decayed linear attention, chunkwise, without a gradient: the fast path of the chunk form.

The same three steps as ``chunk.py`` (intra-chunk scores, state to output, state passing), with the
work batched over a *group* of chunks and only the state recurrence left sequential:

    per group of n chunks of C tokens, in chunk-major buffers (n, B, H, C, *) (v copied in; q and k
    read in place by the multiplies that scale them):
      b    = chunk-local cumulative log-decay                       (n, B, H, C, 1 or K)
      q~   = scale q * exp(b)                                       exponent <= 0
      A    = causal scores of every chunk                          one (n B H, C, C) bmm
      KV_c = (k * exp(b_C - b))^T v                                 one (n B H, K, V) bmm
      S_c  = exp(b_C) * S_{c-1} + KV_c                              n in-place addcmuls (the only loop)
      o    = A v + q~ S_{c-1}                                       two (n B H) bmms

Chunk-major, a chunk's KV and states are contiguous for the loop. For a scalar decay the cumulative sums, exp(b) and exp(-b) of the whole call are
computed once (T H numbers), and whether each group may factorise (below) is decided in one sync.
Every buffer is reused from group to group, so a long sequence allocates no T-sized temporaries
(fresh large allocations page-fault on every call), and a call makes ~20 + T/C tensor ops instead of
~15 per chunk.

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

from subquad.ops.common.chunking import chunk_view, put_chunks, token_slice
from subquad.ops.decay.intra import SUB, _intra_scalar, _intra_vector

from subquad.ops.common.routes import FACTOR_LIMIT as LIMIT, TOKEN_HEADS_DECAY as TOKEN_HEADS
from subquad.ops.common.expo import exp_decay


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
    L = group if group is not None else max(1, TOKEN_HEADS // max(BH, 1) // C) * C      # BH = 0: an empty batch
    L = min(-(-L // C) * C, -(-T // C) * C)
    n = L // C
    Kg = K if vector else 1

    def buf(*shape):
        return torch.empty(*shape, dtype=dt, device=dev)

    # chunk-major buffers, (n, B, H, C, *): a chunk's states and KV are contiguous for the loop
    qb, kb, vb = buf(n, B, H, C, K), buf(n, B, H, C, K), buf(n, B, H, C, V)
    qt, kt = buf(n, B, H, C, K), buf(n, B, H, C, K)
    scores, ob, kv = buf(n * BH, C, C), buf(n, B, H, C, V), buf(n, BH, K, V)
    states = buf(n, BH, K, V)                                      # states[j]: the state before chunk j
    S = buf(BH, K, V).zero_() if initial_state is None else initial_state.reshape(BH, K, V).to(dt).clone()
    o = torch.empty(B, T, H, V, dtype=dt, device=dev)

    G = -(-T // L)                                                   # groups
    gp = token_slice(g if vector else g.unsqueeze(-1), 0, T, G * L)  # zero-padded: padding decays nothing
    if vector:                                                       # cumulative sums per group, below
        sums = gp.reshape(B, G, n, C, H, K).sum(3).transpose(0, 1)
        gb = buf(n, B, H, C, K)
    else:                                                            # every chunk's at once, (G n, B, H, C, 1)
        ball = gp.reshape(B, G * n, C, H, 1).permute(1, 0, 3, 2, 4).cumsum(3)
        qscale, kscale = ball.exp().mul_(scale), ball.neg().exp_()
        sums = ball[:, :, :, -1]
    factorised = (sums.reshape(G, -1).amin(-1) >= -LIMIT).tolist()   # one sync for the call
    for gi, s in enumerate(range(0, T, L)):
        e = min(s + L, T)
        vb.copy_(chunk_view(token_slice(v, s, e, L), C))
        qs, ks = chunk_view(token_slice(q, s, e, L), C), chunk_view(token_slice(k, s, e, L), C)   # read in place
        if vector:
            gb.copy_(chunk_view(token_slice(g, s, e, L), C))
            b = gb.cumsum_(3)                                        # chunk-local, <= 0
        else:
            b = ball[gi * n:(gi + 1) * n]
        b_last = b[:, :, :, -1:]                                     # (n, B, H, 1, Kg)
        if factorised[gi]:                                           # every chunk decays by <= e^LIMIT
            if vector:
                eb = exp_decay(b)
                torch.mul(qs, eb, out=qt).mul_(scale)                # q~ = scale q exp(b)
                torch.div(ks, eb, out=kt)                            # k~ = k exp(-b)
            else:                                                    # exp(+-b) of the whole call, above
                torch.mul(qs, qscale[gi * n:(gi + 1) * n], out=qt)
                torch.mul(ks, kscale[gi * n:(gi + 1) * n], out=kt)
            torch.bmm(qt.view(-1, C, K), kt.view(-1, C, K).transpose(1, 2), out=scores).tril_()
            torch.bmm(kt.view(-1, C, K).transpose(1, 2), vb.view(-1, C, V), out=kv.view(-1, K, V))
            decay = exp_decay(b_last).view(n, BH, Kg, 1)
            kv.mul_(decay)                                           # rows scaled by exp(b_C)
        else:                                                        # exact: exponents are differences <= 0
            qb.copy_(qs)
            kb.copy_(ks)
            qc, kc = qb.view(-1, C, K), kb.view(-1, C, K)
            intra = _intra_vector(qc, kc, b.reshape(-1, C, K)) if vector else _intra_scalar(qc, kc, b.reshape(-1, C))
            torch.mul(intra, scale, out=scores)
            torch.mul(kb, exp_decay(b_last - b), out=kt)
            torch.bmm(kt.view(-1, C, K).transpose(1, 2), vb.view(-1, C, V), out=kv.view(-1, K, V))
            torch.mul(qb, exp_decay(b), out=qt).mul_(scale)
            decay = exp_decay(b_last).view(n, BH, Kg, 1)
        states[0].copy_(S)
        for j in range(n - 1):
            torch.addcmul(kv[j], decay[j], states[j], out=states[j + 1])
        torch.addcmul(kv[-1], decay[-1], states[-1], out=S)          # padded chunks leave S unchanged
        obf = ob.view(-1, C, V)
        torch.bmm(scores, vb.view(-1, C, V), out=obf)
        obf.baddbmm_(qt.view(-1, C, K), states.view(-1, K, V))
        put_chunks(o, s, e, ob)
    return o, S.view(B, H, K, V)
