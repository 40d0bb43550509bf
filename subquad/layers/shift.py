"""Token shift (RWKV): each token sees the one before it, x_{t-1}, through a state of one token.

    prev, tail = token_shift(x, tail)          x (B, T, D), tail (B, 1, D) or None (zeros) -> prev (B, T, D)

It is a causal convolution that reads one token back, so layers call it through the sequence backend,
``seq.causal_conv(token_shift, x, 1, tail)``: a packed row (``cu_seqlens``) shifts each sequence from its
own tail (zeros at its first token), and context parallelism hands each shard the token before it.
"""

from __future__ import annotations

import torch


def token_shift(x: torch.Tensor, tail: torch.Tensor | None = None):
    """x (B, T, D), tail (B, 1, D) - the token before x, None: zeros -> (x_{t-1} (B, T, D), new tail (B, 1, D))."""
    first = torch.zeros_like(x[:, :1]) if tail is None else tail.to(x.dtype)
    return torch.cat([first, x[:, :-1]], 1), x[:, -1:].clone()
