"""Exact merging of attention computed over disjoint key blocks.

For a query, attention over keys split into blocks 1 and 2 is recovered from the
per-block results (o_i, lse_i), where lse_i = log sum_j exp(s_ij) over block i:

    lse = logaddexp(lse_1, lse_2)
    o   = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2

Blockwise online softmax (chunk form) and ring attention both build on this.
"""

from __future__ import annotations

import torch


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Merge two partial attention results.

    Args:
        o1, o2: (B, T, H, V) outputs normalised within their own key block.
        lse1, lse2: (B, T, H) log-sum-exp of the scaled scores of each block
            (-inf where a block held no visible key).
    Returns:
        (o, lse) over the union of the two key blocks.
    """
    lse = torch.logaddexp(lse1, lse2)
    # A row that saw no key in either block keeps lse = -inf; weight it 0, not NaN.
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return w1 * o1 + w2 * o2, lse
