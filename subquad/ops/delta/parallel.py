"""The (gated) delta rule, parallel form: the chunk engine's algebra (README.md here) with one chunk
spanning the whole sequence - a T x T triangular solve, O(T^2 K + T^3): a reference for short T."""

from __future__ import annotations

from subquad.ops.decay.intra import SUB
from subquad.ops.delta.chunk import _engine


def parallel_delta(q, k, v, g, beta, *, scale, chunk_size=None, initial_state=None):
    """The whole sequence as one chunk: a T x T triangular solve. O(T^2 K + T^3) - a reference for short T."""
    C = q.shape[1]
    if g is not None and g.dim() == 4:                  # KDA's scores use sub-chunks of SUB
        C = -(-C // SUB) * SUB
    return _engine(q, k, v, g, beta, scale, C, C, initial_state)
