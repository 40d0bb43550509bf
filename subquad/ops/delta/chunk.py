"""The (gated) delta rule, chunkwise (WY representation; the derivation is in README.md here): the one
engine of the delta family, with and without a gradient.

Per chunk of C tokens with state S_0 carried in, gamma the chunk-local cumulative log-decay (0 for the
plain rule) and Dm_ri = exp(gamma_r - gamma_i) for i <= r:

    1. A  = (I + strictly_lower(diag(b) (K K^T) o Dm))^{-1} diag(b)      (one C x C triangular solve)
    2. W  = A (exp(gamma) o K),  U = A V                                 (WY factors)
    3. D  = U - W S_0                                                    (pseudo-values)
    4. O  = scale * ((exp(gamma) o Q) S_0 + (tril(Q K^T) o Dm) D)        (state to output + intra-chunk)
    5. S  = exp(gamma_C) S_0 + (exp(gamma_C - gamma) o K)^T D           (state passing)

Steps 1, 2 and the state-free factors of 4 and 5 hold no S_0: ``_factors`` computes them for every chunk
of a group at once (batched matmuls, one batched triangular solve; differentiable by autograd, the solve
by its own hand-written backward, ``triangular.py``). Steps 3-5 are ``_StatePassing``, an autograd
Function: its forward (``_pass``) is the loop over chunks, two matmuls per chunk, then step 4's two
products for all chunks at once; its backward is written by hand, the same loop reversed (two matmuls per
chunk) and batched products.

A call with a gradient and one without run the same lines. Without one nothing is recorded, so every
temporary goes into a buffer reused from group to group (``_Workspace``: the ``out=`` of each op, None
under autograd) and the Functions' forwards are called directly.

A call runs in groups of about TOKEN_HEADS_DELTA (token, head) pairs with the state carried between
them: each group's temporaries stay small enough for the cache, and autograd keeps a group's, not a
whole call's. Chunks are at most DELTA_CHUNK tokens (``subquad.ops.common.routes`` says why; the result
does not depend on the chunk size beyond rounding). ``parallel.py`` is the same engine with one chunk
spanning the whole sequence. The public ops' ``route=`` picks between this engine ("chunk") and the
token loop ("token", ``recurrent.py``), which short calls without a gradient take by default.

A per-key-channel decay g (B, T, H, K) (Kimi's KDA) is the same algebra with gamma a vector per token:
exp(gamma) scales K and Q channel-wise, the state decays by diag(exp(gamma_C)), and Dm turns into
exp(gamma_ik - gamma_jk) inside the sums over k - K K^T o Dm and Q K^T o Dm become GLA's sub-chunked
decayed scores (``decay/intra.py``: every exponent a difference <= 0), so chunks are rounded up to a
multiple of its 16-token sub-chunk.

The generalised delta rule (RWKV-7's diag(exp(w_t)) + b_t a_t^T, ``generalized.py``) is the same engine with
its own factors (``_dplr_factors``; README.md here, "The generalised delta rule"): D is the reads a_i^T S_{i-1},
found by one triangular solve per chunk, and each chunk adds two state-free terms the delta rules lack - its
direct writes to the state (H = K^T V, decayed) and to the outputs (X = (Q K^T o Dm) V) - which
``_StatePassing`` takes as optional inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from subquad.ops.common.autograd import wants_grad
from subquad.ops.common.chunking import decay_mask, put_chunks
from subquad.ops.common.expo import exp_decay
from subquad.ops.common.precision import autocast_off, compiling
from subquad.ops.common.routes import DELTA_CHUNK, FACTOR_LIMIT, TOKEN_HEADS_DELTA as TOKEN_HEADS
from subquad.ops.decay.intra import SUB, _intra_vector_rows
from subquad.ops.delta.triangular import unit_lower_solve


class _Workspace:
    """Buffers reused from one group to the next when autograd records nothing. On a CPU a fresh tensor
    of a group's size costs page faults worth several times the op that fills it; a call without a
    gradient therefore writes every temporary into a buffer kept for the next group (``out=``). With a
    gradient (or while torch.compile traces) it hands out None, so the same lines allocate their
    outputs as usual and autograd records them."""

    def __init__(self, on: bool):
        self.on, self._bufs, self._views = on, {}, {}

    def __call__(self, name, shape, like):
        """The buffer ``name`` viewed as ``shape`` (made, or remade when its size changes), or None."""
        if not self.on:
            return None
        key = (name, tuple(shape))
        view = self._views.get(key)
        if view is None:
            b = self._bufs.get(name)
            if b is None or b.numel() != torch.Size(shape).numel():
                b = self._bufs[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
                self._views = {k: w for k, w in self._views.items() if k[0] != name}
            view = self._views[key] = b.view(shape)
        return view

    def copy(self, name, x):
        """x, contiguous: copied into the buffer ``name``, or by autograd."""
        b = self(name, x.shape, x)
        return x.contiguous() if b is None else b.copy_(x)


def _chunks(x, C, like, out, times=None):
    """(B, L, H, *rest) with L a multiple of C -> (n, B*H, C, *rest) in like's dtype, chunk-major: index [j]
    is chunk j of every (batch, head), contiguous. One copy, into ``out`` when it is a buffer; ``times``, a
    tensor in the result's layout, multiplies it (in the copy when there is a buffer)."""
    B, L, H = x.shape[:3]
    rest = x.shape[3:]
    shape = (L // C, B * H, C, *rest)
    perm = (1, 0, 3, 2) + tuple(range(4, 4 + len(rest)))
    x = x.view(B, L // C, C, H, *rest).permute(perm)                   # (n, B, H, C, *rest)
    if out is not None and times is not None:
        times = times.view(L // C, B, H, C, times.shape[-1])
        return torch.mul(x, times, out=out.view(L // C, B, H, C, *rest)).view(shape)
    if out is None:
        out = torch.empty(shape, dtype=like.dtype, device=like.device)
    out.view(L // C, B, H, C, *rest).copy_(x)
    return out if times is None else out * times


def _factors(q, k, v, g, beta, C, ws):
    """Steps 1, 2 and the state-free factors of 4 and 5 for every chunk of a group (tokens a multiple of C).
    Returns, chunk-major (n, B*H, ...): W, U (C, K | V); Q~ = exp(gamma) o Q (C, K); P = tril(Q K^T) o Dm
    (C, C); K^ = exp(gamma_C - gamma) o K (C, K); the state's decay over the chunk, (1, 1) or (K, 1) per
    key row, or None for the plain rule; None, None for the state-free terms H and X (the generalised rule's).
    ``ws``: the workspace (``out=None`` under autograd)."""
    B, L, H, K = q.shape
    V = v.shape[-1]
    n, BH = L // C, B * H
    N = n * BH
    bc = _chunks(beta.unsqueeze(-1), C, beta, ws("b", (n, BH, C, 1), beta))        # (n, BH, C, 1)
    qc, kc = (_chunks(x, C, beta, ws(name, (n, BH, C, K), beta)) for name, x in (("q", q), ("k", k)))
    rv = _chunks(v, C, beta, ws("v", (n, BH, C, V), beta), times=bc)               # diag(b) V  (n, BH, C, V)
    flat = (lambda x, d: x.view(N, C, d))
    kt = flat(kc, K).transpose(1, 2)
    if g is not None and g.dim() == 4:                                  # KDA: a decay per key channel
        gam = _chunks(g, C, beta, ws("g", (n, BH, C, K), beta))
        gam = torch.cumsum(gam, 2, out=ws("gam", gam.shape, beta))      # (n, BH, C, K), chunk-local, <= 0
        # k_i . (e^(g_i - g_j) k_j) and q_i . (e^(g_i - g_j) k_j), causal, their decay factors built once
        KP = _intra_vector_rows(torch.stack([flat(kc, K), flat(qc, K)], 1), flat(kc, K), flat(gam, K))
        KK, P = (ws.copy(name, x.view(n, BH, C, C)) for name, x in (("KK", KP[:, 0]), ("P", KP[:, 1])))
        decay = exp_decay(gam[:, :, -1]).unsqueeze(-1)                  # (n, BH, K, 1)
    else:
        KK = torch.bmm(flat(kc, K), kt, out=ws("KK", (N, C, C), beta)).view(n, BH, C, C)
        P = torch.bmm(flat(qc, K), kt, out=ws("P", (N, C, C), beta)).view(n, BH, C, C)   # (n, BH, C, C)
        if g is None:
            decay = None
        else:
            gam = _chunks(g.unsqueeze(-1), C, beta, ws("g", (n, BH, C, 1), beta))
            gam = torch.cumsum(gam, 2, out=ws("gam", gam.shape, beta))  # (n, BH, C, 1)
            Dm = decay_mask(gam[..., 0], out=ws("Dm", (n, BH, C, C), beta))   # exp(gamma_r - gamma_i), causal
            KK = torch.mul(KK, Dm, out=ws("KK", KK.shape, beta))
            P = torch.mul(P, Dm, out=ws("P", P.shape, beta))
            decay = exp_decay(gam[:, :, -1:])                           # (n, BH, 1, 1)
    if g is None or g.dim() == 4:
        # P's upper triangle is q . k (no gate) or ~1e-38 x q . k (intra's masked decays: subnormal products, the
        # CPU's slow path, in every matmul that reads them). In place: the matmuls before keep their inputs, not P.
        # KK's upper triangle is never read (the solve takes the strictly lower part).
        P = P.tril_()
    KK = torch.mul(KK, bc, out=ws("KK", KK.shape, beta))
    if g is None:
        rk, qg, kd = torch.mul(kc, bc, out=ws("rk", kc.shape, beta)), qc, kc
    else:
        eg = exp_decay(gam)
        rk = torch.mul(kc, eg * bc, out=ws("rk", kc.shape, beta))
        qg = torch.mul(qc, eg, out=ws("q", qc.shape, beta))
        kd = torch.mul(kc, exp_decay(gam[:, :, -1:] - gam), out=ws("kd", kc.shape, beta))
    W, U = unit_lower_solve(KK, rk, rv, out=(ws("W", kc.shape, beta), ws("U", rv.shape, beta)))
    return W, U, qg, P, kd, decay, None, None


def _dplr_factors(q, k, v, w, a, b, C, ws):
    """The generalised delta rule's state-free factors (README.md here, "The generalised delta rule") for every
    chunk of a group, in ``_StatePassing``'s terms, chunk-major (n, BH, ...) and C a multiple of SUB:

        W = -T A~,  U = T (L_ak V)        T = (I - L_ab)^{-1}: D = U - W S_0 are the reads a_i^T S_{i-1}
        Q~ = exp(gamma) o Q,   P = (Q B^T) o Dm,   X = ((Q K^T) o Dm) V
        K^ = exp(gamma_C - gamma) o B,   H = (exp(gamma_C - gamma) o K)^T V,   decay exp(gamma_C) (K, 1)

    The four score sets Q K^T o Dm, Q B^T o Dm, L_ak and L_ab come from ``_dplr_scores``."""
    B, L, H, K = q.shape
    V = v.shape[-1]
    n, BH = L // C, B * H
    qc, kc, ac, bc, wc = (_chunks(x, C, w, ws(name, (n, BH, C, K), w))
                          for name, x in (("q", q), ("k", k), ("a", a), ("b", b), ("g", w)))
    vc = _chunks(v, C, w, ws("v", (n, BH, C, V), w))                    # (n, BH, C, V)
    gam = torch.cumsum(wc, 2)                                           # gamma_i, chunk-local, inclusive, <= 0
    gex = F.pad(gam[:, :, :-1], (0, 0, 1, 0))                           # gamma_{i-1} (exclusive; 0 at i = 0)
    QK, P, Lak, Lab = _dplr_scores(qc, kc, ac, bc, gam, gex)
    nAt = -ac * exp_decay(gex)                                          # -A~ = -exp(gamma_{i-1}) o a_i
    W, U = unit_lower_solve(Lab.neg(), nAt, torch.matmul(Lak, vc))
    tail = exp_decay(gam[:, :, -1:] - gam)                              # exp(gamma_C - gamma)  (n, BH, C, K)
    Hw = torch.matmul((tail * kc).transpose(-1, -2), vc)                # (n, BH, K, V)
    X = torch.matmul(QK, vc)                                            # (n, BH, C, V)
    decay = exp_decay(gam[:, :, -1]).unsqueeze(-1)                      # (n, BH, K, 1)
    return W, U, qc * exp_decay(gam), P.contiguous(), tail * bc, decay, Hw, X


def _dplr_scores(qc, kc, ac, bc, gam, gex):
    """(Q K^T o Dm, Q B^T o Dm, L_ak, L_ab), each (n, BH, C, C): x_i . exp(gamma_i - gamma_j) y_j for j <= i
    and x_i . exp(gamma_{i-1} - gamma_j) y_j for j < i (zero elsewhere). Two ways, the same up to rounding:

    - factored, when no channel of any chunk decays by more than 2 FACTOR_LIMIT (one host sync): about the
      chunk's midpoint m = gamma_C / 2 every factor exp(gamma - m), exp(m - gamma) lies within e^(+-FACTOR_LIMIT),
      so all four sets are one matmul [Q~; A~] [K~; B~]^T, masked after;
    - exact otherwise: ``decay/intra.py``'s sub-chunked scores (every exponent a difference <= 0), the L's
      taken against the keys shifted one token later (y'_m = y_{m-1}) under the exclusive cumulative decay
      and their columns shifted back, L[i, j] = M[i, j + 1]."""
    n, BH, C, K = qc.shape
    tot = gam[:, :, -1:]                                                # (n, BH, 1, K) the chunk's whole decay
    if gam.device.type != "meta" and gam.numel() and float(tot.detach().min()) >= -2 * FACTOR_LIMIT:
        m = tot / 2
        e = torch.exp(m - gam)                                          # within e^(+-FACTOR_LIMIT)
        rows = torch.cat([qc * torch.exp(gam - m), ac * torch.exp(gex - m)], 2)   # (n, BH, 2C, K)
        S4 = torch.matmul(rows, torch.cat([kc * e, bc * e], 2).transpose(-1, -2))  # (n, BH, 2C, 2C)
        top, bottom = S4[..., :C, :], S4[..., C:, :]
        return (top[..., :C].tril(), top[..., C:].tril(), bottom[..., :C].tril(-1), bottom[..., C:].tril(-1))
    N = n * BH
    later = (lambda x: F.pad(x[:, :, :-1], (0, 0, 1, 0)))               # y'_m = y_{m-1}, 0 at m = 0
    flat = (lambda x: x.reshape(N, C, K))
    scores = _intra_vector_rows(                                        # four score sets, one call: (4 N, 1, C, C)
        torch.cat([flat(qc), flat(qc), flat(ac), flat(ac)]).unsqueeze(1),
        torch.cat([flat(kc), flat(bc), flat(later(kc)), flat(later(bc))]),
        torch.cat([flat(gam), flat(gam), flat(gex), flat(gex)]))
    QK, P, AK, AB = scores.view(4, n, BH, C, C).unbind(0)
    return (QK, P) + tuple(F.pad(x[..., 1:], (0, 1)) for x in (AK, AB))


def _pass(W, U, qg, P, kd, decay, Hw, X, S0, scale, ws):
    """``_StatePassing``'s forward: o (n, BH, C, V), the states before each chunk and after the last (n + 1,
    BH, K, V), and D (n, BH, C, V). Called directly when autograd records nothing (no Function to apply)."""
    n, BH, C, K = W.shape
    V = U.shape[-1]
    states = ws("states", (n + 1, BH, K, V), W)                        # states[j]: the state before chunk j
    states = W.new_empty(n + 1, BH, K, V) if states is None else states
    states[0] = S0
    D = U if ws.on else U.clone()                                      # U becomes D in place (a buffer)
    Ss, Ds = states.unbind(0), D.unbind(0)                             # per-chunk views, made in two calls
    for j, (Wj, kdj) in enumerate(zip(W.unbind(0), kd.transpose(-1, -2).unbind(0))):   # the only sequential part
        Ds[j].baddbmm_(Wj, Ss[j], alpha=-1)                            # D = U - W S
        if decay is None:
            torch.baddbmm(Ss[j], kdj, Ds[j], out=Ss[j + 1])
        else:
            torch.mul(Ss[j], decay[j], out=Ss[j + 1]).baddbmm_(kdj, Ds[j])
        if Hw is not None:
            Ss[j + 1].add_(Hw[j])
    o = ws("o", (n * BH, C, V), W)
    o = W.new_empty(n * BH, C, V) if o is None else o
    o.baddbmm_(qg.view(n * BH, C, K), states[:n].view(n * BH, K, V), beta=0, alpha=scale)   # beta = 0: o is ignored
    o.baddbmm_(P.view(n * BH, C, C), D.view(n * BH, C, V), alpha=scale)
    if X is not None:
        o.add_(X.view(n * BH, C, V), alpha=scale)
    return o.view(n, BH, C, V), states, D


class _StatePassing(torch.autograd.Function):
    """Steps 3-5 for the chunks of a group, chunk-major (n, BH, ...):

        D_j = U_j - W_j S_j,   S_{j+1} = a_j S_j + K^_j^T D_j + H_j       (the loop: two matmuls per chunk)
        O   = scale (Q~ S + P D + X)                                      (all chunks at once)

    H (K, V) and X (C, V) are state-free terms a chunk adds to the state and the output: None for the
    delta rules; the generalised rule's direct writes K^T V and intra-chunk outputs (README.md here).
    Backward, the loop reversed with dS_n the final state's gradient:

        dD_j = scale P_j^T dO_j + K^_j dS_{j+1},   dS_j = a_j dS_{j+1} + scale Q~_j^T dO_j - W_j^T dD_j
        dW = -dD S^T,  dU = dD,  dQ~ = scale dO S^T,  dP = scale dO D^T,  dK^ = D dS_{+1}^T,
        da_j = sum(S_j o dS_{j+1}) over what a_j broadcasts over,  dH_j = dS_{j+1},  dX = scale dO."""

    @staticmethod
    @autocast_off
    def forward(ctx, W, U, qg, P, kd, decay, Hw, X, S0, scale, ws):
        o, states, D = _pass(W, U, qg, P, kd, decay, Hw, X, S0, scale, ws)
        ctx.scale, ctx.extra = scale, (Hw is not None, X is not None)
        ctx.save_for_backward(W, qg, P, kd, decay, states, D)
        return o, states[-1]

    @staticmethod
    @autocast_off
    def backward(ctx, do, dS):
        W, qg, P, kd, decay, states, D = ctx.saved_tensors
        scale = ctx.scale
        n, BH, C, K = W.shape
        V = D.shape[-1]
        flat = (lambda x, *s: x.reshape(n * BH, *s))
        do = flat(do.contiguous(), C, V)
        dD = torch.bmm(flat(P, C, C).transpose(1, 2), do).mul_(scale)         # (n BH, C, V)
        G = torch.bmm(flat(qg, C, K).transpose(1, 2), do).mul_(scale)         # scale Q~^T dO  (n BH, K, V)
        dD, G = dD.view(n, BH, C, V), G.view(n, BH, K, V)
        dstates = states.new_empty(n + 1, BH, K, V)                           # dstates[j]: d(state before chunk j)
        dstates[n] = 0 if dS is None else dS
        dSs, dDs, Gs, Wt, kds = (x.unbind(0) for x in (dstates, dD, G, W.transpose(-1, -2), kd))
        for j in reversed(range(n)):
            dDs[j].baddbmm_(kds[j], dSs[j + 1])
            if decay is not None:
                Gs[j].addcmul_(decay[j], dSs[j + 1])
            else:
                Gs[j].add_(dSs[j + 1])
            torch.baddbmm(Gs[j], Wt[j], dDs[j], alpha=-1, out=dSs[j])
        before, after = flat(states[:n], K, V), flat(dstates[1:], K, V)
        dDf = flat(dD, C, V)
        dW = torch.bmm(dDf, before.transpose(1, 2)).neg_()
        dqg = torch.bmm(do, before.transpose(1, 2)).mul_(scale)
        dP = torch.bmm(do, flat(D, C, V).transpose(1, 2)).mul_(scale)
        dkd = torch.bmm(flat(D, C, V), after.transpose(1, 2))
        ddecay = None
        if decay is not None:
            prod = (states[:n] * dstates[1:]).sum(-1, keepdim=True)            # (n, BH, K, 1)
            ddecay = prod if decay.shape[-2] == K else prod.sum(-2, keepdim=True)
        shape = (n, BH, C)
        dH = dstates[1:] if ctx.extra[0] else None
        dX = do.view(*shape, V) * scale if ctx.extra[1] else None
        return (dW.view(*shape, K), dD, dqg.view(*shape, K), dP.view(*shape, C), dkd.view(*shape, K), ddecay,
                dH, dX, dstates[0], None, None)


def group_tokens(B, H, C, T):
    """Tokens per group: about TOKEN_HEADS (token, head) pairs, whole chunks, at most the call's."""
    L = max(1, TOKEN_HEADS // max(B * H, 1) // C) * C                   # B H = 0: an empty batch
    return min(L, -(-T // C) * C)


def chunk_delta(q, k, v, g, beta, *, scale, chunk_size=64, initial_state=None, group=None):
    """q, k (B, T, H, K); v (B, T, H, V); beta (B, T, H); g (B, T, H), (B, T, H, K) for a decay per key
    channel (KDA), or None for the plain rule; initial_state (B, H, K, V) or None. Returns o (B, T, H, V)
    in beta's dtype and the final state (B, H, K, V). ``group``: tokens per group (rounded up to whole
    chunks), else ``group_tokens``'s."""
    B, T, H, K = q.shape
    C = min(chunk_size, DELTA_CHUNK, T)
    if g is not None and g.dim() == 4:                                  # KDA's scores use sub-chunks of SUB
        C = -(-C // SUB) * SUB
    L = group_tokens(B, H, C, T) if group is None else -(-group // C) * C
    return _engine(_factors, (q, k, v, g, beta), beta.dtype, scale, C, L, initial_state)


def _engine(factors, xs, sd, scale, C, L, initial_state):
    """Groups of L tokens (a multiple of C) in turn, the state carried; a last, partial group is zero-padded
    to whole chunks (zero keys, writes and log-decays add nothing). ``factors(*xs, C, ws)``: a rule's
    state-free factors (``_factors``, ``_dplr_factors``); xs its per-token inputs (B, T, H, ...), q, k, v
    first, None for an absent gate; sd the state's dtype."""
    q, v = xs[0], xs[2]
    B, T, H, K = q.shape
    V = v.shape[-1]
    ws = _Workspace(not (wants_grad(*xs, initial_state) or compiling()))
    S = (torch.zeros(B * H, K, V, dtype=sd, device=q.device) if initial_state is None
         else initial_state.reshape(B * H, K, V))
    o = torch.empty(B, T, H, V, dtype=sd, device=q.device) if ws.on else []
    # torch.split, not slicing: its backward is one concatenation
    xs = [x.split(L, 1) if x is not None else [None] * -(-T // L) for x in xs]
    for s, piece in zip(range(0, T, L), zip(*xs)):
        n = piece[0].shape[1]
        pad = -n % C
        if pad:
            piece = [None if x is None else F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in piece]
        factors_ = factors(*piece, C, ws)
        if ws.on:                                                       # nothing to record: no Function
            og, states, _ = _pass(*factors_, S, scale, ws)
            S = states[-1]
        else:
            og, S = _StatePassing.apply(*factors_, S, scale, ws)          # (n, BH, C, V)
        og = og.view((n + pad) // C, B, H, C, V)
        if ws.on:
            put_chunks(o, s, s + n, og)
        else:
            o.append(og.permute(1, 0, 3, 2, 4).reshape(B, n + pad, H, V)[:, :n])
    if ws.on:
        S = S.clone()                                                   # not a view of the states buffer
    else:
        o = o[0] if len(o) == 1 else torch.cat(o, 1)
    return o, S.reshape(B, H, K, V)


def chunk_dplr(q, k, v, w, a, b, *, scale, chunk_size=64, initial_state=None, group=None):
    """The generalised delta rule by the same engine: q, k, w, a, b (B, T, H, K); v (B, T, H, V); w the
    log-decay in the state's dtype; initial_state (B, H, K, V) or None. Returns o (B, T, H, V) in w's dtype
    and the final state (B, H, K, V). Chunks are rounded up to a multiple of ``decay/intra.py``'s SUB."""
    B, T, H, K = q.shape
    C = -(-min(chunk_size, DELTA_CHUNK, T) // SUB) * SUB
    L = group_tokens(B, H, C, T) if group is None else -(-group // C) * C
    return _engine(_dplr_factors, (q, k, v, w, a, b), w.dtype, scale, C, L, initial_state)
