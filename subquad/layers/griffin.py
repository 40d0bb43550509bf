"""Griffin's recurrent block (De et al. 2024, arXiv:2402.19427; RecurrentGemma's ``RecurrentGemmaRecurrentBlock``).

    y      = gelu_tanh(linear_y(input))                     (B, T, W) the gate branch, W = lru_width
    x      = conv1d(linear_x(input))                        depthwise, causal, width 4, with a bias
    i, r   = sigmoid(x W_i + b_i), sigmoid(x W_a + b_a)     block-diagonal: one (W/H, W/H) matrix per head
    g      = -8 r softplus(Lambda)                          log a_t: a_t = sigmoid(-Lambda)^(8 r_t)
    h      = rg_lru(i * x, g)                               h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t)
    out    = linear_out(h * y)

At the first token of a sequence the recurrence restarts with h_t = i_t x_t (no sqrt(1 - a^2) factor),
RecurrentGemma's rule at ``position_ids == 0``: the layer passes g = -inf there, the op's reset. Position
0 is read from the sequence backend (it restarts at each packed sequence) and the state's per-row token count,
so a state from ``empty_state`` and no state at all agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.conv import ShortConv
from subquad.ops import rg_lru
from subquad.ops.common.checks import state_dtype

C_GATE = 8.0   # Griffin's fixed c in a_t = a^(c r_t)


def first_tokens(pos, B: int, T: int, device) -> torch.Tensor:
    """(B or 1, T) bools: which of this call's tokens sit at position 0 (``seq.positions``: an int offset, or
    positions (T,) or (B, T))."""
    if isinstance(pos, torch.Tensor):
        return (pos == 0).reshape(-1, T)
    return (torch.arange(T, device=device) + pos == 0).unsqueeze(0)


class GriffinRecurrentBlock(Mixer):
    """Griffin's recurrent block: a GeLU gate branch times the RG-LRU over a short convolution (module docstring).

    Recurrence: h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t), a_t = sigmoid(-Lambda)^(8 r_t), per channel.

    Args: d_model; n_heads (the gates' diagonal blocks); lru_width W (default d_model); conv_size; mode;
    chunk_size. State: {"h": (B, W) float32 (float64 for float64), "conv": (B, conv_size - 1, W),
    "pos": (B,) the tokens each row has seen (position 0 restarts the recurrence)}.
    """
    piece_size = 2048   # fixed state: long forwards run in pieces (base.Mixer.forward)

    def __init__(self, d_model: int, n_heads: int = 4, lru_width: int | None = None, conv_size: int = 4,
                 mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        W = lru_width or d_model
        if W % n_heads:
            raise ValueError(f"lru_width={W} must divide by n_heads={n_heads} (the gates' diagonal blocks)")
        self.n_heads, self.lru_width, self.block = n_heads, W, W // n_heads
        self.linear_y = nn.Linear(d_model, W)
        self.linear_x = nn.Linear(d_model, W)
        self.conv = ShortConv(W, conv_size)
        std = (0.01 / self.block) ** 0.5                  # RecurrentGemma's w_init_variance_scale 0.01
        self.input_gate_weight = nn.Parameter(torch.randn(n_heads, self.block, self.block) * std)
        self.input_gate_bias = nn.Parameter(torch.zeros(n_heads, self.block))
        self.recurrent_gate_weight = nn.Parameter(torch.randn(n_heads, self.block, self.block) * std)
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(n_heads, self.block))
        # a = sigmoid(-Lambda) uniform in [0.9, 0.999]: Lambda = softplus^-1(-log a)
        a = torch.empty(W).uniform_(0.9, 0.999)
        self.recurrent_param = nn.Parameter(torch.log(torch.expm1(-torch.log(a))))
        self.recurrent_param._no_weight_decay = True
        self.out_proj = nn.Linear(W, d_model)

    def mix_flops(self, T):
        """The two block-diagonal gates (W^2 / H weights each) and the recurrence's multiply-add a h + u per
        channel (the normaliser sqrt(1 - a^2) is elementwise gate work, not counted)."""
        return 4.0 * self.lru_width * self.block + 2.0 * self.lru_width

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"h": self.zeros(batch_size, self.lru_width, device=device, dtype=dtype),
                "conv": self.conv.empty_state(batch_size, device, dtype),
                "pos": torch.zeros(batch_size, dtype=torch.long, device=device)}

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        H, P = self.n_heads, self.block
        pos = seq.positions(T, 0 if state is None else state["pos"], x.device)
        y = F.gelu(self.linear_y(x), approximate="tanh")
        xs, conv = self.short_conv(self.linear_x(x), state, seq)
        xs = xs.view(B, T, H, P)
        gate_i = torch.sigmoid(torch.einsum("bthi,hij->bthj", xs, self.input_gate_weight) + self.input_gate_bias)
        gate_r = torch.sigmoid(torch.einsum("bthi,hij->bthj", xs, self.recurrent_gate_weight)
                               + self.recurrent_gate_bias)
        sd = state_dtype(xs.dtype)
        g = -C_GATE * gate_r.to(sd) * F.softplus(self.recurrent_param.to(sd)).view(H, P)
        g = g.masked_fill(first_tokens(pos, B, T, x.device)[:, :, None, None], float("-inf"))
        h0 = None if state is None else state["h"].view(-1, H, P)      # (B, H, P); packed: one row per sequence
        o, h = seq.recurrence(rg_lru, xs * gate_i, g, mode=self.mode, chunk_size=self.chunk_size, initial_state=h0)
        out = self.out_proj(o.reshape(B, T, -1) * y)
        end = seq.tokens(B, T, x.device) + (0 if state is None else state["pos"].to(x.device))
        h = None if h is None else h.reshape(h.shape[0], -1)                 # None: a shard of a sequence (context parallel)
        return out, {"h": h, "conv": conv, "pos": end}

    def extra_repr(self):
        return f"d_model={self.d_model}, lru_width={self.lru_width}, heads={self.n_heads}, mode={self.mode}"
