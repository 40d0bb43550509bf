"""Intra-chunk decayed causal scores, A_ij = q_i . (exp(b_i - b_j) * k_j) for j <= i, in exact form
(every exponent a difference <= 0). Shared by the chunk form and its no-gradient fast path."""

from __future__ import annotations

import torch

from subquad.ops.common.chunking import decay_mask
from subquad.ops.common.expo import exp_decay

SUB = 16  # sub-chunk of the per-key-dim decay


def _intra_scalar(qc, kc, b):
    """(BH, c, c) decayed causal scores for a scalar decay b (BH, c)."""
    return (qc @ kc.transpose(1, 2)) * decay_mask(b)


def _intra_vector(qc, kc, b):
    """(BH, C, C) decayed causal scores for a per-key-dim decay b (BH, C, K); C a multiple of SUB."""
    BH, C, K = qc.shape
    n = C // SUB
    bq = b.view(BH, n, SUB, K)
    r = bq[:, :, -1]                                                         # (BH, n, K) reference per sub-chunk
    k_t = kc.view(BH, n, SUB, K) * exp_decay(r.unsqueeze(2) - bq)           # (BH, n, SUB, K), exponent <= 0
    sub_of_row = torch.arange(C, device=b.device) // SUB                     # (C,)
    later = sub_of_row.view(1, C) > torch.arange(n, device=b.device).view(n, 1)   # (n, C): row after sub-chunk J
    E = (b.unsqueeze(1) - r.unsqueeze(2)).masked_fill(~later[None, :, :, None], float("-inf"))
    q_t = qc.unsqueeze(1) * exp_decay(E)                                     # (BH, n, C, K), exponent <= 0
    A = (q_t @ k_t.transpose(-1, -2))                                        # (BH, n, C, SUB): columns of J
    A = A.permute(0, 2, 1, 3).reshape(BH, C, C)
    tri = torch.ones(SUB, SUB, dtype=torch.bool, device=b.device).tril()
    Ed = (bq.unsqueeze(3) - bq.unsqueeze(2)).masked_fill(~tri[None, None, :, :, None], float("-inf"))
    Ad = torch.einsum("bnik,bnjk,bnijk->bnij", qc.view(BH, n, SUB, K), kc.view(BH, n, SUB, K), exp_decay(Ed))
    A.view(BH, n, SUB, n, SUB).diagonal(dim1=1, dim2=3).add_(Ad.permute(0, 2, 3, 1))
    return A


