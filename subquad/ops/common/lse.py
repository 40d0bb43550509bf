"""Exact merging of attention computed over disjoint key blocks.

For a query, attention over keys split into blocks 1 and 2 is recovered from the
per-block results (o_i, lse_i), where lse_i = log sum_j exp(s_ij) over block i:

    lse = logaddexp(lse_1, lse_2)
    o   = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2

Blockwise online softmax (chunk form) and ring attention both build on this.
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import describe


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Merge two partial attention results.

    Args:
        o1, o2: (B, T, H, V) outputs normalised within their own key block.
        lse1, lse2: (B, T, H) log-sum-exp of the scaled scores of each block
            (-inf where a block held no visible key).
    Returns:
        (o, lse) over the union of the two key blocks.

    Elementwise, so any layout merges (ring attention's (B, H, T, V)): o2 must have o1's shape and dtype,
    lse1 and lse2 o1's shape less the last dim (any float dtype), all on o1's device.
    """
    for name, x in (("o1", o1), ("o2", o2), ("lse1", lse1), ("lse2", lse2)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {describe(x)}")
        if x.device != o1.device:
            raise ValueError(f"{name} must be on o1's device {o1.device}, got {x.device}")
    if o1.dim() < 1 or o2.shape != o1.shape:
        raise ValueError(f"o2 must have o1's shape {tuple(o1.shape)}, got {tuple(o2.shape)}")
    if o2.dtype != o1.dtype:
        raise ValueError(f"o2 must have o1's dtype {o1.dtype}, got {o2.dtype}")
    for name, x in (("lse1", lse1), ("lse2", lse2)):
        if x.shape != o1.shape[:-1]:
            raise ValueError(f"{name} must have o1's shape less its last dim, {tuple(o1.shape[:-1])}, got "
                             f"{tuple(x.shape)}")
    lse = torch.logaddexp(lse1, lse2)
    # A row that saw no key in either block keeps lse = -inf; weight it 0, not NaN.
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return w1 * o1 + w2 * o2, lse
