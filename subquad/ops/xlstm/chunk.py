"""The mLSTM, chunk form: transformers' (and NX-AI's) ``mlstm_chunkwise`` with the max stabiliser carried across
chunks. The sequence is cut into n chunks of C tokens (the last padded with g = 0, i = -inf: no decay, no write);
per chunk j, with L the chunk's ``segsum`` of g, b_t its cumulative g and (C_j, n_j, m_j) the state at its start:

    1. intra-chunk log weights: log D[t, s] = L[t, s] + i_s (-inf for s > t); a_s = log D[C-1, s], the weight of
       token s's write in the chunk's end state; G = b_{C-1}, the chunk's total log forget gate
    2. state passing, chunk by chunk (n steps of (B, H, K, V)):
           m_{j+1} = max(G + m_j, max_s a_s)
           C_{j+1} = exp(G + m_j - m_{j+1}) C_j + sum_s exp(a_s - m_{j+1}) k_s v_s^T,   n_{j+1} likewise with k_s
    3. outputs, every chunk at once: m_t = max(b_t + m_j, max_s log D[t, s]) (the recurrent form's m_t exactly),
       w_t = exp(b_t + m_j - m_t), S[t, s] = (s q_t . k_s) exp(log D[t, s] - m_t),
           h_t = (w_t (s q_t)^T C_j + sum_s S[t, s] v_s) / (max(|w_t (s q_t)^T n_j + sum_s S[t, s]|, exp(-m_t)) + eps)

O(T C (K + V) + T K V). transformers runs this only on whole chunks (its ``wrap_chunkwise_arbitrary_sequence_length``
sends the tail to the token loop); here the tail is a padded chunk, the same math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from subquad.ops.xlstm.parallel import segsum


def mlstm_chunk(q, k, v, g, i, *, scale, eps, chunk_size=64, initial_state):
    B, T, H = q.shape[:3]
    c = min(chunk_size, T)
    n = -(-T // c)
    pad = n * c - T

    def chunks(t, value=0.0):           # (B, T, H, ...) -> (B, H, n, c, ...)
        t = t.transpose(1, 2)
        if pad:
            t = F.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad), value=value)
        return t.reshape(B, H, n, c, *t.shape[3:])

    qc, kc, vc = chunks(q * scale), chunks(k), chunks(v)
    gc, ic = chunks(g), chunks(i, float("-inf"))
    # 1. intra-chunk log weights
    logD = segsum(gc) + ic.unsqueeze(-2)                                   # (B, H, n, c, c)
    b = torch.cumsum(gc, -1)                                               # (B, H, n, c)
    a = logD[..., -1, :]                                                   # (B, H, n, c)
    G, amax = b[..., -1], a.amax(-1)                                       # (B, H, n)
    # 2. state passing: the state at each chunk's start
    Cs, ns, ms = [], [], []
    Cj, nj, mj = initial_state
    for j in range(n):
        Cs.append(Cj)
        ns.append(nj)
        ms.append(mj)
        m_next = torch.maximum(G[..., j] + mj, amax[..., j]).detach()   # a constant to autograd (README)
        decay = torch.exp(G[..., j] + mj - m_next)
        kw = kc[:, :, j] * torch.exp(a[..., j, :] - m_next.unsqueeze(-1)).unsqueeze(-1)   # (B, H, c, K)
        Cj = decay[..., None, None] * Cj + kw.transpose(-1, -2) @ vc[:, :, j]
        nj = decay[..., None] * nj + kw.sum(-2)
        mj = m_next
    Cs, ns, ms = torch.stack(Cs, 2), torch.stack(ns, 2), torch.stack(ms, 2)  # (B, H, n, K, V), (.., K), (B, H, n)
    # 3. outputs of every chunk at once
    inter = b + ms.unsqueeze(-1)                                           # (B, H, n, c)
    m = torch.maximum(inter, logD.amax(-1)).detach()
    w = torch.exp(inter - m).unsqueeze(-1)                                 # (B, H, n, c, 1)
    S = (qc @ kc.transpose(-1, -2)) * torch.exp(logD - m.unsqueeze(-1))
    num = w * (qc @ Cs) + S @ vc
    den = torch.maximum((w * (qc @ ns.unsqueeze(-1)) + S.sum(-1, keepdim=True)).abs(), torch.exp(-m).unsqueeze(-1))
    h = (num / (den + eps)).reshape(B, H, n * c, v.shape[-1])[:, :, :T]
    return h.transpose(1, 2), (Cj, nj, mj)
