"""Decayed linear attention, chunkwise: one engine for no decay (linear attention), a scalar decay per
head (retention, simple GLA) and a decay per key dim (GLA). O(T C K + T K V), matmul-heavy.

Per chunk of C tokens, with b_i = g_1 + ... + g_i the chunk-local cumulative log-decay (never a
sequence-long cumsum, so float32 keeps its precision) and S the state carried in:

    1. intra-chunk:  A_ij = scale q_i . (exp(b_i - b_j) k_j) for j <= i                (C x C)
    2. state to out: o_i  = sum_j A_ij v_j + (scale q_i exp(b_i)) . S
    3. state pass:   S   <- exp(b_C) S + sum_j (exp(b_C - b_j) k_j) v_j^T

Forward. The chunks are taken in *groups* of n (about TOKEN_HEADS_DECAY (token, head) pairs): one
batched matmul per step for a whole group, in chunk-major buffers (n, B, H, C, *) reused from group to
group (a long call allocates no T-sized temporaries), and only the elementwise state recurrence of
step 3 loops over chunks. Each group takes one of two routes, chosen for the whole call in one sync:

    factorised  q~ = scale q exp(b), k~ = k exp(-b): A = tril(q~ k~^T), one plain matmul for a scalar
                or a per-key-dim decay alike. exp(-b) is a positive exponent, so a group takes this
                route only when each of its chunks decays by at most e^FACTOR_LIMIT (routes.py).
    exact       every exponent a difference <= 0: the (C, C) mask exp(b_i - b_j) for a scalar decay,
                sub-chunks of 16 for a per-key-dim decay (``intra.py``). Stronger decays take it.

Without a decay (g None: linear attention) both are the same plain products (route "chunk"). Short
calls without a gradient (a decoding step) take the token loop instead (route "token").

Backward (``ChunkDecay``; derivation in README.md, numbered). The same groups in reverse: a loop
carries the state's gradient through the chunks (the only sequential step again), every other product
is one batched matmul per group, and the log-decays' gradient comes at the end from dq and dk alone:
dg_t = sum_{s >= t} (q_s . dq_s - k_s . dk_s) + <dS_T, S_T>. The forward keeps only the state before
each chunk (K V numbers per chunk and head) for it.

``route=`` forces a route ("token", "factorised" or "exact"); ``routes.took`` records the one taken.
A forced "factorised" trusts the caller that no chunk decays by more than e^FACTOR_LIMIT.
"""

from __future__ import annotations

import functools

import torch

from subquad.ops.common.autograd import wants_grad
from subquad.ops.common.chunking import chunk_view, decay_mask, put_chunks, token_slice
from subquad.ops.common.expo import exp_decay, exp_decay_
from subquad.ops.common.precision import autocast_off, compiling, outside_graphs
from subquad.ops.common.routes import FACTOR_LIMIT, SHORT, STATES_DECAY, TOKEN_HEADS_DECAY, took
from subquad.ops.decay.intra import SUB, _intra_vector, _intra_vector_grad
from subquad.ops.decay.recurrent import recurrent_decay_attention

ROUTES = ("token", "factorised", "exact")


def _layout(T: int, BH: int, C: int, KV: int, group=None):
    """(L, n, ng): tokens per group (a multiple of C, at most the call's chunks), chunks per group, groups.
    About TOKEN_HEADS_DECAY (token, head) pairs, and at most STATES_DECAY numbers of chunk states."""
    if group is None:
        n = min(TOKEN_HEADS_DECAY // max(BH, 1) // C, STATES_DECAY // max(BH * KV, 1))   # BH = 0: empty
        group = max(1, n) * C
    L = group
    L = min(-(-L // C) * C, -(-T // C) * C)
    return L, L // C, -(-T // L)


def _cumsums(g, B, T, H, C, L, ng):
    """Chunk-local cumulative log-decays of the whole call, chunk-major (ng n, B, H, C, 1 or K)."""
    gk = g if g.dim() == 4 else g.unsqueeze(-1)
    gp = token_slice(gk, 0, T, ng * L)                              # zero-padded: padding decays nothing
    return gp.reshape(B, ng * L // C, C, H, gk.shape[-1]).permute(1, 0, 3, 2, 4).cumsum(3)


def _pick_routes(ball, ng: int, route):
    """Each group's route: forced, "chunk" without a decay, else factorised where every chunk of the group
    decays by at most e^FACTOR_LIMIT (one sync for the call). Where no value may be read (compiling, the
    meta device, an empty batch) every group is exact, which holds for any decay."""
    if ball is None:
        return ["chunk"] * ng
    if route is not None:
        return [route] * ng
    if compiling() or ball.device.type == "meta" or ball.numel() == 0:
        return ["exact"] * ng
    ok = (ball[:, :, :, -1].reshape(ng, -1).amin(-1) >= -FACTOR_LIMIT).tolist()
    return ["factorised" if f else "exact" for f in ok]


def _rows(qs, ks, b, route, scale, qt, kt, qb, kb):
    """A group's scaled rows, written into qt and kt (n, B, H, C, K):

        no decay     qt = scale q            kt = k
        factorised   qt = scale q exp(b)     kt = k exp(-b)
        exact        qt = scale q exp(b)     kt = k exp(b_C - b)       (q, k copied to qb, kb as well)

    Returns (exp(b_C) (n, B H, 1 or K, 1), kf, scale exp(b), exp(b_C - b)), None where the route has none;
    kf (factorised) is exp(-b) for a scalar decay, exp(b) to divide by for a per-key-dim one."""
    if b is None:
        torch.mul(qs, scale, out=qt)
        kt.copy_(ks)
        return None, None, None, None
    n, B, H = b.shape[:3]
    b_last = b[:, :, :, -1:]                                         # (n, B, H, 1, Kg)
    decay = exp_decay(b_last).reshape(n, B * H, b.shape[-1], 1)
    eb = exp_decay(b)
    se = eb * scale
    torch.mul(qs, se, out=qt)
    if route == "factorised":                                        # exp(-b) <= e^FACTOR_LIMIT
        if b.shape[-1] == 1:                                         # a scalar decay: a few exps, a multiply
            kf = torch.exp(-b)
            torch.mul(ks, kf, out=kt)
        else:                                                        # per key dim: a division, no more exps
            kf = eb
            torch.div(ks, eb, out=kt)
        return decay, kf, se, None
    qb.copy_(qs)
    kb.copy_(ks)
    w = exp_decay_(b_last - b)
    torch.mul(kb, w, out=kt)
    return decay, None, se, w


def _exact_scores(qb, kb, b, scale, out):
    """scale * A_ij = scale q_i . (exp(b_i - b_j) k_j), j <= i, exponents <= 0, into out (n B H, C, C)."""
    C, K = qb.shape[-2:]
    qc, kc = qb.view(-1, C, K), kb.view(-1, C, K)
    if b.shape[-1] == 1:                                             # scalar decay: the (C, C) mask
        torch.bmm(qc, kc.transpose(1, 2), out=out)
        return out.mul_(decay_mask(b.reshape(-1, C))).mul_(scale)
    return torch.mul(_intra_vector(qc, kc, b.reshape(-1, C, K)), scale, out=out)


def _forward(q, k, v, ball, S0, scale, C, L, routes, states_all=None):
    """Steps 1-3 over groups of chunks. states_all (ng n, B H, K, V): where to keep the state before every
    chunk (for the backward); None keeps one group's. Returns o (B, T, H, V) and the final state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BH, n, sd, dev = B * H, L // C, q.dtype, q.device
    buf = functools.partial(torch.empty, dtype=sd, device=dev)

    exact = "exact" in routes
    vb, ob = buf(n, B, H, C, V), buf(n, B, H, C, V)
    qt, kt = buf(n, B, H, C, K), buf(n, B, H, C, K)
    qb, kb = (buf(n, B, H, C, K), buf(n, B, H, C, K)) if exact else (None, None)
    scores, kv = buf(n * BH, C, C), buf(n, BH, K, V)
    group_states = buf(n, BH, K, V) if states_all is None else None
    S = buf(BH, K, V).zero_() if S0 is None else S0.reshape(BH, K, V).clone()
    o = torch.empty(B, T, H, V, dtype=sd, device=dev)
    for gi, s in enumerate(range(0, T, L)):
        e = min(s + L, T)
        vb.copy_(chunk_view(token_slice(v, s, e, L), C))
        qs, ks = chunk_view(token_slice(q, s, e, L), C), chunk_view(token_slice(k, s, e, L), C)   # in place
        b = None if ball is None else ball[gi * n:(gi + 1) * n]
        decay = _rows(qs, ks, b, routes[gi], scale, qt, kt, qb, kb)[0]
        if routes[gi] == "exact":
            _exact_scores(qb, kb, b, scale, scores)
        else:
            torch.bmm(qt.view(-1, C, K), kt.view(-1, C, K).transpose(1, 2), out=scores).tril_()
        torch.bmm(kt.view(-1, C, K).transpose(1, 2), vb.view(-1, C, V), out=kv.view(-1, K, V))
        if routes[gi] == "factorised":
            kv.mul_(decay)                                           # (k exp(b_C - b))^T v
        states = group_states if states_all is None else states_all[gi * n:(gi + 1) * n]
        states[0].copy_(S)                                           # states[j]: the state before chunk j
        for j in range(n):
            nxt = states[j + 1] if j + 1 < n else S                  # padded chunks leave S unchanged
            if decay is None:
                torch.add(kv[j], states[j], out=nxt)
            else:
                torch.addcmul(kv[j], decay[j], states[j], out=nxt)
        obf = ob.view(-1, C, V)
        torch.bmm(scores, vb.view(-1, C, V), out=obf)
        obf.baddbmm_(qt.view(-1, C, K), states.view(-1, K, V))
        put_chunks(o, s, e, ob)
    return o, S.view(B, H, K, V)


def _backward(q, k, v, do, dS, ball, states_all, scale, C, L, routes, ends=None):
    """The gradients of q, k, v and the initial state: the groups in reverse (module docstring).
    ``ends`` (ng n, B H, K): where to put <dS_after, S_after> per chunk and key row, for dg (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BH, n, sd, dev = B * H, L // C, q.dtype, q.device
    nb = n * BH
    buf = functools.partial(torch.empty, dtype=sd, device=dev)

    exact = "exact" in routes
    vb, dob = buf(n, B, H, C, V), buf(n, B, H, C, V)
    qt, kt = buf(n, B, H, C, K), buf(n, B, H, C, K)
    qb, kb = (buf(n, B, H, C, K), buf(n, B, H, C, K)) if exact else (None, None)
    A, dA = buf(nb, C, C), buf(nb, C, C)
    dqb, dkb, dvb = buf(n, B, H, C, K), buf(n, B, H, C, K), buf(n, B, H, C, V)
    qdo, gt = buf(nb, K, V), buf(n, BH, K, V)
    grads = buf(n + 1, BH, K, V)                                     # grads[j]: dL/d(state before chunk j)
    grads[n] = 0 if dS is None else dS.reshape(BH, K, V)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dqf, dkf, dvf = dqb.view(nb, C, K), dkb.view(nb, C, K), dvb.view(nb, C, V)
    for gi in reversed(range(len(routes))):
        s = gi * L
        e = min(s + L, T)
        route = routes[gi]
        vb.copy_(chunk_view(token_slice(v, s, e, L), C))
        dob.copy_(chunk_view(token_slice(do, s, e, L), C))
        qs, ks = chunk_view(token_slice(q, s, e, L), C), chunk_view(token_slice(k, s, e, L), C)
        b = None if ball is None else ball[gi * n:(gi + 1) * n]
        decay, kf, se, w = _rows(qs, ks, b, route, scale, qt, kt, qb, kb)
        qtf, ktf, vf, dof = qt.view(nb, C, K), kt.view(nb, C, K), vb.view(nb, C, V), dob.view(nb, C, V)
        states = states_all[gi * n:(gi + 1) * n].view(nb, K, V)
        # the state's gradient, chunk by chunk in reverse: dS_before = exp(b_C) dS_after + qt^T dO
        torch.bmm(qtf.transpose(1, 2), dof, out=qdo)
        qd = qdo.view(n, BH, K, V)
        for j in reversed(range(n)):
            if decay is None:
                torch.add(qd[j], grads[j + 1], out=grads[j])
            else:
                torch.addcmul(qd[j], decay[j], grads[j + 1], out=grads[j])
        after = grads[1:]                                            # dL/d(state after chunk j)
        if ends is not None:
            torch.mul(after, states_all[gi * n + 1:(gi + 1) * n + 1], out=gt)
            torch.sum(gt, -1, out=ends[gi * n:(gi + 1) * n])
        torch.bmm(dof, states.transpose(1, 2), out=dqf)              # dO S^T
        if route == "exact":                                         # exponents <= 0 throughout
            qbf, kbf = qb.view(nb, C, K), kb.view(nb, C, K)
            torch.bmm(dof, vf.transpose(1, 2), out=dA)
            dqb.mul_(se)                                             # scale exp(b) dO S^T, + W k
            torch.bmm(vf, after.view(nb, K, V).transpose(1, 2), out=dkf)
            dkb.mul_(w)                                              # exp(b_C - b) V dS^T, + W^T q
            if b.shape[-1] == 1:                                     # W = scale (dO V^T) o D
                D = decay_mask(b.reshape(nb, C))
                torch.bmm(qbf, kbf.transpose(1, 2), out=A).mul_(D).mul_(scale)
                dA.mul_(D).mul_(scale)
                dqf.baddbmm_(dA, kbf)
                dkf.baddbmm_(dA.transpose(1, 2), qbf)
            else:                                                    # through intra.py's sub-chunks
                _exact_scores(qb, kb, b, scale, A)
                dqi, dki = _intra_vector_grad(qbf, kbf, b.reshape(nb, C, K), dA.tril_().mul_(scale))
                dqf.add_(dqi)
                dkf.add_(dki)
            torch.bmm(ktf, after.view(nb, K, V), out=dvf)            # (k exp(b_C - b)) dS
        else:                                                        # factorised, or no decay
            torch.bmm(qtf, ktf.transpose(1, 2), out=A).tril_()
            torch.bmm(dof, vf.transpose(1, 2), out=dA).tril_()
            ga = after if decay is None else torch.mul(after, decay, out=gt)   # exp(b_C) dS_after
            dqf.baddbmm_(dA, ktf)
            dqb.mul_(scale if se is None else se)
            torch.bmm(vf, ga.view(nb, K, V).transpose(1, 2), out=dkf)
            dkf.baddbmm_(dA.transpose(1, 2), qtf)
            if kf is not None and b.shape[-1] == 1:                  # k~ = k exp(-b)
                dkb.mul_(kf)
            elif kf is not None:
                dkb.div_(kf)
            torch.bmm(ktf, ga.view(nb, K, V), out=dvf)
        dvf.baddbmm_(A.transpose(1, 2), dof)
        put_chunks(dq, s, e, dqb)
        put_chunks(dk, s, e, dkb)
        put_chunks(dv, s, e, dvb)
        grads[n] = grads[0]
    return dq, dk, dv, grads[n].view(B, H, K, V)


def _log_decay_grad(q, k, dq, dk, ends, C: int, vector: bool):
    """dL/dg from dq and dk (README.md, steps 5-6): inside a chunk the loss sees the chunk-local b_i only
    through q_i exp(b_i), k_i exp(-b_i) and the factor exp(b_C) of the state passed on, so
    dL/db_i = q_i . dq_i - k_i . dk_i (+ <dS_after, S_after> at the chunk's last token), and
    dL/dg_i = sum_{r >= i in the chunk} dL/db_r: a reverse cumsum inside each chunk, never a sequence-long
    one (whose rounding would grow with T). ``ends`` (chunks, B H, K): <dS_after, S_after> per key row."""
    B, T, H, K = q.shape
    N = ends.shape[0]
    db = q.new_zeros(B, N * C, H, K)
    torch.sub(q * dq, k * dk, out=db[:, :T])
    db = db.view(B, N, C, H, K)
    db[:, :, -1] += ends.view(N, B, H, K).transpose(0, 1)
    if not vector:
        db = db.sum(-1)
    dg = db.flip(2).cumsum(2).flip(2)
    return dg.reshape(B, N * C, H, *dg.shape[4:])[:, :T]


class ChunkDecay(torch.autograd.Function):
    """The chunk engine with its hand-written backward (module docstring; README.md)."""

    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, g, S0, ball, scale, C, L, routes):
        n = L // C
        B, _, H, K = q.shape
        states_all = q.new_empty(len(routes) * n + 1, B * H, K, v.shape[-1])   # and the final state
        o, S = _forward(q, k, v, ball, S0, scale, C, L, routes, states_all)
        states_all[-1] = S.view(B * H, K, v.shape[-1])
        ctx.save_for_backward(q, k, v, ball, states_all)
        ctx.scale, ctx.C, ctx.L, ctx.routes, ctx.vector = scale, C, L, routes, g is not None and g.dim() == 4
        return o, S

    @staticmethod
    @autocast_off
    def backward(ctx, do, dS):
        q, k, v, ball, states_all = ctx.saved_tensors
        B, _, H, K = q.shape
        ends = q.new_empty(states_all.shape[0] - 1, B * H, K) if ctx.needs_input_grad[3] else None
        dq, dk, dv, dS0 = _backward(q, k, v, do, dS, ball, states_all, ctx.scale, ctx.C, ctx.L, ctx.routes, ends)
        dg = _log_decay_grad(q, k, dq, dk, ends, ctx.C, ctx.vector) if ends is not None else None
        return dq, dk, dv, dg, dS0, None, None, None, None, None


@outside_graphs
def chunk_engine(q, k, v, g, *, scale, chunk_size, initial_state=None, route=None, op="simple_gla", group=None):
    """The chunk routes: q, k (B, T, H, K); v (B, T, H, V); g (B, T, H), (B, T, H, K) or None (no decay),
    all in the state's dtype; initial_state (B, H, K, V) or None. ``route``: None, "factorised" or
    "exact"; ``group``: tokens per group (tests). Returns (o (B, T, H, V), final state (B, H, K, V)).

    torch.compile runs it as it is, outside the graph (as it would a custom kernel): it writes into
    preallocated buffers, which the graph's functional rewrite would re-stride, and picks its routes
    from the values of g."""
    B, T, H, K = q.shape
    C = min(chunk_size, T)                                           # past T: one chunk of T
    if g is not None and g.dim() == 4:                               # whole sub-chunks for the exact route
        C = max(SUB, -(-C // SUB) * SUB)
    L, n, ng = _layout(T, B * H, C, K * v.shape[-1], group)
    with torch.no_grad():
        ball = None if g is None else _cumsums(g.detach(), B, T, H, C, L, ng)
    routes = _pick_routes(ball, ng, route)
    for r in sorted(set(routes)):
        took(op, r)
    if wants_grad(q, k, v, g, initial_state):
        S0 = initial_state if initial_state is not None else q.new_zeros(B, H, K, v.shape[-1])
        return ChunkDecay.apply(q, k, v, g, S0, ball, scale, C, L, routes)
    return _forward(q, k, v, ball, initial_state, scale, C, L, routes)


def chunk_decay_attention(q, k, v, g, *, scale, chunk_size=64, initial_state=None, route=None, op="simple_gla"):
    """The chunk form of the decayed family: the token loop for short calls without a gradient (or
    route="token"), else ``chunk_engine``. Inputs as ``parallel_decay_attention``'s."""
    T = q.shape[1]
    if route == "token" or (route is None and T < SHORT and not wants_grad(q, k, v, g, initial_state)):
        took(op, "token")
        return recurrent_decay_attention(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
    sd = g.dtype
    q, k, v = (x.to(sd) for x in (q, k, v))
    return chunk_engine(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state, route=route,
                        op=op)
