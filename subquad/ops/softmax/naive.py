"""Softmax attention, the naive T x L reference (the spec the other forms are checked against).

    s_tj = scale * q_t . k_j,   visible iff  j <= pos_t  (causal)  and  pos_t - j <= W  (window)
    o_t  = sum_j softmax_j(s_tj) v_j,    lse_t = log sum_j exp(s_tj)

Keys are the cached ones followed by the new ones; query t sits at absolute
position pos_t = offset + L_cache + t.
"""

from __future__ import annotations

import torch

from subquad.ops.common.precision import amp_op
from subquad.ops.common.varlen import varlen
from subquad.ops.softmax.prepare import finish, prepare, check_flags, visible_mask
from subquad.ops.softmax.ragged import takes_ragged_caches


@amp_op()
@varlen("q", "k", "v", states="caches")
@takes_ragged_caches
def naive_softmax_attention(q, k, v, *, causal=True, window=None, chunk_size=64, scale=None,
                            initial_state=None, output_final_state=False, return_lse=False):
    """T x L softmax attention written out; same signature as ``softmax_attention``."""
    check_flags(causal, output_final_state, return_lse)
    scale, cache, kk, vv, q_start = prepare(q, k, v, causal, window, scale, chunk_size, initial_state)
    qh, kh, vh = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)          # (B, H, *, D)
    s = (qh @ kh.transpose(-1, -2)) * scale                                           # (B, H, T, L)
    m = visible_mask(q.shape[1], kk.shape[1], causal=causal, window=window,
                     q_start=q_start, k_start=q_start - len(cache) if cache is not None else 0, device=q.device)
    s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                                  # (B, H, T)
    o = (torch.softmax(s, dim=-1) @ vh).transpose(1, 2)
    return finish(o, lse.transpose(1, 2), cache, k, v, window, output_final_state, return_lse)
