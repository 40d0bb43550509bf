"""The (gated) delta rule and the generalised delta rule, parallel form: the chunk engine's algebra (README.md
here) with one chunk spanning the whole sequence - a T x T triangular solve, O(T^2 K + T^3): a reference for
short T."""

from __future__ import annotations

from subquad.ops.decay.intra import SUB
from subquad.ops.delta.chunk import _dplr_factors, _engine, _factors


def parallel_delta(q, k, v, g, beta, *, scale, chunk_size=None, initial_state=None):
    """The whole sequence as one chunk: a T x T triangular solve. O(T^2 K + T^3) - a reference for short T."""
    C = q.shape[1]
    if g is not None and g.dim() == 4:                  # KDA's scores use sub-chunks of SUB
        C = -(-C // SUB) * SUB
    return _engine(_factors, (q, k, v, g, beta), beta.dtype, scale, C, C, initial_state)


def parallel_dplr(q, k, v, w, a, b, *, scale, chunk_size=None, initial_state=None):
    """The generalised delta rule with the whole sequence as one chunk (rounded up to a multiple of SUB)."""
    C = -(-q.shape[1] // SUB) * SUB
    return _engine(_dplr_factors, (q, k, v, w, a, b), w.dtype, scale, C, C, initial_state)
