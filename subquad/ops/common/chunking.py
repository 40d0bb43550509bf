"""Helpers shared by the chunk forms: the decayed causal mask, group slices, pieces with a carried state."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from subquad.ops.common.expo import exp_decay, exp_decay_




def decay_mask(b, out=None):
    """D_ij = exp(b_i - b_j) for j <= i and 0 above, (..., C, C), from chunk-local cumulative log-decays
    b (..., C). The upper triangle is exponentiated as 0 and zeroed after (-inf there, or any argument
    that underflows, sends exp down its slow path: common.expo), so only differences <= 0 matter.
    ``out``: a buffer to build it in (no autograd)."""
    C = b.shape[-1]
    upper = torch.ones(C, C, dtype=torch.bool, device=b.device).triu(1)
    d = torch.sub(b.unsqueeze(-1), b.unsqueeze(-2), out=out)
    if out is not None:                                 # a buffer: in place
        return exp_decay_(d.masked_fill_(upper, 0.0)).masked_fill_(upper, 0.0)
    return exp_decay(d.masked_fill(upper, 0.0)).masked_fill(upper, 0.0)


def chunk_view(x, C, perm=(1, 0, 3, 2, 4)):
    """(B, L, *rest) with L a multiple of C as (B, L / C, C, *rest) permuted by ``perm``: a view. The
    default turns a (B, L, H, D) group chunk-major and head-major within the chunk, (n, B, H, C, D)."""
    return x.view(x.shape[0], x.shape[1] // C, C, *x.shape[2:]).permute(perm)


def put_chunks(o, s, e, g, perm=(1, 0, 3, 2, 4)):
    """Write g, a group in ``chunk_view(o[:, s:s + L], C, perm)``'s layout, into tokens [s, e) of o; a
    last, partial group's padded tail is dropped."""
    gt = g.permute(tuple(sorted(range(len(perm)), key=perm.__getitem__)))   # (B, n, C, *rest)
    B, n, C = gt.shape[:3]
    if e - s == n * C:
        chunk_view(o[:, s:e], C, perm).copy_(g)
    else:
        o[:, s:e].copy_(gt.reshape(B, n * C, *gt.shape[3:])[:, :e - s])


def token_slice(x, s, e, L):
    """Tokens [s, e) of x (B, T, ...) along dim 1, zero-padded to L tokens (a view when e - s == L)."""
    x = x[:, s:e]
    if e - s < L:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, L - (e - s)))
    return x


def in_pieces(fn, tensors, L, state):
    """fn(*pieces, state) -> (o, state) over consecutive pieces of L tokens (dim 1) of ``tensors`` (None
    entries passed through), the state carried; the outputs concatenated along dim 1. torch.split, not
    slicing: its backward is one concatenation (T/L slices would each allocate a full-length gradient)."""
    n = -(-next(t for t in tensors if t is not None).shape[1] // L)
    splits = [t.split(L, 1) if t is not None else [None] * n for t in tensors]
    outs = []
    for piece in zip(*splits):
        o, state = fn(*piece, state)
        outs.append(o)
    return torch.cat(outs, 1), state
