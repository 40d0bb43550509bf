"""A pre-norm block's MLP half at a decoding token in one C call (``ops.mlp_block``), kept between tokens.

``fused_mlp(mlp, h, norm)`` -> h + mlp(norm(h)) for h (B, 1, d), or None where the call does not apply: while
compiling (inductor fuses the block itself), an MLP other than SwiGLU with silu or the ungated ReLU^2, hooks on
the MLP, a norm other
than a plain RMSNorm with a weight, more than ``layers.linear.C_ROWS`` rows, a projection the kernels do not read
(``layers.mamba.kernel_weight``), or what ``kernels.usable`` refuses (float32 on the CPU, no gradient, no
autocast). The ``MlpStep`` is kept per MLP and rows outside the module (a weak mapping: copies and pickles of a
model carry none) with a ``kernels.Held`` of what it read, and rebuilt when a weight or module changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from subquad import kernels
from subquad.layers.linear import C_ROWS
from subquad.layers.mamba import kernel_weight
from subquad.layers.mlp import ReLU2MLP, SwiGLU
from subquad.layers.norm import RMSNorm
from subquad.ops import mlp_block

_PLANS = kernels.KeptCalls()                                        # mlp -> {rows: MlpStep}


def fits(mlp, norm) -> bool:
    """Whether ``mlp`` after ``norm`` is what the kernel computes (the rows, weights and tensors aside)."""
    return ((type(mlp) is SwiGLU and mlp.act is F.silu) or type(mlp) is ReLU2MLP) and type(norm) is RMSNorm \
        and norm.weight is not None and norm.bias is None and not (mlp._forward_hooks or mlp._forward_pre_hooks)


def build(mlp, norm, rows: int):
    """``mlp``'s ``MlpStep`` at ``rows`` rows after ``norm``, or None where a projection is not one the kernel
    reads."""
    lins = (mlp.w_up, mlp.w_down) if type(mlp) is ReLU2MLP else (mlp.w_gate, mlp.w_up, mlp.w_down)
    projs = [kernel_weight(lin, rows) for lin in lins]
    if any(p is None for p in projs):
        return None
    pairs = [(p, lin.bias) for p, lin in zip(projs, lins)]
    if type(mlp) is ReLU2MLP:
        return mlp_block.MlpStep(rows, norm.weight, norm.eps, mlp.w_down.in_features, (None, None), *pairs,
                                 act=mlp_block.RELU2)
    return mlp_block.MlpStep(rows, norm.weight, norm.eps, mlp.w_down.in_features, *pairs)


def kept(mlp, norm, h):
    """(``kernels.Held``, ``MlpStep``) for ``mlp`` after ``norm`` at h's rows (B, 1, d), valid now, built where
    none is kept; None where the call does not apply (``models.stack`` puts it after a Mamba-2 block's mixer
    half). A kept call checks only h at later tokens (``kernels.usable``), as ``layers.mamba.planned_block``."""
    rows = h.shape[0]
    if torch.compiler.is_compiling() or rows > C_ROWS or not fits(mlp, norm):
        return None

    def make():
        step = build(mlp, norm, rows)
        return step if step is not None and kernels.usable(mlp_block.KERNEL, h, *step.floats) else None
    got = _PLANS.get(mlp, norm, rows, make)
    if got is None or not got[0].ok or (got[2] and not kernels.usable(mlp_block.KERNEL, h)):
        return None
    return got[:2]


def fused_mlp(mlp, h, norm):
    """The module doc's call: h (B, 1, d) -> h + mlp(norm(h)), or None."""
    if torch.compiler.is_compiling() or h.dim() != 3 or h.shape[1] != 1:
        return None
    plan = kept(mlp, norm, h)
    return None if plan is None else plan[1](h)
