"""Sequence parallelism for the recurrent mixers by state passing.

Rank r holds the r-th contiguous piece of the sequence. Every mixer here has a
state that is an *affine* function of the state it starts from:

    S_out = M_r S_in + S_r          M_r (B, H, K, K): the piece's transition; S_r: its state from zero

(M_r is the identity for linear attention, a diagonal of decays for retention /
GLA, prod a (I - b k k^T) for the delta rule.) Each rank computes S_r and M_r with
the op itself - S_r from a zero state, M_r as the final state from the identity
with zero values - all-gathers them (a message of H K (K + V) numbers, whatever
the length), folds the pieces before it into its true initial state, and runs
its piece from there. The all-gather is differentiable, so backward works as is.
Communication per rank is O(H K V) against ring attention's O(T d).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from subquad import ops
from subquad.ops.common.checks import state_dtype
from subquad.ops.common.precision import autocast_off

KINDS = ("linear_attention", "retention", "simple_gla", "gla", "delta_rule", "gated_delta_rule")


class _AllGather(torch.autograd.Function):
    """all_gather with a backward that works on gloo too: all-reduce the gradients, keep this rank's."""

    @staticmethod
    @autocast_off
    def forward(ctx, x, group):
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather(x, group=None):
    """Differentiable all-gather: (W, *x.shape)."""
    return _AllGather.apply(x, group)


def _runner(kind, q, k, g, beta, scale, chunk_size, allow_neg_eigval=False):
    """f(values, initial_state) -> (o, final_state) for this rank's piece."""
    kw = dict(mode="chunk", chunk_size=chunk_size, scale=scale, output_final_state=True)
    if allow_neg_eigval and kind not in ("delta_rule", "gated_delta_rule"):
        raise ValueError(f"allow_neg_eigval applies to the delta rules only, not kind={kind!r}")
    if kind == "linear_attention":
        return lambda v, s: ops.linear_attention(q, k, v, normalize=False, initial_state=s, **kw)
    if kind in ("retention", "simple_gla", "gla"):
        fn = getattr(ops, kind)
        return lambda v, s: fn(q, k, v, g, initial_state=s, **kw)
    if kind == "delta_rule":
        return lambda v, s: ops.delta_rule(q, k, v, beta, initial_state=s, allow_neg_eigval=allow_neg_eigval, **kw)
    if kind == "gated_delta_rule":
        return lambda v, s: ops.gated_delta_rule(q, k, v, g, beta, initial_state=s, allow_neg_eigval=allow_neg_eigval,
                                                 **kw)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def fold_states(S, M=None, *, combine: str = "matmul", group=None):
    """The true initial state of each of this rank's pieces, from every piece's own (S, M).

    S (n, B, ...) are this rank's pieces' final states from a zero state, M (n, B, ...) their transitions
    (None: the identity). n = 1: rank r holds piece r of P (contiguous); n = 2: rank r holds pieces r and
    2P-1-r of 2P (the zigzag layout of ring attention). ``combine``: "matmul" (M @ S, K x K transitions) or
    "mul" (elementwise decays). Returns (n, B, ...): for each piece, the fold of every piece before it.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = S.shape[0]
    if n not in (1, 2):
        raise ValueError(f"each rank holds 1 (contiguous) or 2 (zigzag) pieces, got {n}")
    S_all = all_gather(S, group)                                             # (W, n, B, ...)
    M_all = all_gather(M, group) if M is not None else None
    order = [(r, 0) for r in range(world)] + ([(r, 1) for r in reversed(range(world))] if n == 2 else [])
    prefix = [torch.zeros_like(S[0])]
    for r, s in order[:-1]:                                                  # pieces in sequence order
        prev = prefix[-1]
        if M_all is not None:
            prev = M_all[r, s] @ prev if combine == "matmul" else M_all[r, s] * prev
        prefix.append(prev + S_all[r, s])
    out = torch.stack([prefix[order.index((rank, s))] for s in range(n)])
    # Every rank must take part in the gathers' backward (a collective), even one that uses none of the
    # gathered states (rank 0 of a contiguous layout): tie them to the result with weight zero.
    return out + 0.0 * (S_all.sum() + (M_all.sum() if M_all is not None else 0.0))


def state_passing(kind: str, q, k, v, *, g=None, beta=None, normalize: bool = False, scale=None,
                  chunk_size: int = 64, group=None, pieces: int = 1, allow_neg_eigval: bool = False):
    """``kind`` over this rank's ``pieces`` pieces of the sequence, stacked along the batch (piece-major).

    q, k (n B, t, H, K), v (n B, t, H, V), g / beta likewise (retention's g (H,) as is). See ``fold_states``
    for which pieces a rank holds. ``allow_neg_eigval``: the delta rules' beta in [0, 2]. Returns o (n B, t, H, V).
    """
    if not dist.is_initialized():
        raise ValueError("sequence parallelism needs torch.distributed initialised (torchrun, or init_process_group)")
    nB, t, H, K = q.shape
    if nB % pieces:
        raise ValueError(f"the batch ({nB}) must stack {pieces} pieces")
    V = v.shape[-1]
    if normalize:
        if kind != "linear_attention":
            raise ValueError("normalize=True applies to kind='linear_attention' only")
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    f = _runner(kind, q, k, g, beta, scale, chunk_size, allow_neg_eigval)
    sd = state_dtype(q.dtype)
    _, S_local = f(v, None)                                                  # (nB, H, K, V')
    if kind == "linear_attention":
        M = None                                                             # identity
    else:
        eye = torch.eye(K, dtype=sd, device=q.device).expand(nB, H, K, K).contiguous()
        _, M = f(torch.zeros(nB, t, H, K, dtype=v.dtype, device=v.device), eye)
        M = M.reshape(pieces, nB // pieces, *M.shape[1:])
    S_in = fold_states(S_local.reshape(pieces, nB // pieces, *S_local.shape[1:]), M, group=group)
    o, _ = f(v, S_in.reshape(S_local.shape))
    if normalize:
        o = o[..., :V] / (o[..., V:] + 1e-6)
    return o


def sequence_parallel(kind: str, q, k, v, *, g=None, beta=None, normalize: bool = False, scale=None,
                      chunk_size: int = 64, group=None, cu_seqlens=None, allow_neg_eigval: bool = False):
    """This rank's outputs (B, t, H, V) of ``kind`` over the sequence split contiguously across ``group``.

    q, k (B, t, H, K), v (B, t, H, V), and per-token gates (g, beta: (B, t, H[, K])) are this rank's piece;
    retention's g (H,) is the same on every rank. ``normalize`` (linear attention only) carries the
    normaliser as an extra value column. ``cu_seqlens`` is refused (a rank's piece is part of one sequence).
    """
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens is not supported across processes: each rank's shard is one piece of one sequence. "
                         "Shard whole documents instead (data parallelism), or run packed batches on one process")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return state_passing(kind, q, k, v, g=g, beta=beta, normalize=normalize, scale=scale, chunk_size=chunk_size,
                         group=group, pieces=1, allow_neg_eigval=allow_neg_eigval)
