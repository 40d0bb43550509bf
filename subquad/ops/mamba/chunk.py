"""The selective scan, chunk form: "lanes" (``ops/common/lanes.py``, shared with the RG-LRU's chunk form).
Without the D skip and the z gate, which the op applies.

The sequence is cut into n = ceil(T / C) lanes of C tokens, and the work runs over the C positions
of a lane with every lane at once:
    1. local scan: each lane from a zero state, positions 0..C-1, all lanes in one tensor op
       per position; keeps only each lane's final local state and its total decay
    2. state passing: lane i starts from h_i = exp(Lam_lane_{i-1}) h_{i-1} + local_{i-1} (n steps of (B, Dm, N))
    3. output: the C positions again, now from the true starting states, contracting with C_t
       as it goes, so no (T, Dm, N) tensor is ever formed (the largest is (B, n, Dm, N))
A Mamba-1 decay differs per channel *and* state dim, so the intra-chunk products
are not matmuls (unlike SSD); the scan is elementwise work O(T Dm N) either way,
and this keeps it in 2C + n vectorised steps instead of T.
Every factor is exp of a log-decay <= 0: nothing overflows at dt * A = -50.
"""

from __future__ import annotations

import torch

from subquad.ops.common.chunking import token_slice
from subquad.ops.common.lanes import lane_length, pass_states
from subquad.ops.common.precision import autocast_off
from subquad.ops.common.expo import exp_decay, exp_decay_


def _lanes(c, *ts):
    """Each (B, T, D) tensor padded to T = n * c with zeros (dt = 0 there: no decay, no write) and viewed as
    (B, n lanes, c positions, D); a view, not a copy, when c divides T."""
    B, T, _ = ts[0].shape
    n = -(-T // c)
    return [token_slice(t, 0, T, n * c).view(B, n, c, t.shape[-1]) for t in ts]


def _decay(dtl, A, j, out=None):
    """exp(dt_j A) for position j of every lane: (B, n, Dm, N), into ``out`` when given."""
    return exp_decay_(torch.mul(dtl[:, :, j, :, None], A, out=out))


def _lane_starts(dtl, dtx, Bl, A, h0):
    """Each lane's true starting state (B, n, Dm, N), the final state, and each lane's total decay."""
    B, _, c, Dm = dtl.shape
    h = dtx[:, :, 0, :, None] * Bl[:, :, 0, None, :]                          # 1. every lane from zero
    a = torch.empty_like(h)
    for j in range(1, c):
        h.mul_(_decay(dtl, A, j, a)).addcmul_(dtx[:, :, j, :, None], Bl[:, :, j, None, :])
    total = exp_decay(dtl.sum(2)[..., None] * A)                              # exp(sum_j dt_j A) per lane
    s = h.new_zeros(B, Dm, A.shape[1]) if h0 is None else h0
    starts, s = pass_states(h, total, s)                                      # 2. state passing between lanes
    return starts, s, total


class _LanesScan(torch.autograd.Function):
    """The lanes scan with a hand-written backward that keeps only the lanes' starting states.

    Backward, with dh_t the adjoint of h_t and w_t = dh_t * (h_t - u_t) (= dh_t * a_t h_{t-1}):
        dh_t = dy_t C_t + a_{t+1} dh_{t+1};  dC_t = dy_t . h_t;  d(dt x)_t = dh_t . B_t;  dB_t = (dt x)_t . dh_t
        d(dt_t) += w_t . A;  dA += sum_t w_t dt_t;  dh_0 = a_1 dh_1
    run the same three steps backwards: a local reverse scan of each lane from a zero adjoint, the
    adjoints passed between lanes right to left, then the positions again from the true adjoints, with
    h_t recomputed from the saved starts (never saved by the forward) segment by segment, so backward
    holds about 3 sqrt(C) tensors of (B, lanes, Dm, N), never the (B, T, Dm, N) of all states. Loops update in place: fresh
    (B, n, Dm, N) tensors per position cost more in page faults than the arithmetic.
    Every pass recomputes its decays exp(dt_t A) rather than keeping all of them, (B, T, Dm, N): first
    touching that much fresh memory costs what the exps do.
    """

    @staticmethod
    @autocast_off
    def forward(ctx, x, dt, A, B, C, h0, c):
        T = x.shape[1]
        xl, dtl, Bl, Cl = _lanes(c, x, dt, B, C)
        dtx = dtl * xl
        starts, final, _ = _lane_starts(dtl, dtx, Bl, A, h0)
        h, a, ys = starts.clone(), torch.empty_like(starts), []
        for j in range(c):                                                    # 3. outputs from the true starts
            h.mul_(_decay(dtl, A, j, a)).addcmul_(dtx[:, :, j, :, None], Bl[:, :, j, None, :])
            ys.append(torch.einsum("bldn,bln->bld", h, Cl[:, :, j]))
        ctx.save_for_backward(x, dt, A, B, C, starts)
        ctx.c, ctx.has_h0 = c, h0 is not None
        return torch.stack(ys, 2).flatten(1, 2)[:, :T], final

    @staticmethod
    @autocast_off
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, starts = ctx.saved_tensors
        c = ctx.c
        T = x.shape[1]
        xl, dtl, Bl, Cl, dyl = _lanes(c, x, dt, B, C, dy if dy is not None else torch.zeros_like(x))
        dtx = dtl * xl                                                        # (B, n, c, Dm)
        a = torch.empty_like(starts)
        # 1. local reverse scan of every lane from a zero adjoint, carried one step past position 0
        g = dyl[:, :, c - 1, :, None] * Cl[:, :, c - 1, None, :]
        for j in range(c - 2, -1, -1):
            g.mul_(_decay(dtl, A, j + 1, a)).addcmul_(dyl[:, :, j, :, None], Cl[:, :, j, None, :])
        g.mul_(_decay(dtl, A, 0, a))
        total = exp_decay(dtl.sum(2)[..., None] * A)
        # 2. adjoints passed between lanes, right to left: carry[:, i] flows into lane i's last position
        s = torch.zeros_like(starts[:, 0]) if dfinal is None else dfinal
        carry, dh0 = pass_states(g, total, s, reverse=True)
        del g
        # 3. the positions again, backwards, with h_t recomputed from the starts: a checkpoint before every
        #    segment of ~sqrt(c) positions, then each segment's states (and decays) into reused buffers
        seg = max(1, round(c ** 0.5))
        bounds = list(range(0, c, seg))
        ckpt = starts.new_empty(len(bounds), *starts.shape)
        h = starts.clone()
        for j in range(c):
            if j % seg == 0:
                ckpt[j // seg].copy_(h)
            h.mul_(_decay(dtl, A, j, a)).addcmul_(dtx[:, :, j, :, None], Bl[:, :, j, None, :])
        del h
        hs, decays = starts.new_empty(seg, *starts.shape), starts.new_empty(seg, *starts.shape)
        dC, ddtx, dB, ddt = (torch.empty_like(t) for t in (Cl, dtx, Bl, dtl))
        dA = torch.zeros_like(starts)
        dh = carry
        for k in reversed(range(len(bounds))):
            j0, j1 = bounds[k], min(bounds[k] + seg, c)
            h = ckpt[k]
            for j in range(j0, j1):
                ak = _decay(dtl, A, j, decays[j - j0])
                h = torch.mul(ak, h, out=hs[j - j0]).addcmul_(dtx[:, :, j, :, None], Bl[:, :, j, None, :])
            for j in range(j1 - 1, j0 - 1, -1):
                dh.addcmul_(dyl[:, :, j, :, None], Cl[:, :, j, None, :])
                w = hs[j - j0]                                                # h_t ...
                dC[:, :, j] = torch.einsum("bld,bldn->bln", dyl[:, :, j], w)
                ddtx[:, :, j] = torch.einsum("bldn,bln->bld", dh, Bl[:, :, j])
                dB[:, :, j] = (dtx[:, :, j, None, :] @ dh).squeeze(2)
                w.addcmul_(dtx[:, :, j, :, None], Bl[:, :, j, None, :], value=-1).mul_(dh)   # ... becomes w_t
                dA.addcmul_(w, dtl[:, :, j, :, None])
                ddt[:, :, j] = w.mul_(A).sum(-1)
                dh.mul_(decays[j - j0])
        ddt = ddt + ddtx * xl
        dx = ddtx * dtl

        def unlane(t):
            return t.flatten(1, 2)[:, :T]

        return (unlane(dx), unlane(ddt), dA.sum((0, 1)), unlane(dB), unlane(dC), dh0 if ctx.has_h0 else None, None)


def chunk_scan(x, dt, A, B, C, *, chunk_size=64, initial_state=None):
    """Lanes of at most ``chunk_size`` positions; a short sequence uses about sqrt(T) (at least 16), since the
    work walks 2C + T/C vectorised steps (forward) and that is smallest near C = sqrt(T)."""
    return _LanesScan.apply(x, dt, A, B, C, initial_state, lane_length(x.shape[1], chunk_size))
