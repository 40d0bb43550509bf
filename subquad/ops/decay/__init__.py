"""Decayed and gated linear attention: retention, simple GLA (Mamba-2's SSD) and GLA.

    S_t = diag(a_t) S_{t-1} + k_t v_t^T,    o_t = scale * S_t^T q_t,    g_t = log a_t <= 0

    retention   g (H,)           one fixed decay per head                 RetNet, Sun et al. 2023
    simple_gla  g (B, T, H)      a data-dependent scalar per head, token  Mamba-2 SSD, Dao & Gu 2024
    gla         g (B, T, H, K)   a data-dependent decay per key dim       GLA, Yang et al. 2024

Decays arrive in log space so that products of many decays are sums and never
underflow into NaN; every form exponentiates only differences of cumulative
log-decays that are <= 0, so nothing overflows even at g = -50 per token.
Shapes: q, k (B, T, H, K); v, o (B, T, H, V); state (B, H, K, V).

With k = B_t * dt_t, v = x_t, q = C_t and g = dt_t * A, ``simple_gla`` is the
Mamba-2 recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t . h_t.

Example:
    >>> import torch
    >>> from subquad.ops import simple_gla
    >>> q, k, v = torch.randn(1, 100, 2, 16), torch.randn(1, 100, 2, 16), torch.randn(1, 100, 2, 8)
    >>> g = -torch.rand(1, 100, 2)
    >>> o, S = simple_gla(q, k, v, g, mode="chunk", output_final_state=True)
    >>> o.shape, S.shape
    (torch.Size([1, 100, 2, 8]), torch.Size([1, 2, 16, 8]))
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import (check_bool, check_chunk_size, check_gate_dtype, check_like, check_mode,
                                      check_qkv, check_state, default_scale, describe, state_dtype)
from subquad.ops.common.precision import amp_op, causal_guard, checks_on, finite_log_decay
from subquad.ops.common.autograd import inference_path
from subquad.ops.common.forms import three_forms
from subquad.ops.common.routes import SHORT, check_route
from subquad.ops.decay.chunk import ROUTES, chunk_decay_attention
from subquad.ops.decay.parallel import parallel_decay_attention
from subquad.ops.decay.recurrent import recurrent_decay_attention
from subquad.ops.decay.ssd import ssd_inference
from subquad.ops.common.varlen import varlen

_FORMS = {"parallel": parallel_decay_attention, "recurrent": recurrent_decay_attention, "chunk": chunk_decay_attention}


def _prepare(q, k, v, g, g_shape, mode, chunk_size, scale, initial_state, output_final_state, route, op):
    check_mode(mode)                                   # q, k, v were checked by the caller
    check_form_route(route, mode, op)
    if q.shape[1] < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {tuple(q.shape)}")
    check_chunk_size(chunk_size)
    check_bool("output_final_state", output_final_state)
    check_like("g", g, g_shape, q)
    check_gate_dtype("g", g, q)
    if checks_on(g) and (g > 0).any():
        raise ValueError(f"g is a log-decay and must be <= 0 everywhere; got max {g.max().item():.3g}")
    B, _, H, K = q.shape
    if initial_state is not None:
        check_state("initial_state", initial_state, (B, H, K, v.shape[-1]), q)
    return default_scale(scale, K), initial_state


def check_form_route(route, mode, op):
    """``route`` picks among the chunk form's routes (chunk.py): None, or one of ROUTES with mode="chunk"."""
    check_route(route, ROUTES, op)
    if route is not None and mode != "chunk":
        raise ValueError(f"route={route!r} is a route of the chunk form; {op} got mode={mode!r}")


def _run(q, k, v, g, mode, chunk_size, scale, initial_state, output_final_state, route, op):
    g = finite_log_decay(g.to(state_dtype(q.dtype)))           # a decay of exactly 0: the same in every form

    def run(form):
        chosen = {"route": route, "op": op} if form == "chunk" else {}
        return _FORMS[form](q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state, **chosen)

    o, S = run(mode)
    if mode != "recurrent":
        o, S = causal_guard((o, S), S, lambda: run("recurrent"), q.shape[1])
    return o.to(q.dtype), (S if output_final_state else None)


@amp_op()
@varlen("q", "k", "v")
def retention(q, k, v, g, *, mode="chunk", chunk_size=64, scale=None, initial_state=None, output_final_state=False,
              route=None):
    """Retention (RetNet): S_t = a S_{t-1} + k_t v_t^T with a fixed log-decay ``g = log a`` of shape (H,).
    ``route``: None (automatic) or one of the chunk form's routes (chunk.py), recorded by ``routes.took``."""
    check_qkv(q, k, v)
    B, T, H, _ = q.shape
    scale, initial_state = _prepare(q, k, v, g, (H,), mode, chunk_size, scale, initial_state, output_final_state,
                                    route, "retention")
    return _run(q, k, v, g.view(1, 1, H).expand(B, T, H), mode, chunk_size, scale, initial_state, output_final_state,
                route, "retention")


@amp_op()
@varlen("q", "k", "v", "g")
def simple_gla(q, k, v, g, *, mode="chunk", chunk_size=64, scale=None, initial_state=None, output_final_state=False,
               route=None):
    """Simple GLA / SSD: S_t = a_t S_{t-1} + k_t v_t^T with ``g = log a`` of shape (B, T, H).
    ``route``: None (automatic) or one of the chunk form's routes (chunk.py), recorded by ``routes.took``."""
    check_qkv(q, k, v)
    scale, initial_state = _prepare(q, k, v, g, q.shape[:3], mode, chunk_size, scale, initial_state,
                                    output_final_state, route, "simple_gla")
    return _run(q, k, v, g, mode, chunk_size, scale, initial_state, output_final_state, route, "simple_gla")


@amp_op()
@varlen("q", "k", "v", "g")
def gla(q, k, v, g, *, mode="chunk", chunk_size=64, scale=None, initial_state=None, output_final_state=False,
        route=None):
    """GLA: S_t = diag(a_t) S_{t-1} + k_t v_t^T with ``g = log a`` of shape (B, T, H, K).
    ``route``: None (automatic) or one of the chunk form's routes (chunk.py), recorded by ``routes.took``."""
    check_qkv(q, k, v)
    scale, initial_state = _prepare(q, k, v, g, q.shape, mode, chunk_size, scale, initial_state, output_final_state,
                                    route, "gla")
    return _run(q, k, v, g, mode, chunk_size, scale, initial_state, output_final_state, route, "gla")


@amp_op(positions=(0, 3, 4))
@varlen("x", "dt", "B", "C")
def ssd(x, dt, A, B, C, *, D=None, mode="chunk", chunk_size=64, initial_state=None, output_final_state=False,
        route=None):
    """Mamba-2's SSD with B and C shared by the heads (of a group):

        h_t = exp(dt_t A_h) h_{t-1} + B_t (dt_t x_t)^T,   y_t = C_t^T h_t + D_h x_t      h (N, P) per head

    x (B, T, H, P); dt (B, T, H) >= 0; A (H,) <= 0; B, C (B, T, N), or (B, T, G, N) for G groups of H / G
    consecutive heads each sharing one B and C (Mamba-2's ``n_groups``); D (H,) or None; state (B, H, N, P).
    It is ``simple_gla(q=C, k=dt B, v=x, g=dt A, scale=1)`` with q and k shared by every head. The chunk
    form runs, without a gradient, ``ssd_inference`` (the products with B and C once for all heads), and
    with one the decayed family's chunk engine on B and C copied to every head (its hand-written backward
    is faster than any autograd of the shared products). ``route``: None (automatic), "token",
    "factorised" or "exact" with mode="chunk"; the route taken is recorded (``routes.took``).
    Returns (y (B, T, H, P), final state or None).
    """
    check_mode(mode)
    check_form_route(route, mode, "ssd")
    check_chunk_size(chunk_size)
    check_bool("output_final_state", output_final_state)
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor (B, T, H, P), got {describe(x)}")
    Bz, T, H, P = x.shape
    if T < 1:
        raise ValueError(f"x must hold at least one token (T >= 1), got shape {tuple(x.shape)}")
    check_like("dt", dt, (Bz, T, H), x, "x")
    check_like("A", A, (H,), x, "x")
    if not isinstance(B, torch.Tensor) or B.dim() not in (3, 4):
        raise ValueError(f"B must have shape (B={Bz}, T={T}, N) or (B, T, G, N), got {describe(B)}")
    N = B.shape[-1]
    G = B.shape[2] if B.dim() == 4 else 0
    if G and H % G:
        raise ValueError(f"B's {G} groups must divide the {H} heads of x")
    check_like("B", B, (Bz, T, G, N) if G else (Bz, T, N), x, "x")
    check_like("C", C, (Bz, T, G, N) if G else (Bz, T, N), x, "x")
    if D is not None:
        check_like("D", D, (H,), x, "x")
    for name, t in (("B", B), ("C", C)):              # activations: x's dtype, as selective_scan asks
        if t.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    for name, t in (("dt", dt), ("A", A), ("D", D)):  # gates may stay float32 beside 16-bit activations
        if t is not None:
            check_gate_dtype(name, t, x, "x")
    if checks_on(dt) and (dt < 0).any():
        raise ValueError("dt must be >= 0 (it is a step size, softplus of a projection in Mamba-2)")
    if checks_on(A) and (A > 0).any():
        raise ValueError(f"A must be <= 0 (the state decays); got max {A.max().item():.3g}")
    sd = state_dtype(x.dtype)
    if initial_state is not None:
        check_state("initial_state", initial_state, (Bz, H, N, P), x, "x")
    xs, dts, As, Bs, Cs = (t.to(sd) for t in (x, dt, A, B, C))
    if G:                                              # each group's heads with its own B and C
        n = H // G
        parts = [_ssd(xs[:, :, g * n:(g + 1) * n], dts[..., g * n:(g + 1) * n], As[g * n:(g + 1) * n], Bs[:, :, g],
                      Cs[:, :, g], mode, chunk_size, None if initial_state is None else
                      initial_state[:, g * n:(g + 1) * n], route) for g in range(G)]
        y, h = torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 1)
    else:
        y, h = _ssd(xs, dts, As, Bs, Cs, mode, chunk_size, initial_state, route)
    if D is not None:
        y = torch.addcmul(y, xs, D.to(sd).view(1, 1, H, 1))
    return y.to(x.dtype), (h if output_final_state else None)


def _ssd(x, dt, A, B, C, mode, chunk_size, initial_state, route):
    """One group: without a gradient the shared-B/C fast path (``ssd_inference``; a short call takes the
    token loop unless a route is forced), else the decayed forms with B and C copied to every head."""
    chunked = route in ("factorised", "exact") or (route is None and x.shape[1] >= SHORT)
    if mode == "chunk" and chunked and inference_path(x, dt, A, B, C, initial_state):
        y, h = ssd_inference(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state, route=route)
        return causal_guard((y, h), h, lambda: _ssd_as_gla(x, dt, A, B, C, "recurrent", chunk_size, initial_state),
                            x.shape[1])
    return _ssd_as_gla(x, dt, A, B, C, mode, chunk_size, initial_state, route)


def ssd_as_gla(x, dt, A, B, C):
    """SSD's inputs as ``simple_gla``'s (q, k, g): q = C, k = dt B repeated over the heads that share them
    (B, C (B, T, N) or (B, T, G, N)), g = dt A. The reference route, and what state passing runs."""
    H = x.shape[2]
    if B.dim() == 4:                                   # G groups of H / G heads
        q, k = (t.repeat_interleave(H // t.shape[2], 2) for t in (C, B))
    else:
        q, k = C.unsqueeze(2).expand(-1, -1, H, -1), B.unsqueeze(2).expand(-1, -1, H, -1)
    return q, k * dt.unsqueeze(-1), dt * A


def _ssd_as_gla(x, dt, A, B, C, mode, chunk_size, initial_state, route=None):
    """SSD through the decayed-attention forms, q and k expanded over the heads."""
    q, k, g = ssd_as_gla(x, dt, A, B, C)
    g = finite_log_decay(g)
    chosen = {"op": "ssd", "route": route} if mode == "chunk" else {}
    o, S = _FORMS[mode](q, k, x, g, scale=1.0, chunk_size=chunk_size, initial_state=initial_state, **chosen)
    if mode != "recurrent":
        o, S = causal_guard((o, S), S, lambda: _FORMS["recurrent"](q, k, x, g, scale=1.0, chunk_size=chunk_size,
                                                                   initial_state=initial_state), x.shape[1])
    return o, S


parallel_retention, recurrent_retention, chunk_retention = three_forms(retention)
parallel_simple_gla, recurrent_simple_gla, chunk_simple_gla = three_forms(simple_gla)
parallel_gla, recurrent_gla, chunk_gla = three_forms(gla)
parallel_ssd, recurrent_ssd, chunk_ssd = three_forms(ssd)

__all__ = ["retention", "simple_gla", "gla", "ssd",
           "parallel_retention", "recurrent_retention", "chunk_retention",
           "parallel_simple_gla", "recurrent_simple_gla", "chunk_simple_gla",
           "parallel_gla", "recurrent_gla", "chunk_gla", "parallel_ssd", "recurrent_ssd", "chunk_ssd"]
