"""Short causal depthwise convolution with a state for decoding (Mamba, Mamba-2, DeltaNet).

    y_t = sum_{i=0..W-1} w_i * x_{t-W+1+i} + b          per channel, causal

The state holds the last W-1 inputs, so a prompt then single tokens equals one call. ``activation="silu"``
applies silu after it (Mamba's and Mamba-2's). A float32 prompt on the CPU without gradients runs as one C call
(``kernels/short_conv.c``: the taps and the silu in one pass over the prompt, packed rows in place); the torch
form below is its reference and runs everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subquad.kernels import I64, INT, PTR, Kernel, prompt_usable
from subquad.layers.sequence import each_sequence
from subquad.ops.common.autograd import wants_grad
from subquad.ops.common.varlen import seq_lengths

KERNEL = Kernel("short_conv", [I64, I64, I64, I64, INT, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, INT, PTR])
ACTIVATIONS = (None, "silu")


class ShortConv(nn.Module):
    """Short causal depthwise convolution y_t = sum_i w_i x_{t-W+1+i} + b, per channel.

    Args: channels; kernel_size W; bias. State: the last W - 1 inputs, (B, W - 1, channels).
    """
    takes_cu_seqlens = True             # ``layers.sequence.Packed`` hands it a packed row whole

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

    def forward(self, x, state=None, cu_seqlens=None, activation=None):
        """x (B, T, D), state (B, W-1, D) or None -> y (B, T, D), new state (B, W-1, D); ``activation="silu"``:
        silu(y). ``cu_seqlens``: x is a packed row (1, T, D) of N sequences, each from its own state row (N, W-1,
        D) into its own new one."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.channels:
            raise ValueError(f"x must be (B, T, channels={self.channels}), got {getattr(x, 'shape', type(x))}")
        lengths = None if cu_seqlens is None else seq_lengths(cu_seqlens, x.shape[1], x.shape[0])
        rows = x.shape[0] if lengths is None else len(lengths)
        if state is not None and (not isinstance(state, torch.Tensor)
                                  or tuple(state.shape) != (rows, self.kernel_size - 1, self.channels)):
            raise ValueError(f"state must be ({rows}, {self.kernel_size - 1}, {self.channels}): the last inputs of "
                             f"each sequence, got {getattr(state, 'shape', type(state))}")
        if self._fusable(x, state):
            return self._fused(x, state, cu_seqlens, rows, activation)
        if lengths is not None:                     # each sequence alone, from its own state row
            return each_sequence(lambda xi, ti: self(xi, ti, activation=activation), x, state, lengths)
        y, tail = self._taps(x, state)
        if activation == "silu":
            y = F.silu(y, inplace=not wants_grad(y))  # y is this call's own tensor
        return y, tail

    def _fusable(self, x, state) -> bool:
        """Whether the C call may run (``kernels.prompt_usable``): float32 on the CPU everywhere, x with unit
        stride within a token, no gradient, no autocast, not while compiling, kernels on and built."""
        return prompt_usable(KERNEL, (x, state, self.weight, self.bias), (x,))

    def _fused(self, x, state, cu_seqlens, rows: int, activation):
        """``forward`` in one C call (``_fusable`` holds)."""
        B, T, D = x.shape
        W = self.kernel_size
        w = self.weight.detach()[:, 0, :].t().contiguous()                  # (W, D): each tap's row contiguous
        seg = None if cu_seqlens is None else cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
        tail = None if state is None else state.contiguous()
        y, new = x.new_empty(B, T, D), x.new_empty(rows, W - 1, D)
        KERNEL(rows, T, D, W, torch.get_num_threads(), x, x.stride(0), x.stride(1), w,
               None if self.bias is None else self.bias.detach(), tail, y, new, int(activation == "silu"), seg)
        return y, new

    def _taps(self, x, state):
        """The torch form (the reference): W shifted multiply-adds."""
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


class Activated:
    """``conv`` with ``activation`` after it, called as a sequence backend calls a convolution: ``(x, tail) ->
    (y, new tail)`` (``layers.base.Mixer.short_conv``)."""
    takes_cu_seqlens = True

    def __init__(self, conv: ShortConv, activation: str):
        self.conv, self.activation = conv, activation

    def __call__(self, x, tail=None, cu_seqlens=None):
        return self.conv(x, tail, cu_seqlens=cu_seqlens, activation=self.activation)
