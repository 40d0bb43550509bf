"""One decoding token of a Mamba-2 layer between in_proj and out_proj, in one call (``kernels/mamba2_step.c``).

    z, xBC, dt = split(zxbcdt, [Dn, Dn + 2GN, H])                 zxbcdt (B, 2 Dn + 2 G N + H): in_proj's output
    x, B, C    = split(silu(conv_b + sum_k conv_w[:, k] [conv_state; xBC]_k), [Dn, GN, GN])
    dt         = clamp(softplus(dt + dt_bias), lo, hi)             (B, H)
    S'_h       = exp(-dt_h exp(A_log_h)) S_h + dt_h B_g x_h^T      S (B, H, N, P), head h in group g = h / (H / G)
    y_h        = C_g^T S'_h + Dp_h x_h
    out        = rmsnorm(y * silu(z)) * norm_w per group of ``group_size`` channels (norm_w None: y * silu(z))
    inv        = 1 / rms(y * silu(z)) per group                    (defer: out = y * silu(z) * norm_w, inv apart)

-> (out (B, Dn), inv (B, Dn / group_size), new conv state (B, K-1, Dn + 2GN), S' (B, H, N, P)). ``defer`` is
the layer's order with one norm group (``Mamba2.project_out``: the row scale after out_proj), so that a
quantised out_proj rounds the same input as the PyTorch step's. The layer's own PyTorch step
(``layers.mamba2.Mamba2.mix`` with ``ssd`` and ``project_out``) is the same math and the reference; it runs
wherever ``kernels.usable`` says no. The states passed in are read, never written. Inside a compiled graph it
is the custom op ``subquad::mamba2_step``; eagerly the ctypes call itself.
"""

from __future__ import annotations

import torch

from subquad.kernels import FLOAT, I64, INT, PTR, Kernel

KERNEL = Kernel("mamba2_step", [I64, I64, I64, I64, I64, I64, I64, INT, PTR, I64, PTR, PTR, PTR, PTR, PTR, PTR,
                                FLOAT, FLOAT, PTR, PTR, I64, FLOAT, INT, PTR, PTR, PTR, PTR, PTR])


def _run(zxbcdt, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, h, norm_w, groups: int, group_size: int,
         eps: float, dt_lo: float, dt_hi: float, defer: bool):
    B, H, N, P = h.shape
    Dn = H * P
    K = conv_w.shape[-1]
    C = Dn + 2 * groups * N
    zxbcdt = zxbcdt.reshape(B, -1)
    if zxbcdt.stride(1) != 1:
        zxbcdt = zxbcdt.contiguous()
    conv_w = conv_w.reshape(C, K).contiguous()
    conv_state, h = conv_state.contiguous(), h.contiguous()
    out, h_out, conv_out = zxbcdt.new_empty(B, Dn), torch.empty_like(h), conv_state.new_empty(B, K - 1, C)
    inv, scratch = zxbcdt.new_ones(B, Dn // group_size), zxbcdt.new_empty(B * C)
    KERNEL(B, Dn, groups, N, H, P, K, torch.get_num_threads(), zxbcdt, zxbcdt.stride(0), conv_state, conv_w, conv_b,
           dt_bias, A_log, Dp, dt_lo, dt_hi, h, norm_w, group_size, eps, int(defer), inv, out, conv_out, h_out,
           scratch)
    return out, inv, conv_out, h_out


_LIB = torch.library.Library("subquad", "FRAGMENT")
_LIB.define("mamba2_step(Tensor zxbcdt, Tensor conv_state, Tensor conv_w, Tensor? conv_b, Tensor dt_bias, "
            "Tensor A_log, Tensor Dp, Tensor h, Tensor? norm_w, int groups, int group_size, float eps, float dt_lo, "
            "float dt_hi, bool defer) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.impl("mamba2_step", _run, "CPU")


@torch.library.register_fake("subquad::mamba2_step")
def _(zxbcdt, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, h, norm_w, groups, group_size, eps, dt_lo, dt_hi,
      defer):
    B, H, N, P = h.shape
    return (zxbcdt.new_empty(B, H * P), zxbcdt.new_empty(B, H * P // group_size),
            conv_state.new_empty(conv_state.shape), h.new_empty(h.shape))


def mamba2_step(zxbcdt, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, h, norm_w, groups: int, group_size: int,
                eps: float, dt_limit=(0.0, float("inf")), defer: bool = False):
    """The module doc's step: zxbcdt (B, 1, .) or (B, .), conv_w (C, 1, K) or (C, K), h (B, H, N, P); ``groups``
    G (B and C per group of heads), ``group_size`` the norm's (the inner width without ``norm_w``)."""
    lo, hi = (float(v) for v in dt_limit)
    args = (zxbcdt, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, h, norm_w, groups, group_size, eps, lo, hi,
            bool(defer))
    if torch.compiler.is_compiling():
        return torch.ops.subquad.mamba2_step(*args)
    return _run(*args)
