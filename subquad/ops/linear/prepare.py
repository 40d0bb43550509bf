"""What every linear-attention form starts with: the argument checks, the route, and the initial state
unpacked. One module the forms import, so no form reaches back into its dispatcher (``linear/__init__.py``)."""

from __future__ import annotations

from subquad.ops.common.checks import (check_bool, check_chunk_size, check_qkv, check_real, default_scale,
                                      state_dtype)
from subquad.ops.common.routes import check_route
from subquad.ops.linear.state import unpack_state

ROUTES = ("token", "chunk")   # the chunk form's: the token loop for short calls, or the chunk engine


def _prepare(q, k, v, scale, chunk_size):
    """Shared argument checks; returns the float scale."""
    check_qkv(q, k, v)
    if q.shape[1] < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {tuple(q.shape)}")
    check_chunk_size(chunk_size)
    return default_scale(scale, q.shape[-1])


def prepare_form(q, k, v, scale, chunk_size, initial_state, normalize, eps, output_final_state, route, form):
    """What every form starts with: checks, then (scale, S0, z0, the state's dtype, eps). ``route`` is the
    chunk form's (chunk.py): None, or with form "chunk" one of its routes."""
    check_route(route, ROUTES, "linear_attention")
    if route is not None and form != "chunk":
        raise ValueError(f"route={route!r} is a route of the chunk form; linear_attention got mode={form!r}")
    check_bool("normalize", normalize)
    check_bool("output_final_state", output_final_state)
    eps = check_real("eps", eps, minimum=0.0)
    scale = _prepare(q, k, v, scale, chunk_size)
    S0, z0 = unpack_state(initial_state, q, v, normalize)
    return scale, S0, z0, state_dtype(q.dtype), eps
