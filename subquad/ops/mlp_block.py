"""One decoding token of a pre-norm block's MLP half, in one call (``kernels/mlp_block.c``).

    x  = h / sqrt(mean(h^2) + eps) * norm_w        h (B, 1, d): the residual stream after the mixer's half
    a  = silu(x W_g^T + b_g) * (x W_u^T + b_u)      SwiGLU (``SWIGLU``): W_g, W_u (F, d)
    a  = relu(x W_u^T + b_u)^2                      ungated ReLU^2 (``RELU2``: Nemotron-H's; no W_g)
    h' = h + a W_d^T + b_d                          W_d (d, F)   -> h' (B, 1, d)

The hybrids' MLP (Bamba's, Nemotron-H's, Jamba's attention layers', every SwiGLU after a pre-norm mixer): a
decoding token's norm, three products, gate and residual cost one call instead of eight ops and four module
calls (~150 us of Python and dispatch a layer on the Sapphire Rapids host; benchmarks/RESULTS.md).
``layers.mlp_step`` takes it for ``models.lm.PreNormBlock`` and keeps the call between tokens; ``models.stack``
puts it after a Mamba-2 block's mixer half in one C call (``kernels/mamba2_block.c``). The block's PyTorch forward
(``norm2``, then ``SwiGLU.forward`` / ``ReLU2MLP.forward``) is the reference. Each W float32 row- or column-major
or quantised as ``kernels.qgemv.proj_args`` takes it; h is read, never written.
"""

from __future__ import annotations

import torch

from subquad.kernels import FLOAT, I64, INT, PTR, Call, Kernel
from subquad.kernels.qgemv import proj_args

_PROJ = [PTR, PTR, PTR, INT, I64]          # weight, scale, bias, kind, groups
KERNEL = Kernel("mlp_block_rows", [I64, I64, I64, INT, INT, PTR, PTR, FLOAT] + _PROJ * 3 + [PTR, PTR], "mlp_block")
ARGS = 25                                   # the kernel's arguments: a stack's row for one MLP (mamba2_block.c)
FLOATS = (7,)                               # eps
SWIGLU, RELU2 = 0, 1                        # the activation (``act``)


class MlpStep:
    """The module doc's step for ``B`` rows with the weights fixed: ``MlpStep(B, norm_w, eps, F, (w_g, b_g),
    (w_u, b_u), (w_d, b_d), act)`` (F the hidden width; ``RELU2``: gate (None, None)) converts them once
    (``kernels.Call``), then ``step(h (B, 1, d))`` -> h' (B, 1, d). ``tensors``: what it was built from
    (``kernels.Held`` finds them in the modules); ``floats``: those that must be float32."""

    name = "MLP"

    def __init__(self, B, norm_w, eps, F: int, gate, up, down, act: int = SWIGLU):
        d = norm_w.shape[0]
        projs = [(None, None, 0, 0, None) if w is None else proj_args(w) + (b,)   # (w, scale, kind, groups, bias)
                 for w, b in (gate, up, down)]
        self.B, self.d, self.F = B, d, F
        self.tensors = [norm_w] + [t for p in projs for t in (p[0], p[1], p[4]) if t is not None]
        # what must be float32 (``kernels.usable``): a quantised weight's own are checked where it is read
        self.floats = [norm_w] + [t for w, b in (gate, up, down) for t in (w, b) if not isinstance(t, tuple)]
        args = [B, d, F, act, None, None, norm_w, float(eps)]
        for w, s, kind, groups, b in projs:
            args += [w, s, b, kind, groups]
        self.scratch = B * (d + 2 * F)
        self.call = Call(KERNEL, args + [None, None], (4, 5, 23, 24))

    def __call__(self, h):
        B, d = self.B, self.d
        if h.shape[0] != B or h.shape[-1] != d or h.numel() != B * d:
            raise ValueError(f"the {self.name} step holds {B} rows of width {d}; got h {tuple(h.shape)}")
        h2 = h.reshape(B, d).contiguous()
        h_out = h2.new_empty(B, d)
        self.call(torch.get_num_threads(), h2, h_out, h2.new_empty(self.scratch))
        return h_out.view(B, 1, d)


def mlp_block(h, norm_w, eps, gate, up, down, act: int = SWIGLU):
    """``MlpStep``'s step once: h (B, 1, d) -> h'; gate, up and down (weight, bias) with float32 weights."""
    return MlpStep(h.shape[0], norm_w, eps, up[0].shape[0], gate, up, down, act)(h)
