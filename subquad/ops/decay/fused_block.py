"""One decoding token of a whole pre-norm Mamba-2 block without an MLP, in one call (``kernels/mamba2_block.c``).

    x  = h / sqrt(mean(h^2) + eps) * norm_w        h (B, 1, d): the residual stream
    in = x W_in^T + b_in                            in_proj: W_in (2 Dn + 2 G N + H, d)
    y  = ops.decay.fused_step's step of in          (B, Dn) after its gated norm; the new conv state and S
    h' = h + y W_out^T + b_out                      out_proj: W_out (d, Dn)   -> (h' (B, 1, d), conv, S)

The mamba2 checkpoints' layer (mamba2-130m's): as ``ops.mamba.fused_block`` is for Mamba-1, taken by
``models.lm.PreNormBlock`` through ``layers.mamba2.Mamba2.fused_block`` under the same conditions
(``layers.mamba.block_projections``); the block's PyTorch forward is the reference. States read, never written.
``TokensStep``: T consecutive tokens of each row under ``layers.rollback.PER_TOKEN`` (a speculative
verification), as ``ops.mamba.fused_block.TokensStep`` does for Mamba-1: h (B, T, d) -> (h', the conv state
(B, T, K-1, C) and S (B, T, H, N, P) after every token), ``mamba2_block_tokens``.
"""

from __future__ import annotations

from subquad.kernels import FLOAT, I64, INT, PTR, Call, Kernel
from subquad.kernels.qgemv import proj_args
from subquad.ops.mamba.fused_block import KeptStep, TokensStep as _Tokens

# One C function for both: a decoding step is T = 1 token of B rows
KERNEL = TOKENS = Kernel("mamba2_block_tokens", [I64] * 9 + [INT, PTR, PTR, FLOAT] + [PTR] * 6 + [INT, INT, I64, I64]
                         + [PTR] * 6 + [FLOAT, FLOAT, PTR, PTR, I64, FLOAT] + [PTR] * 4, "mamba2_block")

STACK = Kernel("mamba2_block_stack", [I64, PTR, INT, PTR, PTR, PTR], "mamba2_block")   # ``StackStep``'s
STACK_FLOATS = (12, 29, 30, 34)                 # eps, dt's limits, the gated norm's eps


class BlockStep(KeptStep):
    """The module doc's step for ``B`` rows with the layer's weights fixed (as ``ops.mamba.fused_block.BlockStep``):
    built once from the weights, the sizes (``d_inner``, ``d_state``, ``groups`` of B and C) and the gated norm's
    weight (or None), ``group_size`` and eps; then ``step(h, conv_state, S)`` -> (h' (B, 1, d), new conv state,
    new S (B, H, N, P)) per token. W_in and W_out float32 row- or column-major or quantised
    (``kernels.qgemv.proj_args``); the rest as ``ops.decay.fused_step.mamba2_step`` takes them."""

    name = "Mamba-2 block"

    def __init__(self, B, norm_w, eps, w_in, b_in, w_out, b_out, conv_w, conv_b, dt_bias, A_log, Dp, gnorm_w,
                 d_inner: int, d_state: int, groups: int, group_size: int, geps: float,
                 dt_limit=(0.0, float("inf")), T=0):
        d, H, N, Dn, K = norm_w.shape[0], A_log.shape[0], d_state, d_inner, conv_w.shape[-1]
        P, C = Dn // H, Dn + 2 * groups * d_state
        W = 2 * Dn + 2 * groups * N + H
        (w_in, s_in, in_kind, in_g), (w_out, s_out, out_kind, out_g) = proj_args(w_in), proj_args(w_out)
        self.tensors = [norm_w, w_in, s_in, b_in, w_out, s_out, b_out, conv_w, conv_b, dt_bias, A_log, Dp, gnorm_w]
        conv_w = conv_w.reshape(C, K).contiguous()
        lo, hi = (float(v) for v in dt_limit)
        self.B, self.d, self.conv_shape, self.state_shape = B, d, (B, K - 1, C), (B, H, N, P)
        self.scratch = max(T, 1) * B * (d + W + Dn + Dn // group_size + C)     # per row and token
        self.call = Call(KERNEL, [max(T, 1), B, d, Dn, groups, N, H, P, K, None, None, norm_w, float(eps), w_in, s_in,
                                  b_in, w_out, s_out, b_out, in_kind, out_kind, in_g, out_g, None, conv_w, conv_b,
                                  dt_bias, A_log, Dp, lo, hi, None, gnorm_w, group_size, float(geps), None, None, None,
                                  None],
                         (9, 10, 23, 31, 35, 36, 37, 38))


class TokensStep(BlockStep):
    """The module doc's ``TokensStep`` for ``T`` tokens of ``B`` rows (T B <= 16): built as ``BlockStep`` (with
    ``T``), called as ``ops.mamba.fused_block.TokensStep`` - h (B, T, d), the states before -> (h', each token's
    conv state, each token's S), views of t-major buffers."""

    name = "Mamba-2 block (tokens)"
    __call__ = _Tokens.__call__

    def __init__(self, T, B, *weights, **options):
        super().__init__(B, *weights, **options, T=T)
        self.T = T


def block_step(h, norm_w, eps, w_in, b_in, w_out, b_out, conv_state, conv_w, conv_b, dt_bias, A_log, Dp, S,
               gnorm_w, groups: int, group_size: int, geps: float, dt_limit=(0.0, float("inf"))):
    """``BlockStep``'s step once: (h', new conv state, new S); the sizes from S (B, H, N, P)."""
    _, H, N, P = S.shape
    return BlockStep(h.shape[0], norm_w, eps, w_in, b_in, w_out, b_out, conv_w, conv_b, dt_bias, A_log, Dp, gnorm_w,
                     H * P, N, groups, group_size, geps, dt_limit)(h, conv_state, S)
