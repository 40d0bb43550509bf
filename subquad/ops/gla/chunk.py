"""Decayed linear attention, chunkwise form. O(T C K + T K V), matmul-heavy.

Per chunk of C tokens, with b_i = sum_{r <= i, r in chunk} g_r the chunk-local
cumulative log-decay (never a sequence-long cumsum, so float32 keeps its
precision) and S the state carried in:

    1. intra-chunk:  A_ij = q_i . (exp(b_i - b_j) * k_j) for j <= i        (C x C)
    2. state to out: o_i  = scale * (A V + (q_i * exp(b_i)) S)
    3. state pass:   S   <- exp(b_C) * S + (exp(b_C - b_j) * k_j)^T V

Every exponent is a difference <= 0, so nothing overflows however strong the
decay (g = -50 per token only underflows to exact zeros).

Step 1 for a scalar decay is a (C, C) mask times Q K^T. For a per-key-dim decay
(GLA) it needs exp(b_ik - b_jk) inside the sum over k, which is not a matmul.
As in the GLA paper it is split into sub-chunks of 16: a block of sub-chunk I
against an earlier sub-chunk J is a matmul of q_i exp(b_i - r_J) and
k_j exp(r_J - b_j), with r_J the cumulative decay at J's last token (both
exponents <= 0); only the 16 x 16 diagonal blocks are formed elementwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUB = 16  # sub-chunk of the per-key-dim decay


def _heads(x):
    """A chunk (B, c, H, *rest) as (B*H, c, *rest)."""
    B, c, H = x.shape[:3]
    return x.transpose(1, 2).reshape(B * H, c, *x.shape[3:])


def _intra_scalar(qc, kc, b):
    """(BH, c, c) decayed causal scores for a scalar decay b (BH, c)."""
    c = b.shape[1]
    causal = torch.ones(c, c, dtype=torch.bool, device=b.device).tril()
    D = torch.exp((b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~causal, float("-inf")))
    return (qc @ kc.transpose(1, 2)) * D


def _intra_vector(qc, kc, b):
    """(BH, C, C) decayed causal scores for a per-key-dim decay b (BH, C, K); C a multiple of SUB."""
    BH, C, K = qc.shape
    n = C // SUB
    bq = b.view(BH, n, SUB, K)
    r = bq[:, :, -1]                                                         # (BH, n, K) reference per sub-chunk
    k_t = kc.view(BH, n, SUB, K) * torch.exp(r.unsqueeze(2) - bq)           # (BH, n, SUB, K), exponent <= 0
    sub_of_row = torch.arange(C, device=b.device) // SUB                     # (C,)
    later = sub_of_row.view(1, C) > torch.arange(n, device=b.device).view(n, 1)   # (n, C): row after sub-chunk J
    E = (b.unsqueeze(1) - r.unsqueeze(2)).masked_fill(~later[None, :, :, None], float("-inf"))
    q_t = qc.unsqueeze(1) * torch.exp(E)                                     # (BH, n, C, K), exponent <= 0
    A = (q_t @ k_t.transpose(-1, -2))                                        # (BH, n, C, SUB): columns of J
    A = A.permute(0, 2, 1, 3).reshape(BH, C, C)
    tri = torch.ones(SUB, SUB, dtype=torch.bool, device=b.device).tril()
    Ed = (bq.unsqueeze(3) - bq.unsqueeze(2)).masked_fill(~tri[None, None, :, :, None], float("-inf"))
    Ad = torch.einsum("bnik,bnjk,bnijk->bnij", qc.view(BH, n, SUB, K), kc.view(BH, n, SUB, K), torch.exp(Ed))
    A.view(BH, n, SUB, n, SUB).diagonal(dim1=1, dim2=3).add_(Ad.permute(0, 2, 3, 1))
    return A


def _scalar_inference(q, k, v, g, scale, C, initial_state):
    """The scalar-decay chunk form when no gradient is wanted: the same three steps, written into one
    output buffer and one running state in place (no per-chunk allocations of o, S or the scores)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = g.dtype
    BH = B * H
    qh, kh, vh = (x.to(dt).transpose(1, 2).reshape(BH, T, x.shape[-1]) for x in (q, k, v))   # head-major copies
    gh = g.transpose(1, 2).reshape(BH, T)
    o = torch.empty(BH, T, V, dtype=dt, device=q.device)
    S = torch.zeros(BH, K, V, dtype=dt, device=q.device) if initial_state is None \
        else initial_state.reshape(BH, K, V).clone()
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    scores = torch.empty(BH, C, C, dtype=dt, device=q.device)
    for s in range(0, T, C):
        e = min(s + C, T)
        c = e - s
        qc, kc, vc, oc = qh[:, s:e], kh[:, s:e], vh[:, s:e], o[:, s:e]
        b = gh[:, s:e].cumsum(1)                                              # (BH, c) chunk-local
        sc = scores[:, :c, :c]
        torch.bmm(qc, kc.transpose(1, 2), out=sc)
        sc.mul_(torch.exp((b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill_(~causal[:c, :c], float("-inf"))))
        oc.baddbmm_(sc, vc, beta=0)                                           # intra-chunk (o's old contents ignored)
        oc.baddbmm_(qc * torch.exp(b).unsqueeze(-1), S)                       # from the state carried in
        b_last = b[:, -1:]
        S.mul_(torch.exp(b_last).unsqueeze(-1)).baddbmm_((kc * torch.exp(b_last - b).unsqueeze(-1)).transpose(1, 2), vc)
    o.mul_(scale)
    return o.view(B, H, T, V).transpose(1, 2), S.view(B, H, K, V)


def chunk_decay_attention(q, k, v, g, *, scale, chunk_size=64, initial_state=None):
    B, T, H, K = q.shape
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, initial_state))
    if g.dim() == 3 and not wants_grad:
        return _scalar_inference(q, k, v, g, scale, min(chunk_size, T), initial_state)
    V = v.shape[-1]
    dt = g.dtype
    vector = g.dim() == 4
    C = chunk_size
    if vector:  # chunks of whole sub-chunks; zero-padding adds nothing to outputs or state (k = 0, g = 0)
        C = max(SUB, -(-chunk_size // SUB) * SUB)
        pad = -T % C
        if pad:
            q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
            g = F.pad(g, (0, 0, 0, 0, 0, pad))
    Tp = q.shape[1]
    S = torch.zeros(B * H, K, V, dtype=dt, device=q.device) if initial_state is None \
        else initial_state.reshape(B * H, K, V)
    outs = []
    # torch.split, not slicing: the backward of T/C slices would each allocate a full-length
    # zero gradient (quadratic in T); split's backward is one concatenation.
    for qc, kc, vc, gc in zip(*(x.split(C, dim=1) for x in (q, k, v, g))):
        c = qc.shape[1]
        qc, kc, vc = (_heads(x).to(dt) for x in (qc, kc, vc))                 # (BH, c, K|V)
        b = _heads(gc).cumsum(1)                                              # (BH, c[, K])
        bk = b if vector else b.unsqueeze(-1)                                 # (BH, c, K|1)
        A = _intra_vector(qc, kc, b) if vector else _intra_scalar(qc, kc, b)
        oc = (A @ vc + (qc * torch.exp(bk)) @ S) * scale                     # (BH, c, V)
        outs.append(oc.view(B, H, c, V))
        b_last = bk[:, -1:]                                                   # (BH, 1, K|1)
        S = torch.exp(b_last).transpose(1, 2) * S + (kc * torch.exp(b_last - bk)).transpose(1, 2) @ vc
    o = torch.cat(outs, 2).transpose(1, 2)[:, :T]                             # (B, T, H, V)
    return o, S.view(B, H, K, V)
