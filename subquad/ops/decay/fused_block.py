"""One decoding token of a whole pre-norm Mamba-2 block without an MLP, in one call (``kernels/mamba2_block.c``).

    x  = h / sqrt(mean(h^2) + eps) * norm_w        h (B, 1, d): the residual stream
    in = x W_in^T + b_in                            in_proj: W_in (2 Dn + 2 G N + H, d)
    y  = ops.decay.fused_step's step of in          (B, Dn) after its gated norm; the new conv state and S
    h' = h + y W_out^T + b_out                      out_proj: W_out (d, Dn)   -> (h' (B, 1, d), conv, S)

The mamba2 checkpoints' layer (mamba2-130m's): as ``ops.mamba.fused_block`` is for Mamba-1, taken by
``models.lm.PreNormBlock`` through ``layers.mamba2.Mamba2.fused_block`` under the same conditions
(``layers.mamba.block_projections``); the block's PyTorch forward is the reference. States read, never written.
"""

from __future__ import annotations

import torch

from subquad.kernels import FLOAT, I64, INT, PTR, Kernel
from subquad.ops.mamba.fused_block import proj_args

KERNEL = Kernel("mamba2_block_step", [I64] * 8 + [INT, PTR, PTR, FLOAT] + [PTR] * 6 + [INT, INT, I64, I64] + [PTR] * 6
                + [FLOAT, FLOAT, PTR, PTR, I64, FLOAT] + [PTR] * 4, "mamba2_block")


def block_step(h, norm_w, eps, w_in, b_in, w_out, b_out, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, S,
               gnorm_w, groups: int, group_size: int, geps: float, dt_limit=(0.0, float("inf"))):
    """(h' (B, 1, d), new conv state, new S (B, H, N, P)) of the module doc's step; h (B, 1, d) float32, B <= 16,
    W_in and W_out float32 row- or column-major or quantised (``ops.mamba.fused_block.proj_args``); the rest
    as ``ops.decay.fused_step.mamba2_step`` takes them (``gnorm_w`` its gated norm's weight or None, ``group_size``
    that norm's groups, the inner width without it)."""
    B, d = h.shape[0], h.shape[-1]
    _, H, N, P = S.shape
    Dn, K = H * P, conv_w.shape[-1]
    C, W = Dn + 2 * groups * N, 2 * Dn + 2 * groups * N + H
    h2 = h.reshape(B, d).contiguous()
    conv_w, conv_state, S = conv_w.reshape(C, K).contiguous(), conv_state.contiguous(), S.contiguous()
    h_out, S_out, conv_out = h2.new_empty(B, d), torch.empty_like(S), conv_state.new_empty(B, K - 1, C)
    scratch = h2.new_empty(B * (d + W + Dn + Dn // group_size + C))
    lo, hi = (float(v) for v in dt_limit)
    (w_in, s_in, in_kind, in_g), (w_out, s_out, out_kind, out_g) = proj_args(w_in), proj_args(w_out)
    KERNEL(B, d, Dn, groups, N, H, P, K, torch.get_num_threads(), h2, norm_w, float(eps), w_in, s_in, b_in, w_out,
           s_out, b_out, in_kind, out_kind, in_g, out_g, conv_state, conv_w, conv_b, dt_bias, A_log,
           Dp, lo, hi, S, gnorm_w, group_size, float(geps), h_out, conv_out, S_out, scratch)
    return h_out.view(B, 1, d), conv_out, S_out
