"""The generalised delta rule (RWKV-7's transition; fla's ``dplr_delta_rule``): diagonal plus rank one.

    S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T
    o_t = scale * S_t^T q_t

Shapes: q, k, w, a, b (B, T, H, K); v, o (B, T, H, V); state (B, H, K, V). ``w`` is the log-decay per key
channel (<= 0); ``a`` and ``b`` are free: RWKV-7 passes a = -kk and b = kk * lr (kk the L2-normalised
key, lr in [0, 1] the in-context learning rate), which makes the transition diag(w) - lr kk kk^T, the
delta rule's I - beta k k^T with a decay per channel. The delta rule is the case w = 0, a = -k,
b = beta k, with v scaled by beta (``tests/ops/test_generalized_delta.py`` checks it).

Forms: ``recurrent_dplr`` (``recurrent.py``, the token loop and the spec), ``chunk_dplr`` (``chunk.py``: the
delta family's one chunk engine with this rule's factors; the derivation is README.md's "The generalised
delta rule") and ``parallel_dplr`` (``parallel.py``: one chunk spanning the sequence, a reference for short
T). ``route`` picks the chunk form's route as for ``delta_rule``: the token loop for short calls without a
gradient, the engine otherwise.

RWKV writes the state as (V, K) with S_t = S_{t-1} (diag(w_t) + a_t b_t^T) + v_t k_t^T: the transpose of
the line above. a_t^T S_{t-1} reads the state before it decays.
"""

from __future__ import annotations

from subquad.ops.common.autograd import wants_grad
from subquad.ops.common.checks import check_gate_dtype, check_like, check_state, default_scale, state_dtype
from subquad.ops.common.forms import three_forms
from subquad.ops.common.precision import amp_op, causal_guard, checks_on, finite_log_decay
from subquad.ops.common.routes import SHORT, took
from subquad.ops.common.varlen import varlen
from subquad.ops.delta.chunk import chunk_dplr
from subquad.ops.delta.inputs import check_call
from subquad.ops.delta.parallel import parallel_dplr
from subquad.ops.delta.recurrent import recurrent_dplr

_FORMS = {"parallel": parallel_dplr, "recurrent": recurrent_dplr, "chunk": chunk_dplr}


@amp_op(positions=(0, 1, 2, 4, 5))             # a and b are activations like k; w is a gate and keeps its dtype
@varlen("q", "k", "v", "w", "a", "b")
def generalized_delta_rule(q, k, v, w, a, b, *, mode="chunk", chunk_size=64, scale=None, initial_state=None,
                           output_final_state=False, route=None):
    """S_t = (diag(exp(w_t)) + b_t a_t^T) S_{t-1} + k_t v_t^T, o_t = scale * S_t^T q_t (module docstring).
    ``w`` (B, T, H, K) the log-decay <= 0; ``a``, ``b`` (B, T, H, K). ``route``: None, "chunk" or "token"
    (mode="chunk" only), as for ``delta_rule``.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from subquad.ops import generalized_delta_rule
        >>> q, k, kk = (F.normalize(torch.randn(1, 50, 2, 16), dim=-1) for _ in range(3))
        >>> v, w, lr = torch.randn(1, 50, 2, 16), -0.6 * torch.rand(1, 50, 2, 16), torch.rand(1, 50, 2, 1)
        >>> o, S = generalized_delta_rule(q, k, v, w, -kk, lr * kk, output_final_state=True)
        >>> o.shape, S.shape
        (torch.Size([1, 50, 2, 16]), torch.Size([1, 2, 16, 16]))
    """
    check_call("generalized_delta_rule", q, k, v, mode, chunk_size, output_final_state, route)
    check_like("w", w, q.shape, q)
    check_gate_dtype("w", w, q)
    for name, x in (("a", a), ("b", b)):
        check_like(name, x, q.shape, q)
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype} (it is read like a key), got {x.dtype}")
    if checks_on(w) and (w > 0).any():
        raise ValueError(f"w is a log-decay and must be <= 0 everywhere; got max {w.max().item():.3g}")
    B, _, H, K = q.shape
    sd = state_dtype(q.dtype)
    if initial_state is not None:
        check_state("initial_state", initial_state, (B, H, K, v.shape[-1]), q)
    w = finite_log_decay(w.to(sd))
    scale = default_scale(scale, K)

    def run(form):
        return _FORMS[form](q, k, v, w, a, b, scale=scale, chunk_size=chunk_size, initial_state=initial_state)

    if mode == "chunk":
        if route is None:
            short = q.shape[1] < SHORT and not wants_grad(q, k, v, w, a, b, initial_state)
            route = "token" if short else "chunk"
        took("generalized_delta_rule", route)
        o, S = run("recurrent" if route == "token" else "chunk")
    else:
        o, S = run(mode)
    if mode != "recurrent":
        o, S = causal_guard((o, S), S, lambda: run("recurrent"), q.shape[1])
    return o.to(q.dtype), (S if output_final_state else None)


parallel_generalized_delta_rule, recurrent_generalized_delta_rule, chunk_generalized_delta_rule = \
    three_forms(generalized_delta_rule)
