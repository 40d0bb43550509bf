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

This loop is what autograd differentiates. Without a gradient, ``inference.py``
runs the same steps batched over groups of chunks (the fast path for prefill,
evaluation and generation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from subquad.ops.common.autograd import wants_grad
from subquad.ops.gla.inference import decay_attention_inference
from subquad.ops.gla.intra import SUB, _heads, _intra_scalar, _intra_vector


def chunk_decay_attention(q, k, v, g, *, scale, chunk_size=64, initial_state=None):
    B, T, H, K = q.shape
    if not wants_grad(q, k, v, g, initial_state):
        return decay_attention_inference(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
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
