"""Normalisations used by the mixers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subquad.ops.common.autograd import wants_grad


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim (computed in float32), plus a bias with ``bias`` (xLSTM's use_bias)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y.to(x.dtype)
        y = y * self.weight if self.weight is not None else y
        return y if self.bias is None else y + self.bias


class GatedRMSNorm(RMSNorm):
    """Mamba-2's norm: rmsnorm(y * silu(z)) * weight, optionally in groups."""

    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None):
        super().__init__(dim, eps)
        self.group_size = group_size or dim

    @staticmethod
    def gate(y, z):
        """y * silu(z) (in place on silu's fresh output when no gradient is wanted)."""
        if wants_grad(y, z):
            return y * F.silu(z)
        return F.silu(z).mul_(y)

    def inv_rms(self, g):
        """1 / rms of each group of g (..., dim): (..., dim / group_size)."""
        gg = g.reshape(*g.shape[:-1], -1, self.group_size)
        ms = torch.linalg.vector_norm(gg, dim=-1).square() / self.group_size   # one pass, no squared copy
        return torch.rsqrt(ms + self.eps)

    def forward(self, y, z):
        g = self.gate(y, z)
        shape = g.shape
        gg = g.reshape(*shape[:-1], -1, self.group_size) * self.inv_rms(g).unsqueeze(-1)
        return gg.reshape(shape) * self.weight
