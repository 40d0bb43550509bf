"""The "lanes" scan of a diagonal linear recurrence, h_t = a_t * h_{t-1} + u_t (a_t elementwise, <= 1): the
selective scan's chunk form (``ops/mamba/chunk.py``) and the RG-LRU's (``ops/lru/chunk.py``).

The sequence is cut into n = ceil(T / C) lanes of C tokens, and each step runs over the C positions of a lane
with every lane at once:
    1. local scan: each lane from a zero state, positions 0..C-1, one tensor op per position; gives each
       lane's last local state and its total decay (the product of its a_t)
    2. state passing: lane i starts from s_i = total_{i-1} * s_{i-1} + last_{i-1} (n steps) - ``pass_states``
    3. output: the lane's positions again from the true starts (or, with autograd, local + decay * start)
C + n (2C + n) vectorised steps instead of T, fewest near C = sqrt(T) - ``lane_length``. Steps 1 and 3 stay
with each op: the selective scan forms its writes dt_t x_t B_t^T and reads C_t h_t position by position, so
no (T, Dm, N) tensor is ever formed; the RG-LRU's state is the input's size and its writes are the input.
"""

from __future__ import annotations

import math

import torch


def lane_length(T: int, chunk_size: int) -> int:
    """Positions per lane: at most ``chunk_size``; a short sequence uses about sqrt(T) (at least 16)."""
    return min(chunk_size, T, max(16, math.isqrt(T - 1) + 1))


def pass_states(last: torch.Tensor, total: torch.Tensor, s: torch.Tensor, reverse: bool = False):
    """Step 2: last, total (B, n, ...) each lane's local final state and total decay; s (B, ...) the state
    before the first lane -> (starts (B, n, ...) each lane's true starting state, the state after the last).
    ``reverse``: right to left (a backward pass's adjoints: lane i's then flows in at its last position)."""
    n = last.shape[1]
    starts = [None] * n
    for i in (range(n - 1, -1, -1) if reverse else range(n)):
        starts[i] = s
        s = torch.addcmul(last[:, i], total[:, i], s)
    return torch.stack(starts, 1), s
