"""Helpers shared by the chunk forms: the decayed causal mask, group slices, pieces with a carried state."""

from __future__ import annotations

import torch
import torch.nn.functional as F


SHORT = 4  # fewer tokens than this (a decoding step): the token loop beats batching chunks (2.6-3.2x at T = 1)


def decay_mask(b, out=None):
    """D_ij = exp(b_i - b_j) for j <= i and 0 above, (..., C, C), from chunk-local cumulative log-decays
    b (..., C). The upper triangle is -inf before exp, so only differences <= 0 are exponentiated.
    ``out``: a buffer to build it in (no autograd)."""
    C = b.shape[-1]
    upper = torch.ones(C, C, dtype=torch.bool, device=b.device).triu(1)
    d = torch.sub(b.unsqueeze(-1), b.unsqueeze(-2), out=out)
    return d.masked_fill_(upper, float("-inf")).exp_()


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
