"""The feed-forward layer after each mixer (Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202):

    y = W_down (act(W_gate x) * W_up x)        act = silu (SwiGLU) or tanh-approximated GeLU (GeGLU: Gemma)

The mixture of experts (``models.moe``) routes each token to a few of these and runs a dense one as its
shared expert.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """x (..., d_model) -> (..., d_model) through a hidden width ``hidden``. ``act``: "silu" or "gelu_tanh";
    ``bias``: biases on the three projections (RecurrentGemma's MLP has them; the default has none)."""

    def __init__(self, d_model: int, hidden: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=bias)
        self.w_up = nn.Linear(d_model, hidden, bias=bias)
        self.w_down = nn.Linear(hidden, d_model, bias=bias)
        self.act = F.silu if act == "silu" else functools.partial(F.gelu, approximate="tanh")

    def forward(self, x):
        return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))
