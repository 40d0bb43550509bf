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

from subquad.ops.common.checks import check_chunk_size, check_like, check_mode, check_qkv, default_scale, state_dtype
from subquad.ops.common.precision import amp_op, causal_guard, checks_on, finite_log_decay
from subquad.ops.gla.chunk import chunk_decay_attention
from subquad.ops.gla.parallel import parallel_decay_attention
from subquad.ops.gla.recurrent import recurrent_decay_attention

_FORMS = {"parallel": parallel_decay_attention, "recurrent": recurrent_decay_attention, "chunk": chunk_decay_attention}


def _prepare(q, k, v, g, g_shape, mode, chunk_size, scale, initial_state):
    check_mode(mode)                                   # q, k, v were checked by the caller
    if q.shape[1] < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {tuple(q.shape)}")
    check_chunk_size(chunk_size)
    check_like("g", g, g_shape, q)
    if g.dtype != q.dtype and g.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"g must be float32, float64 or q's dtype, got {g.dtype}")
    if checks_on(g) and (g > 0).any():
        raise ValueError(f"g is a log-decay and must be <= 0 everywhere; got max {g.max().item():.3g}")
    B, _, H, K = q.shape
    if initial_state is not None:
        check_like("initial_state", initial_state, (B, H, K, v.shape[-1]), q)
        initial_state = initial_state.to(state_dtype(q.dtype))
    return default_scale(scale, K), initial_state


def _run(q, k, v, g, mode, chunk_size, scale, initial_state, output_final_state):
    g = finite_log_decay(g.to(state_dtype(q.dtype)))           # a decay of exactly 0: the same in every form

    def run(form):
        return _FORMS[form](q, k, v, g, scale=scale, chunk_size=chunk_size, initial_state=initial_state)

    o, S = run(mode)
    if mode != "recurrent":
        o, S = causal_guard((o, S), S, lambda: run("recurrent"), q.shape[1])
    return o.to(q.dtype), (S if output_final_state else None)


@amp_op()
def retention(q, k, v, g, *, mode="chunk", chunk_size=64, scale=None, initial_state=None, output_final_state=False):
    """Retention (RetNet): S_t = a S_{t-1} + k_t v_t^T with a fixed log-decay ``g = log a`` of shape (H,)."""
    check_qkv(q, k, v)
    B, T, H, _ = q.shape
    scale, initial_state = _prepare(q, k, v, g, (H,), mode, chunk_size, scale, initial_state)
    return _run(q, k, v, g.view(1, 1, H).expand(B, T, H), mode, chunk_size, scale, initial_state, output_final_state)


@amp_op()
def simple_gla(q, k, v, g, *, mode="chunk", chunk_size=64, scale=None, initial_state=None, output_final_state=False):
    """Simple GLA / SSD: S_t = a_t S_{t-1} + k_t v_t^T with ``g = log a`` of shape (B, T, H)."""
    check_qkv(q, k, v)
    scale, initial_state = _prepare(q, k, v, g, q.shape[:3], mode, chunk_size, scale, initial_state)
    return _run(q, k, v, g, mode, chunk_size, scale, initial_state, output_final_state)


@amp_op()
def gla(q, k, v, g, *, mode="chunk", chunk_size=64, scale=None, initial_state=None, output_final_state=False):
    """GLA: S_t = diag(a_t) S_{t-1} + k_t v_t^T with ``g = log a`` of shape (B, T, H, K)."""
    check_qkv(q, k, v)
    scale, initial_state = _prepare(q, k, v, g, q.shape, mode, chunk_size, scale, initial_state)
    return _run(q, k, v, g, mode, chunk_size, scale, initial_state, output_final_state)


__all__ = ["retention", "simple_gla", "gla"]
