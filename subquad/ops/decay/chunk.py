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

A differentiable call computes steps 1, 2's intra-chunk half and 3's increments
for every chunk at once and loops only over the elementwise state recurrence;
calls longer than PIECE tokens run piece by piece with the state carried, so
autograd's temporaries stay piece-sized. Without a gradient, ``inference.py`` runs
the same steps in place over groups of chunks (the fast path for prefill,
evaluation and generation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from subquad.ops.common.autograd import inference_path, wants_grad
from subquad.ops.common.chunking import in_pieces
from subquad.ops.common.routes import PIECE, PIECE_PER_KEY_DIM, SHORT
from subquad.ops.decay.inference import decay_attention_inference
from subquad.ops.decay.intra import SUB, _intra_scalar, _intra_vector
from subquad.ops.decay.recurrent import recurrent_decay_attention
from subquad.ops.common.expo import exp_decay




def _chunkwise(q, k, v, g, scale, C, initial_state):
    """Steps 1 and 2's intra-chunk half and the state increments for every chunk at once; only the
    state recurrence S <- exp(b_C) S + KV_c loops over chunks (elementwise). Differentiable by autograd."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = g.dtype
    vector = g.dim() == 4
    pad = -T % C
    if pad:                                            # zero keys and log-decays add nothing
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, 0) * (g.dim() - 2) + (0, pad))
    n = (T + pad) // C
    BH = B * H
    qc, kc, vc = (x.to(dt).transpose(1, 2).reshape(BH * n, C, x.shape[-1]) for x in (q, k, v))
    b = g.transpose(1, 2).reshape(BH * n, C, *g.shape[3:]).cumsum(1)           # (BH n, C[, K]) chunk-local
    bk = b if vector else b.unsqueeze(-1)                                       # (BH n, C, K|1)
    A = _intra_vector(qc, kc, b) if vector else _intra_scalar(qc, kc, b)
    b_last = bk[:, -1:]                                                         # (BH n, 1, K|1)
    KV = ((kc * exp_decay(b_last - bk)).transpose(1, 2) @ vc).view(BH, n, K, V)
    decay = exp_decay(b_last).transpose(1, 2).view(BH, n, bk.shape[-1], 1)      # (BH, n, K|1, 1)
    S = torch.zeros(BH, K, V, dtype=dt, device=q.device) if initial_state is None \
        else initial_state.reshape(BH, K, V)
    before = []
    # unbind, not slicing: its backward is one stack (T/C slices would be quadratic in T)
    for KVj, aj in zip(KV.unbind(1), decay.unbind(1)):
        before.append(S)
        S = aj * S + KVj
    Sb = torch.stack(before, 1).view(BH * n, K, V)
    o = (A @ vc + (qc * exp_decay(bk)) @ Sb) * scale                           # (BH n, C, V)
    o = o.view(B, H, T + pad, V)[:, :, :T].transpose(1, 2)
    return o, S.view(B, H, K, V)


def chunk_decay_attention(q, k, v, g, *, scale, chunk_size=64, initial_state=None):
    if q.shape[1] < SHORT and not wants_grad(q, k, v, g, initial_state):     # a decoding step, compiled or not
        return recurrent_decay_attention(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
    if inference_path(q, k, v, g, initial_state):
        return decay_attention_inference(q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)
    T = q.shape[1]
    C = min(chunk_size, T)                             # past T: one chunk of T
    if g.dim() == 4:                                   # chunks of whole sub-chunks for the per-key-dim decay
        C = max(SUB, -(-C // SUB) * SUB)
    L = max(1, (PIECE_PER_KEY_DIM if g.dim() == 4 else PIECE) // C) * C
    if T <= L:
        return _chunkwise(q, k, v, g, scale, C, initial_state)
    # pieces of L tokens in turn, the state carried: autograd's temporaries stay piece-sized
    return in_pieces(lambda *x: _chunkwise(*x[:4], scale, C, x[4]), (q, k, v, g), L, initial_state)
