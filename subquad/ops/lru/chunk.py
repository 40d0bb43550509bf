"""The RG-LRU, chunk form: the lanes scan (``ops/common/lanes.py``, shared with Mamba's selective scan) for a
state as wide as the input.

The sequence is cut into n = ceil(T / C) lanes of C tokens, laid out position-major, (B, C, n, H, P), so that one
position of every lane is one contiguous (B, n, H, P) block; every lane at once:
    1. local scan: each lane from a zero state, positions 0..C-1, one tensor op per position
    2. state passing: lane i starts from s_i = exp(G_{i-1}) s_{i-1} + local_{C-1, i-1}, with G_i the lane's
       total log-decay (n steps of (B, H, P))
    3. output: with a gradient, h = local + exp(Gcum) * s for all positions at once, Gcum the log-decay since
       the lane's start (a cumulative sum inside the lane, every term <= 0: nothing overflows); autograd keeps
       the local states, which are the input's size (the selective scan's are N times it: it needs a
       hand-written backward, this form does not). Without a gradient, step 1 keeps only each lane's last
       state and total decay, and step 3 scans the C positions again from the true starts, in place in one
       buffer (Mamba's step 3): fewer passes over memory, no fresh tensor per position.
C + n (2C + n without a gradient) vectorised steps instead of T.
"""

from __future__ import annotations

import torch

from subquad.ops.common.autograd import wants_grad
from subquad.ops.common.chunking import token_slice
from subquad.ops.common.expo import exp_decay
from subquad.ops.common.lanes import lane_length, pass_states


def _lanes_with_grad(ul, gl, a, s):
    c = ul.shape[1]
    h = ul[:, 0]
    local = [h]
    for j in range(1, c):                                                      # 1. every lane from zero
        h = torch.addcmul(ul[:, j], a[:, j], h)
        local.append(h)
    local = torch.stack(local, 1)
    G = torch.cumsum(gl, 1)                                                    # log-decay since the lane's start
    starts, s = pass_states(local[:, -1], exp_decay(G[:, -1]), s)              # 2. state passing between lanes
    return torch.addcmul(local, exp_decay(G), starts[:, None]), s              # 3. from the true starts


def _lanes_in_place(ul, a, s):
    """The same without autograd; ``ul`` (a fresh buffer) is overwritten with the outputs."""
    c = ul.shape[1]
    h, total = ul[:, 0].clone(), a[:, 0].clone()
    for j in range(1, c):                                                      # 1. lanes' last states, decays
        h.mul_(a[:, j]).add_(ul[:, j])
        total.mul_(a[:, j])
    prev, s = pass_states(h, total, s)                                         # 2. state passing between lanes
    for j in range(c):                                                         # 3. positions again, true starts
        prev = ul[:, j].addcmul_(a[:, j], prev)
    return ul, s


def chunk_lru(u, g, *, chunk_size=64, initial_state=None):
    """Lanes of at most ``chunk_size`` positions; a short sequence uses about sqrt(T) (at least 16): the work
    walks C + T / C vectorised steps, fewest near C = sqrt(T)."""
    B, T, H, P = u.shape
    c = lane_length(T, chunk_size)
    n = -(-T // c)

    def lanes(t):   # (B, c, n, H, P), a fresh buffer; the padded tail has g = 0 and u = 0: no decay, no write
        return torch.empty(B, c, n, H, P, dtype=t.dtype, device=t.device).copy_(
            token_slice(t, 0, T, n * c).view(B, n, c, H, P).transpose(1, 2))

    ul, gl = lanes(u), lanes(g)
    a = exp_decay(gl)
    s = u.new_zeros(B, H, P) if initial_state is None else initial_state
    h, s = _lanes_with_grad(ul, gl, a, s) if wants_grad(u, g, initial_state) else _lanes_in_place(ul, a, s)
    return h.transpose(1, 2).reshape(B, n * c, H, P)[:, :T], s
