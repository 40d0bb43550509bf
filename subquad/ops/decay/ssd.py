"""Mamba-2's SSD with B and C shared by the heads, chunkwise without a gradient (``ssd_inference``).

    h_t = exp(dt_t A_h) h_{t-1} + B_t (dt_t x_t)^T        h (N, P) per head h; B_t, C_t (N,) shared
    y_t = C_t^T h_t

This is ``simple_gla(q=C, k=dt B, v=x, g=dt A)`` with q and k the same for every head (Mamba-2 with
one group), and sharing them is what makes it cheaper than H separate heads.

Without a gradient (``ssd_inference``), per group of n chunks of C tokens, b the chunk-local cumulative
log-decay per head and m = b_C / 2 its midpoint, where every chunk of the group has |b_C| <= 2 LIMIT:

    CB   = tril(C_c B_c^T)                              (C, C) per chunk, once for all heads
    X    = exp(m - b) dt x                              (C, H P): factors within e^(+-|b_C|/2)
    KV_c = exp(b_C - m) B_c^T X                         one (N, C) x (C, H P) matmul for all heads
    S_{c+1} = exp(b_C) S_c + KV_c                       per head; the only loop
    y    = exp(b - m) (CB X + C_c exp(m) S_c)            two (C, *) x (*, H P) matmuls for all heads

exp(b_i - m) exp(m - b_j) = exp(b_i - b_j) for j <= i; above the diagonal CB's zeros meet finite factors.
Every product is one matmul over all heads, in the (token, head) layout x arrives in, and no (C, C)
matrix of exponentials is formed. A group with a stronger decay takes the exact route: the per-head
decayed mask exp(b_i - b_j) (exponents <= 0) times CB, multiplied head by head:

    o_h  = (CB o exp(b_hi - b_hj) o [i >= j]) (dt x)_h  intra-chunk, per head (exponents <= 0)
         + exp(b_h) o (C_c S_c)_h                      C_c S_c one (C, N) x (N, H P) matmul for all heads
    KV_c = B_c^T (exp(b_C - b) dt x)                   one (N, C) x (C, H P) matmul for all heads

Which route each group takes is decided once per call (one sync), or forced by ``route``; the routes
taken are recorded (``routes.took("ssd", ...)``). With a gradient, SSD runs the decayed family's chunk
engine (``chunk.py``) on B and C copied to every head: its hand-written backward beats any autograd of
these shared products, while without a gradient the shared products here are the faster layout.

The reference is ``simple_gla`` (tests check them equal in float64).
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import state_dtype
from subquad.ops.common.chunking import chunk_view, decay_mask, put_chunks, token_slice

from subquad.ops.common.routes import FACTOR_LIMIT as LIMIT, TOKEN_HEADS_SSD as TOKEN_HEADS, took
from subquad.ops.common.expo import exp_decay, exp_decay_

TOKEN_MAJOR = (1, 0, 2, 3, 4)   # chunk_view of (B, L, H, P) as (n, B, C, H, P): heads stay inside a token


def ssd_inference(x, dt, A, Bm, Cm, *, chunk_size=64, initial_state=None, group=None, route=None):
    """x (B, T, H, P); dt (B, T, H) > 0; A (H,) < 0; Bm, Cm (B, T, N); initial_state (B, H, N, P).
    Returns y (B, T, H, P) and the final state (B, H, N, P), in x's dtype (float32 for half inputs).
    ``route``: None (per group, by LIMIT), "factorised" or "exact" (every group)."""
    Bz, T, H, P = x.shape
    N = Bm.shape[-1]
    sd = state_dtype(x.dtype)
    dev = x.device
    C = min(chunk_size, T)
    L = group if group is not None else max(1, TOKEN_HEADS // max(Bz * H, 1) // C) * C   # an empty batch: 0
    L = min(-(-L // C) * C, -(-T // C) * C)
    n = L // C
    nb = n * Bz
    ng = -(-T // L)                                                    # groups

    def buf(*shape):
        return torch.empty(*shape, dtype=sd, device=dev)

    Bb, Cb = buf(n, Bz, C, N), buf(n, Bz, C, N)                     # chunk-major copies
    Xf = buf(n, Bz, C, H, P)                                          # factorised: exp(m - b) dt x
    xd = buf(n, Bz, H, C, P)                                          # exact: dt x, head-major (intra-chunk)
    xh = buf(n, Bz, C, H, P)                                          # exact: exp(b_C - b) dt x (state update)
    Lm = buf(nb, H, C, C)
    CB = buf(nb, C, C)
    yb = buf(nb, C, H * P)
    yi = buf(n, Bz, H, C, P)
    Se = buf(n, Bz, N, H, P)                                          # factorised: exp(m) S
    # states[j]: the state before chunk j; states[j + 1] first holds chunk j's KV, then the recurrence adds
    # exp(b_C) states[j] to it in place. No state given: the first chunk starts from zero, and its terms that
    # read states[0] are left out rather than computed on zeros (a short prompt's chunks are few).
    states = buf(n + 1, Bz, N, H, P)
    fresh = initial_state is None
    if not fresh:
        states[0] = initial_state.permute(0, 2, 1, 3)
    final = torch.empty(Bz, H, N, P, dtype=sd, device=dev)            # the last chunk's update writes it
    y = torch.empty(Bz, T, H, P, dtype=sd, device=dev)
    # chunk-local cumulative log-decays of the whole call, (ng n, B, C, H): T H numbers
    ball = chunk_view(token_slice(dt.to(sd) * A.to(sd), 0, T, ng * L), C, (1, 0, 2, 3)).cumsum(2)
    if route is None:
        factorised = (ball[:, :, -1].reshape(ng, -1).amin(-1) >= -2 * LIMIT).tolist()   # one sync for the call
    else:
        factorised = [route == "factorised"] * ng
    for f in sorted(set(factorised)):
        took("ssd", "factorised" if f else "exact")
    KV = states[1:].view(n, Bz, N, H * P)
    for gi, s in enumerate(range(0, T, L)):
        e = min(s + L, T)
        first = 1 if fresh and gi == 0 else 0                         # chunks from here on read a state
        last = e == T
        xs, dts, Bs, Cs = (token_slice(t, s, e, L) for t in (x, dt, Bm, Cm))   # zero tail: dt = B = 0 add nothing
        Bb.copy_(chunk_view(Bs, C, (1, 0, 2, 3)))
        Cb.copy_(chunk_view(Cs, C, (1, 0, 2, 3)))
        torch.bmm(Cb.view(nb, C, N), Bb.view(nb, C, N).transpose(1, 2), out=CB)
        b = ball[gi * n:(gi + 1) * n]                                 # (n, B, C, H), <= 0
        bC = b[:, :, -1:]                                             # (n, B, 1, H)
        decay = exp_decay(bC).unsqueeze(-1)                                # (n, B, 1, H, 1)
        if factorised[gi]:                                            # every |b_C| <= 2 LIMIT
            m = bC * 0.5                                              # reference: exponents within +-|b_C| / 2
            torch.mul(chunk_view(xs, C, TOKEN_MAJOR),
                      (exp_decay_(m - b) * chunk_view(dts, C, (1, 0, 2, 3))).unsqueeze(-1), out=Xf)
            Xv = Xf.view(nb, C, H * P)
            torch.bmm(Bb.view(nb, C, N).transpose(1, 2), Xv, out=KV.view(nb, N, H * P))
            KV.view(n, Bz, N, H, P).mul_(exp_decay_(bC - m).unsqueeze(-1))   # B^T (exp(b_C - b) dt x)
        else:                                                         # exact: exponents are differences <= 0
            bh = b.permute(0, 1, 3, 2)                                # (n, B, H, C)
            torch.mul(chunk_view(xs, C), chunk_view(dts, C, (1, 0, 3, 2)).unsqueeze(-1), out=xd)
            w = exp_decay_(bh[..., -1:] - bh)                            # (n, B, H, C): exp(b_C - b)
            torch.mul(xd, w.unsqueeze(-1), out=yi)                    # reuse yi as scratch, head-major
            xh.copy_(yi.transpose(2, 3))                              # (n, B, C, H, P)
            decay_mask(bh.reshape(nb, H, C), out=Lm).mul_(CB.unsqueeze(1))
            torch.bmm(Lm.view(nb * H, C, C), xd.view(nb * H, C, P), out=yi.view(nb * H, C, P))
            torch.bmm(Bb.view(nb, C, N).transpose(1, 2), xh.view(nb, C, H * P), out=KV.view(nb, N, H * P))
        for j in range(first, n):                                     # S_{j+1} = KV_j + exp(b_C) S_j
            if last and j == n - 1:                                   # the final state, in its own layout
                torch.addcmul(states[j + 1], decay[j], states[j], out=final.permute(0, 2, 1, 3))
            else:
                states[j + 1].addcmul_(decay[j], states[j])
        if last and first == n:                                       # one chunk from zero: its KV is the state
            final.copy_(states[n].permute(0, 2, 1, 3))
        ybv = yb.view(n, Bz, C, H, P)
        lo = first * Bz                                               # yb's rows of the chunks reading a state
        if factorised[gi]:                                            # y = exp(b - m) (tril(CB) X + C exp(m) S)
            torch.bmm(CB.tril_(), Xv, out=yb)
            if first < n:
                torch.mul(states[first:n], exp_decay(m[first:]).unsqueeze(-1), out=Se[first:])
                yb[lo:].baddbmm_(Cb.view(nb, C, N)[lo:], Se.view(nb, N, H * P)[lo:])
            scale = exp_decay_(b - m).unsqueeze(-1)
            if e - s == L:                                            # straight into the output
                torch.mul(ybv, scale, out=chunk_view(y[:, s:e], C, TOKEN_MAJOR))
            else:
                put_chunks(y, s, e, ybv.mul_(scale), TOKEN_MAJOR)
        else:
            yb[:lo].zero_()
            torch.bmm(Cb.view(nb, C, N)[lo:], states[first:n].view(-1, N, H * P), out=yb[lo:])
            put_chunks(y, s, e, ybv.mul_(exp_decay(b).unsqueeze(-1)).add_(yi.transpose(2, 3)), TOKEN_MAJOR)
        if not last:
            states[0] = states[n]                                      # padded chunks leave the state as it was
    return y, final
