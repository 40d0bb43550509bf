"""Intra-chunk decayed causal scores, A_ij = q_i . (exp(b_i - b_j) * k_j) for j <= i, in exact form
(every exponent a difference <= 0). Shared by the chunk form and its no-gradient fast path.

For a per-key-dim decay the 16 x 16 diagonal blocks are the costly part: formed elementwise they take
16 K exps and products per row. When no channel decays by more than ``SPAN`` inside any sub-chunk (checked
on the data, one host sync), they are a matmul instead: exp(b_i - b_j) = exp(b_i - m) exp(m - b_j) with
m the midpoint of the sub-chunk's cumulative decays, both factors within exp(+-SPAN / 2) - no overflow, no
subnormal - and the same products up to rounding. Stronger decays keep the elementwise form.
"""

from __future__ import annotations

import torch

from subquad.ops.common.expo import exp_decay
from subquad.ops.common.routes import SPAN

SUB = 16  # sub-chunk of the per-key-dim decay


def _intra_vector(qc, kc, b):
    """(BH, C, C) decayed causal scores for a per-key-dim decay b (BH, C, K); C a multiple of SUB."""
    return _intra_vector_rows(qc.unsqueeze(1), kc, b)[:, 0]


def _intra_vector_rows(rows, kc, b, sub=SUB):
    """(BH, R, C, C) decayed causal scores of R row sets rows (BH, R, C, K) - e.g. the queries and the keys
    of the delta rule - against the keys kc (BH, C, K): the decay factors, the costly part (elementwise,
    (C / sub + sub) K per row), are built once for all R."""
    BH, R, C, K = rows.shape
    SUB = sub
    n = C // SUB
    bq = b.view(BH, n, SUB, K)
    r = bq[:, :, -1]                                                         # (BH, n, K) reference per sub-chunk
    k_t = kc.view(BH, n, SUB, K) * exp_decay(r.unsqueeze(2) - bq)           # (BH, n, SUB, K), exponent <= 0
    sub_of_row = torch.arange(C, device=b.device) // SUB                     # (C,)
    later = sub_of_row.view(1, C) > torch.arange(n, device=b.device).view(n, 1)   # (n, C): row after sub-chunk J
    # rows not after sub-chunk J get exact zeros, not exp_decay's floor (~1e-38): products of the floor
    # are subnormal, the CPU's slow path (7x slower for the whole call)
    hide = ~later[None, :, :, None]
    E = exp_decay((b.unsqueeze(1) - r.unsqueeze(2)).masked_fill(hide, 0.0)).masked_fill(hide, 0.0)
    q_t = rows.unsqueeze(2) * E.unsqueeze(1)                                # (BH, R, n, C, K), exponent <= 0
    A = (q_t @ k_t.unsqueeze(1).transpose(-1, -2))                           # (BH, R, n, C, SUB): columns of J
    A = A.permute(0, 1, 3, 2, 4).reshape(BH, R, C, C)
    tri = torch.ones(SUB, SUB, dtype=torch.bool, device=b.device).tril()
    span = SPAN.get(b.dtype, 0.0) if b.device.type != "meta" and b.numel() else 0.0   # meta / empty: no values
    if _factored_diagonal(bq, span):                                        # factored: two matmul operands
        m = (bq[:, :, :1] + bq[:, :, -1:]) / 2                              # (BH, n, 1, K)
        rq = rows.view(BH, R, n, SUB, K) * torch.exp(bq - m).unsqueeze(1)
        ck = kc.view(BH, n, SUB, K) * torch.exp(m - bq)
        Ad = (rq @ ck.unsqueeze(1).transpose(-1, -2)) * tri
    else:
        upper = ~tri[None, None, :, :, None]
        Ed = exp_decay((bq.unsqueeze(3) - bq.unsqueeze(2)).masked_fill(upper, 0.0)).masked_fill(upper, 0.0)
        Ad = torch.einsum("brnik,bnjk,bnijk->brnij", rows.view(BH, R, n, SUB, K), kc.view(BH, n, SUB, K), Ed)
    A.view(BH, R, n, SUB, n, SUB).diagonal(dim1=2, dim2=4).add_(Ad.permute(0, 1, 3, 4, 2))
    return A




def _factored_diagonal(bq, span):
    """Whether the diagonal blocks may be a matmul: no channel decays by more than ``span`` inside any
    sub-chunk (one host sync; never on the meta device or an empty batch, which have no values)."""
    return bool(span) and float((bq[:, :, 0] - bq[:, :, -1]).detach().max()) <= span


def _intra_vector_grad(qc, kc, b, dA):
    """(dq, dk) of <dA, _intra_vector(qc, kc, b)> for dA (BH, C, C), zero above the diagonal: the same
    blocks with the same factors in reverse. Off the diagonal, block (I, J) was (q e^(b - r_J)) (k e^(r_J - b))^T,
    so dq gets (dA_IJ k~_J) e^(b - r_J) and dk_J gets (dA_IJ^T q~) e^(r_J - b); the diagonal blocks as the
    forward formed them (a matmul of midpoint factors, or elementwise)."""
    BH, C, K = qc.shape
    n = C // SUB
    bq = b.view(BH, n, SUB, K)
    r = bq[:, :, -1]                                                         # (BH, n, K)
    fk = exp_decay(r.unsqueeze(2) - bq)                                      # (BH, n, SUB, K), exponent <= 0
    sub_of_row = torch.arange(C, device=b.device) // SUB
    later = sub_of_row.view(1, C) > torch.arange(n, device=b.device).view(n, 1)
    hide = ~later[None, :, :, None]
    fq = exp_decay((b.unsqueeze(1) - r.unsqueeze(2)).masked_fill(hide, 0.0)).masked_fill(hide, 0.0)   # as the forward
    dA_off = dA.view(BH, C, n, SUB).transpose(1, 2)                          # (BH, n, C, SUB): columns of J
    dq = ((dA_off @ (kc.view(BH, n, SUB, K) * fk)) * fq).sum(1)              # (BH, C, K)
    dk = ((dA_off.transpose(-1, -2) @ (qc.unsqueeze(1) * fq)) * fk).view(BH, C, K)
    tri = torch.ones(SUB, SUB, dtype=torch.bool, device=b.device).tril()
    dAd = dA.view(BH, n, SUB, n, SUB).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)   # (BH, n, SUB, SUB)
    qv, kv = qc.view(BH, n, SUB, K), kc.view(BH, n, SUB, K)
    span = SPAN.get(b.dtype, 0.0) if b.device.type != "meta" and b.numel() else 0.0
    if _factored_diagonal(bq, span):
        m = (bq[:, :, :1] + bq[:, :, -1:]) / 2
        fr, fc = torch.exp(bq - m), torch.exp(m - bq)
        dAt = dAd * tri
        dq = dq + ((dAt @ (kv * fc)) * fr).view(BH, C, K)
        dk = dk + ((dAt.transpose(-1, -2) @ (qv * fr)) * fc).view(BH, C, K)
    else:
        upper = ~tri[None, None, :, :, None]
        Ed = exp_decay((bq.unsqueeze(3) - bq.unsqueeze(2)).masked_fill(upper, 0.0)).masked_fill(upper, 0.0)
        dq = dq + torch.einsum("bnij,bnjk,bnijk->bnik", dAd, kv, Ed).reshape(BH, C, K)
        dk = dk + torch.einsum("bnij,bnik,bnijk->bnjk", dAd, qv, Ed).reshape(BH, C, K)
    return dq, dk
