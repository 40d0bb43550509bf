"""The feed-forward layer after each mixer (Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202):

    y = W_down (silu(W_gate x) * W_up x)

or, ungated, with a squared ReLU (So et al. 2021, "Primer", arXiv:2109.08668; Nemotron-H's MLP layers):

    y = W_down relu(W_up x)^2

The mixture of experts (``models.moe``) routes each token to a few of these and runs a dense one as its
shared expert.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """x (..., d_model) -> (..., d_model) through a hidden width ``hidden``; no biases."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class ReLU2MLP(nn.Module):
    """x (..., d_model) -> (..., d_model) through a hidden width ``hidden``, ungated; no biases."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.relu(self.w_up(x)).square())
