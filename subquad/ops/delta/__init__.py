"""The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet), in three forms.

    delta_rule:        S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T
    gated_delta_rule:  S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   g_t = log a_t <= 0
                       with g (B, T, H, K), a decay per key channel (Kimi Linear's KDA, fla's ``kda``):
                       S_t = (I - b_t k_t k_t^T) diag(a_t) S_{t-1} + b_t k_t v_t^T
    o_t = scale * S_t^T q_t

Shapes: q, k (B, T, H, K); v, o (B, T, H, V); beta (B, T, H) in [0, 1]; g (B, T, H) or (B, T, H, K);
state (B, H, K, V). Keys are expected L2-normalised by the layer: the op does not
normalise them (see README.md here for why, and for the WY derivation of the chunk form).

The chunk form has two routes: ``route="chunk"``, the one chunk engine (``chunk.py``, with and without a
gradient), and ``route="token"``, the token loop of ``recurrent.py``. ``route=None`` takes the token
loop for calls of fewer than ``routes.SHORT`` tokens without a gradient (a decoding step) and the
engine otherwise; the route taken is recorded (``subquad.ops.common.routes.routes_taken``).

``allow_neg_eigval=True`` admits beta in [0, 2] (OLMo-Hybrid's ``linear_allow_neg_eigval``; Grazzi et al.
2024, "Unlocking state-tracking in linear RNNs through negative eigenvalues"): with |k| = 1 the
transition I - b k k^T has the eigenvalue 1 - b along k, in [-1, 1] - a reflection at b = 2 - so the
state stays bounded while the RNN gains state tracking (parity) that eigenvalues in [0, 1] cannot give.
Every form computes the same algebra for any beta (the chunk form's triangular system is unit lower
triangular whatever beta is); the option only widens the check. Outside the allowed range the op refuses.

Example:
    >>> import torch, torch.nn.functional as F
    >>> from subquad.ops import delta_rule
    >>> q, k = (F.normalize(torch.randn(1, 50, 2, 16), dim=-1) for _ in range(2))
    >>> v, beta = torch.randn(1, 50, 2, 8), torch.rand(1, 50, 2)
    >>> o, S = delta_rule(q, k, v, beta, output_final_state=True)
    >>> o.shape, S.shape
    (torch.Size([1, 50, 2, 8]), torch.Size([1, 2, 16, 8]))
"""

from __future__ import annotations

from subquad.ops.common.checks import check_bool, check_gate_dtype, check_like, check_state, default_scale, state_dtype
from subquad.ops.common.autograd import wants_grad
from subquad.ops.common.forms import three_forms
from subquad.ops.common.precision import amp_op, causal_guard, checks_on, finite_log_decay
from subquad.ops.common.routes import SHORT, took
from subquad.ops.delta.chunk import chunk_delta
from subquad.ops.delta.inputs import check_call
from subquad.ops.delta.parallel import parallel_delta
from subquad.ops.delta.recurrent import recurrent_delta
from subquad.ops.common.varlen import varlen

_FORMS = {"parallel": parallel_delta, "recurrent": recurrent_delta, "chunk": chunk_delta}


def _run(op, q, k, v, g, beta, mode, chunk_size, scale, initial_state, output_final_state, allow_neg_eigval,
         route):
    check_call(op, q, k, v, mode, chunk_size, output_final_state, route)
    check_bool("allow_neg_eigval", allow_neg_eigval)
    check_like("beta", beta, q.shape[:3], q)
    check_gate_dtype("beta", beta, q)
    top = 2 if allow_neg_eigval else 1
    if checks_on(beta) and ((beta < 0).any() or (beta > top).any()):
        hint = "" if allow_neg_eigval else " (allow_neg_eigval=True admits [0, 2])"
        raise ValueError(f"beta is the write strength and must lie in [0, {top}]{hint}; got "
                         f"[{beta.min().item():.3g}, {beta.max().item():.3g}]")
    if g is not None:
        check_like("g", g, q.shape if getattr(g, "dim", lambda: 0)() == 4 else q.shape[:3], q)
        check_gate_dtype("g", g, q)
        if checks_on(g) and (g > 0).any():
            raise ValueError(f"g is a log-decay and must be <= 0 everywhere; got max {g.max().item():.3g}")
    B, _, H, K = q.shape
    sd = state_dtype(q.dtype)
    if initial_state is not None:
        check_state("initial_state", initial_state, (B, H, K, v.shape[-1]), q)
    beta, g = beta.to(sd), None if g is None else finite_log_decay(g.to(sd))

    scale = default_scale(scale, K)

    def run(form):
        return _FORMS[form](q, k, v, g, beta, scale=scale, chunk_size=chunk_size,
                            initial_state=initial_state)

    if mode == "chunk":
        if route is None:                              # a decoding step without a gradient: the token loop
            short = q.shape[1] < SHORT and not wants_grad(q, k, v, g, beta, initial_state)
            route = "token" if short else "chunk"
        took(op, route)
        o, S = run("recurrent" if route == "token" else "chunk")
    else:
        o, S = run(mode)
    if mode != "recurrent":                            # non-finite input stays causal
        o, S = causal_guard((o, S), S, lambda: run("recurrent"), q.shape[1])
    return o.to(q.dtype), (S if output_final_state else None)


@amp_op()
@varlen("q", "k", "v", "beta")
def delta_rule(q, k, v, beta, *, mode="chunk", chunk_size=64, scale=None, initial_state=None,
               output_final_state=False, allow_neg_eigval=False, route=None):
    """DeltaNet: S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T; ``beta`` (B, T, H) in [0, 1] ([0, 2] with
    ``allow_neg_eigval``). ``route``: None, "chunk" or "token" (mode="chunk" only; module docstring)."""
    return _run("delta_rule", q, k, v, None, beta, mode, chunk_size, scale, initial_state, output_final_state,
                allow_neg_eigval, route)


@amp_op()
@varlen("q", "k", "v", "g", "beta")
def gated_delta_rule(q, k, v, g, beta, *, mode="chunk", chunk_size=64, scale=None, initial_state=None,
                     output_final_state=False, allow_neg_eigval=False, route=None):
    """Gated DeltaNet: S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T; ``g = log a`` and ``beta`` (B, T, H),
    beta in [0, 1] ([0, 2] with ``allow_neg_eigval``). ``g`` (B, T, H, K): KDA's per-channel decay,
    S_t = (I - b_t k_t k_t^T) diag(a_t) S_{t-1} + b_t k_t v_t^T. ``route``: None, "chunk" or "token" (mode="chunk"
    only; module docstring)."""
    if g is None:
        raise ValueError("g must be a log-decay tensor (B, T, H) for the gated rule (use delta_rule without a gate)")
    return _run("gated_delta_rule", q, k, v, g, beta, mode, chunk_size, scale, initial_state, output_final_state,
                allow_neg_eigval, route)


parallel_delta_rule, recurrent_delta_rule, chunk_delta_rule = three_forms(delta_rule)
parallel_gated_delta_rule, recurrent_gated_delta_rule, chunk_gated_delta_rule = three_forms(gated_delta_rule)

from subquad.ops.delta.generalized import (chunk_generalized_delta_rule, generalized_delta_rule,  # noqa: E402
                                           parallel_generalized_delta_rule, recurrent_generalized_delta_rule)

__all__ = ["generalized_delta_rule", "parallel_generalized_delta_rule", "recurrent_generalized_delta_rule",
           "chunk_generalized_delta_rule", "delta_rule", "gated_delta_rule", "parallel_delta_rule", "recurrent_delta_rule", "chunk_delta_rule",
           "parallel_gated_delta_rule", "recurrent_gated_delta_rule", "chunk_gated_delta_rule"]
