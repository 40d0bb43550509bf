"""Mamba's selective scan (S6, Gu & Dao 2023, arXiv:2312.00752), in three forms.

    h_t = exp(dt_t A) * h_{t-1} + dt_t B_t x_t        per channel d: h (N,), A[d] (N,), dt_t[d], x_t[d] scalars
    y_t = C_t . h_t + D x_t                             (times silu(z_t) when z is given)

Shapes: x, dt, z (B, T, Dm); A (Dm, N) negative; B, C (B, T, N); D (Dm,);
state (B, Dm, N). ``delta_bias`` (Dm,) and ``delta_softplus`` (mamba_ssm's names) make the step
dt_t = softplus(dt_t + delta_bias): Mamba's dt projection's output goes in as it is, and the C loop below
computes the softplus as it reads dt, instead of a pass over (B, T, Dm) before.

A float32 prefill on the CPU without gradients (mode "chunk") runs the recurrent form's token loop as one C call
instead (packed prompts too, read in place; ``fused_scan``: its reference is the recurrent form), which also gives a
verification the state after every token (``selective_scan.per_token``, for ``layers.rollback.PerToken``).
Unlike the reference CUDA kernel, every form takes an ``initial_state`` and can return the final one, so
prefill and decoding compose.

Example:
    >>> import torch
    >>> from subquad.ops import selective_scan
    >>> x, dt = torch.randn(1, 100, 8), torch.rand(1, 100, 8) * 0.1
    >>> A, Bm, Cm = -torch.rand(8, 4) - 0.5, torch.randn(1, 100, 4), torch.randn(1, 100, 4)
    >>> y, h = selective_scan(x, dt, A, Bm, Cm, output_final_state=True)
    >>> y.shape, h.shape
    (torch.Size([1, 100, 8]), torch.Size([1, 8, 4]))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from subquad.ops.common.autograd import wants_grad
from subquad.ops.common.checks import (check_bool, check_chunk_size, check_gate_dtype, check_like, check_mode,
                                      check_state, describe, state_dtype)
from subquad.ops.common.forms import three_forms
from subquad.ops.common.precision import amp_op, causal_guard, checks_on
from subquad.ops.mamba import fused_scan
from subquad.ops.mamba.chunk import chunk_scan
from subquad.ops.mamba.parallel import parallel_scan
from subquad.ops.mamba.recurrent import recurrent_scan

from subquad.ops.common.routes import SHORT_SCAN
from subquad.ops.common.varlen import varlen

_FORMS = {"parallel": parallel_scan, "recurrent": recurrent_scan, "chunk": chunk_scan}


def _in_one_call(a: dict) -> bool:
    """Whether packed prompts go to the C loop in one call (``varlen``'s ``native``): where it runs at all."""
    tensors = [a[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "initial_state", "delta_bias")]
    if a["mode"] != "chunk" or not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
        return False
    if isinstance(a["x"], torch.Tensor) and a["x"].dim() == 3 and isinstance(a["A"], torch.Tensor) \
            and a["A"].dim() == 2:
        return fused_scan.usable(*tensors[:-1], dt_bias=tensors[-1])
    return False


@amp_op(positions=(0, 3, 4), keywords=("z",))
@varlen("x", "dt", "B", "C", "z", native=_in_one_call)
def selective_scan(x, dt, A, B, C, *, D=None, z=None, delta_bias=None, delta_softplus=False, mode="chunk",
                   chunk_size=64, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Selective scan; returns (y (B, T, Dm), final state (B, Dm, N) or None). ``cu_seqlens``: packed prompts
    (``varlen``), taken here only where the C loop runs (``_in_one_call``); states then (S, Dm, N) for S prompts."""
    check_mode(mode)
    check_chunk_size(chunk_size)
    check_bool("output_final_state", output_final_state)
    check_bool("delta_softplus", delta_softplus)
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor (B, T, Dm), got {describe(x)}")
    Bz, T, Dm = x.shape
    rows = Bz if cu_seqlens is None else cu_seqlens.numel() - 1      # states: one a packed prompt
    if T < 1:
        raise ValueError(f"x must hold at least one token (T >= 1), got shape {tuple(x.shape)}")
    check_like("dt", dt, x.shape, x, "x")
    if not isinstance(A, torch.Tensor) or A.dim() != 2 or A.shape[0] != Dm:
        raise ValueError(f"A must have shape (Dm={Dm}, N), got {describe(A)}")
    N = A.shape[1]
    check_like("A", A, (Dm, N), x, "x")
    check_like("B", B, (Bz, T, N), x, "x")
    check_like("C", C, (Bz, T, N), x, "x")
    if D is not None:
        check_like("D", D, (Dm,), x, "x")
    if delta_bias is not None:
        check_like("delta_bias", delta_bias, (Dm,), x, "x")
    if z is not None:
        check_like("z", z, x.shape, x, "x")
    if checks_on(A) and (A > 0).any():
        raise ValueError(f"A must be <= 0 (the state decays); got max {A.max().item():.3g}")
    for name, t in (("B", B), ("C", C), ("z", z)):   # activations: x's dtype
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    for name, t in (("dt", dt), ("A", A), ("D", D), ("delta_bias", delta_bias)):  # gates: float32 may stay
        if t is not None:
            check_gate_dtype(name, t, x, "x")
    if not delta_softplus and checks_on(dt) and ((dt if delta_bias is None else dt + delta_bias) < 0).any():
        raise ValueError("dt must be >= 0 (it is a step size, softplus of a projection in Mamba; or pass "
                         "delta_softplus=True)" + ("" if delta_bias is None else ": here dt + delta_bias"))
    sd = state_dtype(x.dtype)
    if initial_state is not None:
        check_state("initial_state", initial_state, (rows, Dm, N), x, "x")
    if mode == "chunk" and fused_scan.usable(x, dt, A, B, C, D, z, initial_state, delta_bias):
        y, h = fused_scan.scan(x, dt, A, B, C, D, z, initial_state, dt_bias=delta_bias, softplus=delta_softplus,
                               cu_seqlens=cu_seqlens)      # a float32 prefill: the token loop in C
        return y, (h if output_final_state else None)
    if cu_seqlens is not None:
        raise RuntimeError("selective_scan: packed inputs reach the op only where the C loop runs")
    dt = _step_sizes(dt, delta_bias, delta_softplus)
    if mode == "chunk" and T < SHORT_SCAN and not wants_grad(x, dt, A, B, C, initial_state):
        mode = "recurrent"                             # a decoding step or a short prompt: the token loop is faster
    args = (x.to(sd), dt.to(sd), A.to(sd), B.to(sd), C.to(sd))

    def run(form):
        return _FORMS[form](*args, chunk_size=chunk_size, initial_state=initial_state)

    y, h = run(mode)
    if mode != "recurrent":                            # non-finite input stays causal
        y, h = causal_guard((y, h), h, lambda: run("recurrent"), T)
    if D is not None:
        y = y + x.to(sd) * D.to(sd)
    if z is not None:
        y = y * F.silu(z.to(sd))
    return y.to(x.dtype), (h if output_final_state else None)


def _step_sizes(dt, delta_bias, delta_softplus):
    """dt_t as the recurrence reads it: softplus(dt + delta_bias) with ``delta_softplus``, in dt's dtype (a
    float32 bias beside 16-bit dt: float32, as mamba_ssm adds it)."""
    if delta_bias is not None:
        dt = dt + delta_bias
    return F.softplus(dt) if delta_softplus else dt


def _per_token(x, dt, A, B, C, *, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
               cu_seqlens=None, **_):
    """``selective_scan``'s output and the state after every token (Bz, T, Dm, N) in one call where the kernel
    runs (``layers.rollback.PerToken``, a speculative verification), else None: the caller steps token by token."""
    if cu_seqlens is not None or not fused_scan.usable(x, dt, A, B, C, D, z, initial_state, delta_bias):
        return None
    return fused_scan.scan(x, dt, A, B, C, D, z, initial_state, every=True, dt_bias=delta_bias,
                           softplus=delta_softplus)


selective_scan.per_token = _per_token

parallel_selective_scan, recurrent_selective_scan, chunk_selective_scan = three_forms(selective_scan)

__all__ = ["selective_scan", "parallel_selective_scan", "recurrent_selective_scan", "chunk_selective_scan"]
