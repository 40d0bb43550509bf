"""Gated short convolution (Liquid AI's LFM2, https://www.liquid.ai/blog/liquid-foundation-models-v2-our-
second-series-of-generative-ai-models; the input-dependent gates of Hyena, arXiv:2302.10866, around a short
causal convolution):

    b, c, x = in_proj(input)                        (B, T, D) each
    y       = out_proj(c * conv(b * x))             conv: depthwise, causal, conv_size taps (LFM2: 3)

No recurrence beyond the convolution: the decoding state is the convolution's last conv_size - 1 inputs
(b * x), the same ``ShortConv`` with its tail that Mamba and DeltaNet use, so packed sequences (each its own
tail) and context parallelism (the previous rank's last inputs as a halo) come from the sequence backend.
"""

from __future__ import annotations

import torch
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.conv import ShortConv


class GatedShortConv(Mixer):
    """y = out_proj(c * conv(b * x)), with b, c, x = in_proj(input): a short causal convolution between two gates,
    per token y_t = out_proj(c_t * sum_{j < conv_size} w_j (b * x)_{t-j}).

    Args: d_model; conv_size (the convolution's taps, LFM2's ``conv_L_cache``); bias (on in_proj, the
    convolution and out_proj together: LFM2's ``conv_bias``); mode and chunk_size (unused: nothing is chunked;
    accepted as every mixer's). State: {"conv": (B, conv_size - 1, d_model)}, the gated inputs b * x.
    """

    def __init__(self, d_model: int, conv_size: int = 3, bias: bool = False, mode: str = "chunk",
                 chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 1:
            raise ValueError(f"conv_size must be a positive int, got {conv_size!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"bias must be a bool, got {bias!r}")
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.conv = ShortConv(d_model, conv_size, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def mix_flops(self, T):
        """The two gates, one multiply per channel each (the convolution is counted with the weights)."""
        return 2.0 * self.d_model

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"conv": self.conv.empty_state(batch_size, device, dtype)}

    def mix(self, x, state, seq):
        b, c, xs = self.in_proj(x).chunk(3, dim=-1)                # (B, T, D) each: LFM2's order B, C, x
        y, conv = self.short_conv(b * xs, state, seq)
        return self.out_proj(c * y), {"conv": conv}
