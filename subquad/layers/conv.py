"""Short causal depthwise convolution with a state for decoding (Mamba, Mamba-2, DeltaNet).

    y_t = sum_{i=0..W-1} w_i * x_{t-W+1+i} + b          per channel, causal

The state holds the last W-1 inputs, so a prompt then single tokens equals one call.
"""

from __future__ import annotations

import torch
from torch import nn


class ShortConv(nn.Module):
    """Short causal depthwise convolution y_t = sum_i w_i x_{t-W+1+i} + b, per channel.

    Args: channels; kernel_size W; bias. State: the last W - 1 inputs, (B, W - 1, channels).
    """
    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = True):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return torch.zeros(batch_size, self.kernel_size - 1, self.channels, device=device, dtype=dtype)

    def forward(self, x, state=None):
        """x (B, T, D), state (B, W-1, D) or None -> y (B, T, D), new state (B, W-1, D)."""
        B, T, D = x.shape
        if state is None:
            state = self.empty_state(B, x.device, x.dtype)
        W = self.kernel_size
        state = state.to(x.dtype)
        # W shifted multiply-adds in the (B, T, D) layout: conv1d wants (B, D, T) and would pay two
        # transposes of the whole input. Tap i reads x_{t-(W-1-i)}:
        # rows t >= W-1-i from x itself (no concatenated copy of the input), the first rows from the state.
        w = self.weight[:, 0, :].t().contiguous().t()   # (D, W), each tap's column contiguous: vectorised reads
        y = torch.addcmul(self.bias, x, w[:, W - 1]) if self.bias is not None else x * w[:, W - 1]
        for i in range(W - 1):
            shift = W - 1 - i
            if shift < T:
                y[:, shift:].addcmul_(x[:, :T - shift], w[:, i])
            r = min(shift, T)
            y[:, :r].addcmul_(state[:, i:i + r], w[:, i])
        if T >= W - 1:
            return y, x[:, T - (W - 1):].clone()
        return y, torch.cat([state, x], dim=1)[:, T:]
