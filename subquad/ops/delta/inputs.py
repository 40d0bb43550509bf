"""The input checks every op of the delta family makes first (the family's dispatchers share them)."""

from __future__ import annotations

from subquad.ops.common.checks import check_bool, check_chunk_size, check_mode, check_qkv
from subquad.ops.common.routes import check_route

ROUTES = ("token", "chunk")   # the chunk form's routes: the token loop (short calls) or the chunk engine


def check_call(op: str, q, k, v, mode, chunk_size, output_final_state, route) -> None:
    """mode, route (the chunk form's only), q, k, v, at least one token, chunk_size and output_final_state."""
    check_mode(mode)
    check_route(route, ROUTES, op)
    if route is not None and mode != "chunk":
        raise ValueError(f"route chooses between the chunk form's routes (mode='chunk'); got route={route!r} with "
                         f"mode={mode!r}")
    check_qkv(q, k, v)
    if q.shape[1] < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {tuple(q.shape)}")
    check_chunk_size(chunk_size)
    check_bool("output_final_state", output_final_state)
