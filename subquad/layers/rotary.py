"""Rotary position embedding (Su et al. 2021): rotate pairs of dims by position-dependent angles.

    x'_{2i}   = x_{2i} cos(p w_i) - x_{2i+1} sin(p w_i),   w_i = base^(-2i/K)   (half-split layout)

Positions are absolute, so decoding continues from the state's position counter. Partial rotary
(GPT-NeoX, Bamba): only the first ``dim`` of the K dims rotate (half-split within them, w_i = base^(-2i/dim));
the rest pass through.
"""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, offset=0, base: float = 10000.0, dim: int | None = None) -> torch.Tensor:
    """x (B, T, H, K) at positions offset .. offset + T - 1, or at ``offset`` itself when it is a tensor of
    positions: (T,) for every row, or (B, T) per row (a batch of sequences at different points). ``dim``
    (even, <= K; default K): how many leading dims rotate."""
    B, T, H, K = x.shape
    dim = K if dim is None else dim
    if dim % 2 or not 0 < dim <= K:
        raise ValueError(f"rotary needs an even number of rotating dims in (0, {K}], got {dim}")
    if dim < K:
        return torch.cat([apply_rotary(x[..., :dim], offset, base), x[..., dim:]], dim=-1)
    half = K // 2
    inv = base ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    if isinstance(offset, torch.Tensor):
        if offset.shape not in ((T,), (B, T)):
            raise ValueError(f"positions must be a ({T},) or ({B}, {T}) tensor, got shape {tuple(offset.shape)}")
        pos = offset.to(device=x.device, dtype=torch.float64)
    else:
        pos = torch.arange(offset, offset + T, device=x.device, dtype=torch.float64)
    ang = pos.unsqueeze(-1) * inv                                            # (T, K/2) or (B, T, K/2)
    cos, sin = ang.cos().to(x.dtype).unsqueeze(-2), ang.sin().to(x.dtype).unsqueeze(-2)   # (.., T, 1, K/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
