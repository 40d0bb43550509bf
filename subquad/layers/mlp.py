"""The feed-forward layer after each mixer (Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202):

    y = W_down (act(W_gate x) * W_up x)        act = silu (SwiGLU), tanh-approximated GeLU (GeGLU: Gemma) or
                                               GeLU (Zamba2's shared MLP)

or, ungated, with a squared ReLU (So et al. 2021, "Primer", arXiv:2109.08668; Nemotron-H's MLP layers):

    y = W_down relu(W_up x)^2

The mixture of experts (``models.moe``) routes each token to a few of these and runs a dense one as its
shared expert.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import nn

from subquad.ops.common.autograd import wants_grad


ACTS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu}


class SwiGLU(nn.Module):
    """x (..., d_model) -> (..., d_model) through a hidden width ``hidden``. ``act``: "silu", "gelu_tanh" or "gelu";
    ``bias``: biases on the three projections (RecurrentGemma's MLP has them; the default has none)."""

    def __init__(self, d_model: int, hidden: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=bias)
        self.w_up = nn.Linear(d_model, hidden, bias=bias)
        self.w_down = nn.Linear(hidden, d_model, bias=bias)
        if act not in ACTS:
            raise ValueError(f"act must be one of {', '.join(ACTS)}, got {act!r}")
        self.act = ACTS[act]

    def forward(self, x):
        g, u = self.w_gate(x), self.w_up(x)
        if wants_grad(g, u):
            return self.w_down(self.act(g) * u)
        # no gradient: the product written into act's output (silu: into g itself), no new (T, hidden) tensor -
        # at a 2,048-token prompt each is tens of MB
        h = F.silu(g, inplace=True) if self.act is F.silu else self.act(g)
        return self.w_down(h.mul_(u))


class ReLU2MLP(nn.Module):
    """x (..., d_model) -> (..., d_model) through a hidden width ``hidden``, ungated; no biases."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.relu(self.w_up(x)).square())


def dense_mlp(cfg):
    """The dense MLP a ``ModelConfig`` asks for (``mlp_kind``, ``mlp_bias``, its hidden width): RWKV's channel
    mix for "rwkv7" (``layers.channel_mix``: token shift, relu^2; it has a state)."""
    if cfg.mlp_kind == "rwkv7":
        from subquad.layers.channel_mix import ChannelMix

        return ChannelMix(cfg.d_model, cfg.mlp_hidden)
    if cfg.mlp_kind == "relu2":
        return ReLU2MLP(cfg.d_model, cfg.mlp_hidden)
    return SwiGLU(cfg.d_model, cfg.mlp_hidden, "gelu_tanh" if cfg.mlp_kind == "geglu" else "silu", cfg.mlp_bias)
