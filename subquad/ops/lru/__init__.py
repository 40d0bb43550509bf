"""Griffin's Real-Gated Linear Recurrent Unit (RG-LRU; De et al. 2024, arXiv:2402.19427), in three forms.

    h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * x_t,    a_t = exp(g_t),    o_t = h_t       elementwise per channel

Shapes: x, g, o (B, T, H, P); state (B, H, P). ``x`` is the already input-gated value (i_t * x_t in the
paper) and ``g = log a_t <= 0`` the log-decay (Griffin: g_t = -c r_t softplus(Lambda), c = 8), so every
channel is its own scalar recurrence: the heads only group channels, as the layer's block-diagonal gates do.

``g = -inf`` is a reset: a_t = 0 and the multiplier is 1, so h_t = x_t whatever came before - RecurrentGemma's
rule at the first token of a sequence (its ``position_ids == 0``), which the layer applies
(``subquad.layers.griffin``); the op treats every token alike, so packed sequences (``cu_seqlens``) and a
prefill continued by decoding compose as for every other op. sqrt(1 - a^2) has an unbounded derivative as
a -> 1; as in Griffin's reference code its gradient is clipped at 1000 (``_BoundedSqrt``), the value is exact.

The chunk form has two routes: ``route="chunk"``, the lanes (``chunk.py``), and ``route="token"``, the token
loop of ``recurrent.py``; ``route=None`` takes the token loop for calls of fewer than ``routes.SHORT_SCAN``
tokens without a gradient (a decoding step), the lanes otherwise, and records the route taken.

Example:
    >>> import torch
    >>> from subquad.ops import rg_lru
    >>> x, g = torch.randn(1, 100, 2, 8), -torch.rand(1, 100, 2, 8)
    >>> o, h = rg_lru(x, g, output_final_state=True)
    >>> o.shape, h.shape
    (torch.Size([1, 100, 2, 8]), torch.Size([1, 2, 8]))
"""

from __future__ import annotations

import torch

from subquad.ops.common.autograd import wants_grad
from subquad.ops.common.checks import (check_bool, check_chunk_size, check_gate_dtype, check_like, check_mode,
                                      check_state, describe, state_dtype)
from subquad.ops.common.forms import three_forms
from subquad.ops.common.precision import amp_op, autocast_off, causal_guard, checks_on, finite_log_decay
from subquad.ops.common.routes import SHORT_SCAN, check_route, took
from subquad.ops.common.varlen import varlen
from subquad.ops.lru.chunk import chunk_lru
from subquad.ops.lru.parallel import parallel_lru
from subquad.ops.lru.recurrent import recurrent_lru

_FORMS = {"parallel": parallel_lru, "recurrent": recurrent_lru, "chunk": chunk_lru}
ROUTES = ("token", "chunk")   # the chunk form's routes: the token loop (short calls) or the lanes
MAX_SQRT_GRADIENT = 1000.0    # Griffin's clip of d sqrt(y) / dy near y = 0 (a_t -> 1)


class _BoundedSqrt(torch.autograd.Function):
    """sqrt(y), with its derivative 1 / (2 sqrt(y)) capped at ``MAX_SQRT_GRADIENT`` (y >= 1 / (4 * 1000^2))."""

    @staticmethod
    @autocast_off
    def forward(ctx, y):
        ctx.save_for_backward(y)
        return torch.sqrt(y)

    @staticmethod
    @autocast_off
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clamp(4.0 * y, min=MAX_SQRT_GRADIENT ** -2))


def multiplier(g: torch.Tensor) -> torch.Tensor:
    """sqrt(1 - exp(2 g)), the input's normaliser: 1 - exp(2g) as -expm1(2g), exact for small |g|."""
    return _BoundedSqrt.apply(-torch.expm1(2 * g))


@amp_op(positions=(0,))
@varlen("x", "g")
def rg_lru(x, g, *, mode="chunk", chunk_size=64, initial_state=None, output_final_state=False, route=None):
    """RG-LRU: h_t = exp(g_t) h_{t-1} + sqrt(1 - exp(2 g_t)) x_t, o_t = h_t; x, g (B, T, H, P), g <= 0 (-inf: a
    reset). Returns (o (B, T, H, P), final state (B, H, P) or None). ``route``: None, "chunk" or "token"
    (mode="chunk" only; module docstring)."""
    check_mode(mode)
    check_route(route, ROUTES, "rg_lru")
    if route is not None and mode != "chunk":
        raise ValueError(f"route chooses between the chunk form's routes (mode='chunk'); got route={route!r} with "
                         f"mode={mode!r}")
    check_chunk_size(chunk_size)
    check_bool("output_final_state", output_final_state)
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor (B, T, H, P), got {describe(x)}")
    B, T, H, P = x.shape
    if T < 1:
        raise ValueError(f"x must hold at least one token (T >= 1), got shape {tuple(x.shape)}")
    check_like("g", g, x.shape, x, "x")
    check_gate_dtype("g", g, x, "x")
    if checks_on(g) and (g > 0).any():
        raise ValueError(f"g is a log-decay and must be <= 0 everywhere; got max {g.max().item():.3g}")
    sd = state_dtype(x.dtype)
    if initial_state is not None:
        check_state("initial_state", initial_state, (B, H, P), x, "x")
    g = g.to(sd)
    u = x.to(sd) * multiplier(g)
    g = finite_log_decay(g)                            # -inf (a reset) -> -1000: exp of it is 0 as well

    def run(form):
        return _FORMS[form](u, g, chunk_size=chunk_size, initial_state=initial_state)

    if mode == "chunk":
        if route is None:                              # a decoding step without a gradient: the token loop
            short = T < SHORT_SCAN and not wants_grad(x, g, initial_state)
            route = "token" if short else "chunk"
        took("rg_lru", route)
        o, h = run("recurrent" if route == "token" else "chunk")
    else:
        o, h = run(mode)
    if mode != "recurrent":                            # non-finite input stays causal
        o, h = causal_guard((o, h), h, lambda: run("recurrent"), T)
    return o.to(x.dtype), (h if output_final_state else None)


parallel_rg_lru, recurrent_rg_lru, chunk_rg_lru = three_forms(rg_lru)

__all__ = ["rg_lru", "parallel_rg_lru", "recurrent_rg_lru", "chunk_rg_lru"]
