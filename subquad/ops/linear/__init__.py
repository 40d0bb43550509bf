"""Linear attention (Katharopoulos et al., 2020), in three forms.

    S_t = S_{t-1} + k_t v_t^T,   z_t = z_{t-1} + k_t
    o_t = scale * S_t^T q_t  /  (scale * z_t . q_t + eps)     (the division only when normalize=True)

q and k arrive already feature-mapped (``subquad.ops.feature_maps``): the layer,
not the op, applies phi. Shapes: q, k (B, T, H, K); v, o (B, T, H, V); state
S (B, H, K, V), or the pair (S, z (B, H, K)) when normalised.

Example:
    >>> import torch
    >>> from subquad.ops import linear_attention, feature_map
    >>> phi = feature_map("elu+1")
    >>> q, k, v = torch.randn(2, 100, 4, 32), torch.randn(2, 100, 4, 32), torch.randn(2, 100, 4, 16)
    >>> o, (S, z) = linear_attention(phi(q), phi(k), v, mode="chunk", output_final_state=True)
    >>> o.shape, S.shape, z.shape
    (torch.Size([2, 100, 4, 16]), torch.Size([2, 4, 32, 16]), torch.Size([2, 4, 32]))
"""

from __future__ import annotations

import torch

from subquad.ops.common.checks import check_bool, check_chunk_size, check_mode
from subquad.ops.common.precision import causal_guard, checks_on
from subquad.ops.common.routes import check_route
from subquad.ops.linear.chunk import chunk_linear_attention
from subquad.ops.linear.prepare import ROUTES, prepare_form
from subquad.ops.linear.parallel import parallel_linear_attention
from subquad.ops.linear.recurrent import linear_attention_step, recurrent_linear_attention
from subquad.ops.common.varlen import varlen


_FORMS = {
    "parallel": parallel_linear_attention,
    "recurrent": recurrent_linear_attention,
    "chunk": chunk_linear_attention,
}


@varlen("q", "k", "v")
def linear_attention(q, k, v, *, normalize=True, eps=1e-6, mode="chunk", chunk_size=64, scale=None,
                     initial_state=None, output_final_state=False, route=None):
    """Causal linear attention.

    Args:
        q, k: (B, T, H, K) feature-mapped queries and keys.
        v: (B, T, H, V) values.
        normalize: divide by scale * q_t . z_t + eps (the seeds' phi(q)S / phi(q)z).
        eps: added to the normaliser: a finite number >= 0.
        mode: "parallel" (T x T), "recurrent" (token loop) or "chunk" (chunkwise, fastest).
        chunk_size: C for mode="chunk" (ignored by the other forms, but still checked); past T, one chunk.
        scale: multiplies q; None means K ** -0.5.
        initial_state: S (B, H, K, V), or (S, z) when normalize=True, in the state's dtype (float32, or
            float64 for float64 inputs).
        output_final_state: also return the state after the last token.
        route: None (automatic), or with mode="chunk" "chunk" (the chunk engine) or "token" (the token
            loop, which calls of fewer than ``routes.SHORT`` tokens without a gradient take); the route
            taken is recorded (``subquad.ops.common.routes.routes_taken``).
    Returns:
        (o (B, T, H, V), final_state or None).
    """
    check_mode(mode)
    check_chunk_size(chunk_size)                       # checked whatever the form, as documented
    check_bool("normalize", normalize)
    check_bool("output_final_state", output_final_state)   # the forms are asked for the state whatever it says
    check_route(route, ROUTES, "linear_attention")

    def run(form, final):
        return _FORMS[form](q, k, v, normalize=normalize, eps=eps, scale=scale, chunk_size=chunk_size,
                            initial_state=initial_state, output_final_state=final,
                            route=route if form == mode else None)

    if mode == "recurrent" or not isinstance(q, torch.Tensor) or q.dim() < 2 or q.shape[1] < 2 or not checks_on(q):
        return run(mode, output_final_state)          # (the forms' own amp_op handles autocast)
    o, S = run(mode, True)                             # non-finite input stays causal: the state tells
    o, S = causal_guard((o, S), S if not normalize else S[0], lambda: run("recurrent", True), q.shape[1])
    return o, (S if output_final_state else None)


__all__ = ["linear_attention", "linear_attention_step", "parallel_linear_attention", "recurrent_linear_attention", "chunk_linear_attention"]
