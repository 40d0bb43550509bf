"""The (gated) delta rule, parallel form: the chunk form's algebra (README.md here) with one chunk
spanning the whole sequence - a T x T triangular solve, O(T^2 K + T^3): a reference for short T."""

from __future__ import annotations

from subquad.ops.delta.chunk import _chunkwise


def parallel_delta(q, k, v, g, beta, *, scale, chunk_size=None, initial_state=None):
    """The whole sequence as one chunk: a T x T triangular solve. O(T^2 K + T^3) - a reference for short T."""
    return _chunkwise(q, k, v, g, beta, scale, q.shape[1], initial_state)
