"""Softmax attention, chunk form: blockwise online softmax (FlashAttention's schedule, in PyTorch).

Queries and keys are cut into blocks of C. For each query block, over the key
blocks it can see (fully masked blocks are skipped, so causal costs half):

    1. s     = scale * Q_b K_j^T                     (C x C, masked where invisible)
    2. m'    = max(m, rowmax s);  p = exp(s - m')
    3. l     = l exp(m - m') + rowsum p
    4. acc   = acc exp(m - m') + p V_j;   m = m'
    5. o     = acc / l,   lse = m + log l           (after the last key block)

Nothing T x T is ever held: the forward keeps one C x C block at a time and the
backward recomputes p = exp(s - lse) block by block:

    D = rowsum(dO * O);  dS = p * (dO V^T - D + dlse)
    dQ += scale dS K,  dK += scale dS^T Q,  dV += p^T dO

``lse`` is returned so partial results over different key sets merge exactly
(``subquad.ops.merge_attention``), which ring attention builds on; it is
differentiable too.
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import state_dtype
from subquad.ops.common.precision import autocast_off
from subquad.ops.common.precision import amp_op
from subquad.ops.common.varlen import varlen
from subquad.ops.softmax.ragged import takes_ragged_caches
from subquad.ops.softmax.prepare import check_flags, finish, prepare, visible_mask


def _blocks(T_q, L, C, causal, window, q_start, k_start):
    """Yield (qs, qe, [(ks, ke, needs_mask), ...]) over the visible key blocks of each query block."""
    for qs in range(0, T_q, C):
        qe = min(qs + C, T_q)
        q_lo, q_hi = q_start + qs, q_start + qe - 1                     # absolute positions
        kb = []
        first = 0 if window is None else max(0, (q_lo - window - k_start) // C * C)   # O(T W): skip unseen blocks
        for ks in range(first, L, C):
            ke = min(ks + C, L)
            k_lo, k_hi = k_start + ks, k_start + ke - 1
            if causal and k_lo > q_hi:
                break
            if window is not None and q_lo - k_hi > window:
                continue
            needs = (causal and k_hi > q_lo) or (window is not None and q_hi - k_lo > window)
            kb.append((ks, ke, needs))
        yield qs, qe, kb


def attention_forward(q, k, v, scale, C, causal, window, q_start, k_start):
    """Blockwise online softmax on (B, H, T, K) x (B, H, L, K|V): returns o (B, H, T, V), lse (B, H, T),
    both in float32 for 16-bit inputs (float64 stays): every block is cast up before its matmuls, so the
    running max, sum and accumulator never round to 16 bits.

    A query row that sees no key gets o = 0 and lse = -inf (merges as an empty block).
    """
    B, H, T, _ = q.shape
    L = k.shape[2]
    sd = state_dtype(q.dtype)
    o = torch.zeros(B, H, T, v.shape[-1], dtype=sd, device=q.device)
    lse = torch.full((B, H, T), float("-inf"), dtype=sd, device=q.device)
    for qs, qe, kb in _blocks(T, L, C, causal, window, q_start, k_start):
        if not kb:
            continue
        qb = q[:, :, qs:qe].to(sd)
        m = torch.full((B, H, qe - qs), float("-inf"), dtype=sd, device=q.device)
        l = torch.zeros(B, H, qe - qs, dtype=sd, device=q.device)
        acc = torch.zeros(B, H, qe - qs, v.shape[-1], dtype=sd, device=q.device)
        for ks, ke, needs in kb:
            s = (qb @ k[:, :, ks:ke].to(sd).transpose(-1, -2)).mul_(scale)
            if needs:
                vis = visible_mask(qe - qs, ke - ks, causal=causal, window=window,
                                   q_start=q_start + qs, k_start=k_start + ks, device=q.device)
                s.masked_fill_(~vis, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + p @ v[:, :, ks:ke].to(sd)
            m = m_new
        o[:, :, qs:qe] = acc / l.clamp_min(torch.finfo(l.dtype).tiny).unsqueeze(-1)
        lse[:, :, qs:qe] = m + torch.log(l)
    return o, lse


def attention_backward(q, k, v, do, lse, D, scale, C, causal, window, q_start, k_start):
    """Gradients of one (query block, key block) pair given the *final* lse and D = rowsum(dO * O) - dlse.

    Returns (dq, dk, dv) in float32 for 16-bit inputs. With the merged lse of several key blocks, the pieces add up to the
    gradient of the merged attention (ring attention's backward).
    """
    T, L = q.shape[2], k.shape[2]
    sd = state_dtype(q.dtype)                                # gradients accumulate in float32 too
    dq, dk, dv = (torch.zeros(x.shape, dtype=sd, device=x.device) for x in (q, k, v))
    for qs, qe, kb in _blocks(T, L, C, causal, window, q_start, k_start):
        qb, dob = q[:, :, qs:qe].to(sd), do[:, :, qs:qe].to(sd)
        for ks, ke, needs in kb:
            kk, vv = k[:, :, ks:ke].to(sd), v[:, :, ks:ke].to(sd)
            s = (qb @ kk.transpose(-1, -2)).mul_(scale)
            p = torch.exp(s - lse[:, :, qs:qe].unsqueeze(-1))
            if needs:
                vis = visible_mask(qe - qs, ke - ks, causal=causal, window=window,
                                   q_start=q_start + qs, k_start=k_start + ks, device=q.device)
                p = p.masked_fill(~vis, 0.0)
            dS = p * (dob @ vv.transpose(-1, -2) - D[:, :, qs:qe].unsqueeze(-1))
            dq[:, :, qs:qe] += (dS @ kk) * scale
            dk[:, :, ks:ke] += (dS.transpose(-1, -2) @ qb) * scale
            dv[:, :, ks:ke] += p.transpose(-1, -2) @ dob
    return dq, dk, dv


class _BlockwiseSoftmax(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, scale, C, causal, window, q_start, k_start):
        o, lse = attention_forward(q, k, v, scale, C, causal, window, q_start, k_start)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (scale, C, causal, window, q_start, k_start)
        return o, lse

    @staticmethod
    @autocast_off
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do
        D = (do * o).sum(-1)                                                  # (B, H, T)
        if dlse is not None:
            D = D - torch.nan_to_num(dlse, nan=0.0, posinf=0.0, neginf=0.0)
        dq, dk, dv = attention_backward(q, k, v, do, lse, D, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def blockwise_softmax_attention(q, k, v, *, scale, chunk_size, causal, window, q_start, k_start):
    """(B, T, H, K) x (B, L, H, K|V) -> o (B, T, H, V) in q's dtype, lse (B, T, H) in float32 (float64
    for float64). Positions are absolute."""
    o, lse = _BlockwiseSoftmax.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     scale, chunk_size, causal, window, q_start, k_start)
    return o.transpose(1, 2).to(q.dtype), lse.transpose(1, 2)


@amp_op()
@varlen("q", "k", "v", states="caches")
@takes_ragged_caches
def chunk_softmax_attention(q, k, v, *, causal=True, window=None, chunk_size=64, scale=None,
                            initial_state=None, output_final_state=False, return_lse=False):
    """Blockwise online-softmax attention; same signature as ``softmax_attention``."""

    check_flags(causal, output_final_state, return_lse)
    scale, cache, kk, vv, q_start = prepare(q, k, v, causal, window, scale, chunk_size, initial_state)
    o, lse = blockwise_softmax_attention(q, kk, vv, scale=scale, chunk_size=chunk_size, causal=causal,
                                         window=window, q_start=q_start,
                                         k_start=q_start - len(cache) if cache is not None else 0)
    return finish(o, lse, cache, k, v, window, output_final_state, return_lse)
