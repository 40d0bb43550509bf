"""Ring attention (Liu et al. 2023, arXiv:2310.01889): exact softmax attention with the sequence split over P ranks.

Layout (causal load balance, "zigzag"): the sequence is cut into 2P chunks of c
tokens and rank r holds chunks r and 2P-1-r, so every rank has the same amount
of causal work. In P rounds the key/value shards travel around the ring
(``batch_isend_irecv`` to the next rank, from the previous), the transfer of the
next shard overlapping the computation on the current one. Each (query chunk,
key chunk) pair is blockwise online softmax with absolute positions - a key chunk
wholly in the future is skipped - and the partial results merge exactly through
their log-sum-exp (``subquad.ops.merge_attention``).

Backward (a custom autograd Function): the same P rounds, with each shard's dK
and dV accumulating as they travel with it, and one last hop home.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from subquad.ops.common.lse import merge_attention
from subquad.ops.softmax.chunk import attention_backward, attention_forward
from subquad.ops.common.checks import state_dtype
from subquad.ops.common.precision import amp_op, autocast_off


def _check_layout(T: int, world: int):
    if T % (2 * world):
        raise ValueError(f"sequence length {T} must divide into 2P = {2 * world} equal chunks for the zigzag "
                         f"layout of ring attention over {world} ranks")


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """This rank's shard: chunks ``rank`` and ``2*world - 1 - rank`` of the 2*world chunks along ``dim``."""
    _check_layout(x.shape[dim], world)
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards: list, dim: int = 1) -> torch.Tensor:
    """Inverse of ``zigzag_shard``: the full sequence from every rank's shard, in rank order."""
    world = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    order = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(order, dim=dim)


def _exchange(tensors, group, rank, world):
    """Send ``tensors`` to the next rank and receive the previous rank's into new buffers (async)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, nxt) if group is not None else nxt, group)
           for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, dist.get_global_rank(group, prv) if group is not None else prv, group)
            for b in bufs]
    return dist.batch_isend_irecv(ops), bufs


def _pairs(rank, src, world, c):
    """(query slice, key slice, query start, key start) for this rank's 2 query chunks x src's 2 key chunks."""
    mine = [rank, 2 * world - 1 - rank]
    theirs = [src, 2 * world - 1 - src]
    for a, i in enumerate(mine):
        for b, j in enumerate(theirs):
            yield slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), i * c, j * c


def _skip(causal, window, q0, k0, c):
    """A key chunk wholly in the future, or wholly beyond the window (query i sees key j iff i - j <= window)."""
    return (causal and k0 > q0) or (window is not None and q0 - (k0 + c - 1) > window)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, scale, causal, window, group, block):
        # q, k, v: (B, H, 2c, D) local zigzag shards
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        c = q.shape[2] // 2
        sd = state_dtype(q.dtype)                  # output and lse accumulate in float32 for 16-bit shards
        o = [torch.zeros(*q.shape[:2], c, v.shape[-1], dtype=sd, device=q.device) for _ in range(2)]
        lse = [torch.full((*q.shape[:2], c), float("-inf"), dtype=sd, device=q.device) for _ in range(2)]
        kv = [k.contiguous(), v.contiguous()]
        for step in range(world):
            reqs = None
            if step < world - 1:
                reqs, nxt = _exchange(kv, group, rank, world)
            src = (rank - step) % world
            for qs, ks, q0, k0 in _pairs(rank, src, world, c):
                if _skip(causal, window, q0, k0, c):
                    continue
                ob, lb = attention_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], scale, block, causal,
                                           window, q0, k0)
                a = 0 if qs.start == 0 else 1
                o[a], lse[a] = merge_attention(o[a], lse[a], ob, lb)         # elementwise: any layout
            if reqs is not None:
                for r in reqs:
                    r.wait()
                kv = nxt
        o, lse = torch.cat(o, 2), torch.cat(lse, 2)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (scale, causal, window, group, block)
        return o

    @staticmethod
    @autocast_off
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        scale, causal, window, group, block = ctx.args
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        c = q.shape[2] // 2
        do = do.contiguous()
        D = (do * o).sum(-1)
        sd = o.dtype                                 # gradients accumulate (and travel) in float32 too
        dq = torch.zeros(q.shape, dtype=sd, device=q.device)
        cur = [k.contiguous(), v.contiguous(), torch.zeros(k.shape, dtype=sd, device=k.device),
               torch.zeros(v.shape, dtype=sd, device=v.device)]
        for step in range(world):
            src = (rank - step) % world
            kk, vv, dk, dv = cur
            for qs, ks, q0, k0 in _pairs(rank, src, world, c):
                if _skip(causal, window, q0, k0, c):
                    continue
                gq, gk, gv = attention_backward(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], do[:, :, qs],
                                                lse[:, :, qs], D[:, :, qs], scale, block, causal, window, q0, k0)
                dq[:, :, qs] += gq
                dk[:, :, ks] += gk
                dv[:, :, ks] += gv
            # pass the shard on with its gradients; after the last round only dK, dV travel (home)
            send = [kk, vv, dk, dv] if step < world - 1 else [dk, dv]
            reqs, got = _exchange(send, group, rank, world)
            for r in reqs:
                r.wait()
            cur = got if step < world - 1 else cur
            if step == world - 1:
                dk_home, dv_home = got
        return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype), None, None, None, None, None


@amp_op()
def ring_attention(q, k, v, *, causal: bool = True, window: int | None = None, scale: float | None = None, group=None,
                   block_size: int = 256, cu_seqlens=None):
    """Exact softmax attention over a sequence sharded across the ranks of ``group`` (zigzag layout).

    Args:
        q, k: (B, 2c, H, K) and v (B, 2c, H, V): this rank's ``zigzag_shard`` of the sequence.
        causal: causal mask over the *global* positions.
        window: sliding window (query t sees keys t - window .. t); key chunks wholly outside it are skipped.
        block_size: block of the online softmax inside each chunk pair.
        cu_seqlens: refused (a shard is one piece of one sequence); present so the refusal is clear.
    Returns:
        o (B, 2c, H, V): this rank's shard of the output (``zigzag_unshard`` of all shards is the whole).
    """
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens is not supported across processes: each rank's shard is one piece of one sequence. "
                         "Shard whole documents instead (data parallelism), or run packed batches on one process")
    if not dist.is_initialized():
        raise ValueError("ring_attention needs torch.distributed initialised (torchrun, or init_process_group)")
    world = dist.get_world_size(group)
    if q.shape[1] % 2:
        raise ValueError(f"each rank's shard holds 2 chunks, so its length must be even; got {q.shape[1]}")
    _check_layout(q.shape[1] * world, world)
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k, v shards must agree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 or None, got {window}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = _RingAttention.apply(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                             v.transpose(1, 2).contiguous(), scale, causal, window, group, block_size)
    return o.transpose(1, 2).to(q.dtype)
