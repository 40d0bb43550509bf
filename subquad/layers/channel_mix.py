"""RWKV's channel mix, the MLP of an RWKV-7 block (BlinkDL's ``CMix_x070``, fla's ``RWKV7FeedForward``):

    x_k = x + (x_{t-1} - x) * mu_k          token shift (``shift.token_shift``), one token of state
    y   = W_v relu(W_k x_k)^2

Unlike a SwiGLU it reads the token before, so it carries a decoding state and stops at sequence boundaries
(``cu_seqlens``); the block keeps its state beside the mixer's (``models.lm.Block``).
"""

from __future__ import annotations

import torch
from torch import nn

from subquad.layers import sequence
from subquad.layers.shift import token_shift


class ChannelMix(nn.Module):
    """x (B, T, d_model) -> (B, T, d_model) through relu^2 of width ``hidden``; no biases.

    ``forward(x, state=None, cu_seqlens=None) -> (y, state)``; state {"shift": (B, 1, d_model)} (one row per
    sequence with ``cu_seqlens``), never modified.
    """

    rollback = "states"         # its state is a token shift's tail (layers.rollback; Block.state_parts)

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.d_model = d_model
        self.x_k = nn.Parameter(1.0 - (torch.arange(d_model) / d_model) ** 0.5)   # RWKV-LM's mid-depth mix
        self.key = nn.Linear(d_model, hidden, bias=False)
        self.value = nn.Linear(hidden, d_model, bias=False)

    def output_projection(self):
        """The Linear that writes into the residual stream (the model scales its initialisation)."""
        return self.value

    def empty_state(self, batch_size, device=None, dtype=torch.float32) -> dict:
        return {"shift": torch.zeros(batch_size, 1, self.d_model, device=device, dtype=dtype)}

    def forward(self, x, state=None, cu_seqlens=None):
        seq = sequence.backend() if cu_seqlens is None else sequence.Packed(cu_seqlens)
        prev, shift = seq.causal_conv(token_shift, x, 1, None if state is None else state["shift"])
        k = torch.relu(self.key(torch.addcmul(x, prev - x, self.x_k))).square()
        return self.value(k), (None if shift is None else {"shift": shift})
