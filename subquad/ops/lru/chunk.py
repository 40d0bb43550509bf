"""The RG-LRU, chunk form: Mamba's "lanes" (``ops/mamba/chunk.py``) for a state as wide as the input.

The sequence is cut into n = ceil(T / C) lanes of C tokens; every lane at once:
    1. local scan: each lane from a zero state, positions 0..C-1, one tensor op per position
       (B, n, H, P) over all lanes; every local state is kept (together they are one (B, T, H, P) tensor)
    2. state passing: lane i starts from s_i = exp(G_{i-1}) s_{i-1} + local_{i-1, C-1}, with G_i the lane's
       total log-decay (n steps of (B, H, P))
    3. output: h = local + exp(Gcum) * s, Gcum the log-decay from the lane's start (a cumulative sum
       inside the lane, every term <= 0), all positions at once
Unlike the selective scan, whose states are N times wider than its input, the RG-LRU's states are the
input's size, so autograd may keep them: no hand-written backward. C + n vectorised steps instead of T.
"""

from __future__ import annotations

import math

import torch

from subquad.ops.common.expo import exp_decay
from subquad.ops.mamba.chunk import _lanes


def chunk_lru(u, g, *, chunk_size=64, initial_state=None):
    """Lanes of at most ``chunk_size`` positions; a short sequence uses about sqrt(T) (at least 16): the work
    walks C + T / C vectorised steps, fewest near C = sqrt(T)."""
    B, T, H, P = u.shape
    c = min(chunk_size, T, max(16, math.isqrt(T - 1) + 1))
    # (B, n, c, H, P); the padded tail has g = 0 and u = 0: no decay and no write, so the final state stays
    ul, gl = (t.view(B, t.shape[1], c, H, P) for t in _lanes(c, u.flatten(2), g.flatten(2)))
    n = ul.shape[1]
    a = exp_decay(gl)
    h = ul[:, :, 0]
    local = [h]
    for j in range(1, c):                                                      # 1. every lane from zero
        h = torch.addcmul(ul[:, :, j], a[:, :, j], h)
        local.append(h)
    local = torch.stack(local, 2)                                              # (B, n, c, H, P)
    G = torch.cumsum(gl, 2)                                                    # log-decay since the lane's start
    total = exp_decay(G[:, :, -1])
    s = u.new_zeros(B, H, P) if initial_state is None else initial_state
    starts = []
    for i in range(n):                                                         # 2. state passing between lanes
        starts.append(s)
        s = torch.addcmul(local[:, i, -1], total[:, i], s)
    h = torch.addcmul(local, exp_decay(G), torch.stack(starts, 1)[:, :, None])  # 3. outputs from the true starts
    return h.flatten(1, 2)[:, :T], s
