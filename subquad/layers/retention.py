"""Multi-scale retention (RetNet, Sun et al. 2023, arXiv:2307.08621).

    q, k = rotary(x W_q), rotary(x W_k)          (B, T, H, K)
    v    = x W_v                                  (B, T, H, V), V = 2K as in the paper
    o    = retention(q, k, v, g_h = log(1 - 2^(-5-h)))        one fixed decay per head
    y    = W_o (swish(x W_g + b_g) * groupnorm_per_head(o))

The output gate's bias b_g starts at 1.28, where swish is 1: the gate starts open (``open_gate``, as
GLA's; False: the paper's bias-free gate, nearly closed at init after the norm). ``conv_size`` > 0 puts a
short causal convolution (with silu) on x W_q, x W_k, x W_v before the rotation (fla's ``use_short_conv``);
0, the default, is the paper's layer.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.conv import ShortConv
from subquad.layers.gla import OPEN
from subquad.layers.rotary import apply_rotary
from subquad.ops import retention
from subquad.ops.common.checks import state_dtype


class MultiScaleRetention(Mixer):
    """Multi-scale retention: S_t = a_h S_{t-1} + k_t v_t^T with a fixed decay a_h = 1 - 2^(-5-h) per head,
    o_t = S_t^T q_t, output W_o(swish(x W_g) * groupnorm(o)).

    Args: d_model; n_heads; head_dim (default d_model / n_heads); value_factor (V = value_factor K);
    open_gate (a learned output-gate bias ``gate_bias`` starting where swish is 1; False: the paper's);
    conv_size (0: none; else a short convolution on q, k, v); mode; chunk_size.
    State: {"S": (B, H, K, V) float32 (float64 for float64), "pos": (B,) the tokens each row has seen (its
    rotary offset), a long tensor on the state's device}, plus {"conv": (B, conv_size - 1, 2 H K + H V)} with
    a convolution.
    """
    normed_output = True
    piece_size = 2048   # fixed state: long forwards run in pieces (base.Mixer.forward); bench_pieces.py's best
    def __init__(self, d_model: int, n_heads: int = 4, head_dim: int | None = None, value_factor: int = 2,
                 open_gate: bool = True, conv_size: int = 0, mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        self.n_heads = n_heads
        self.head_dim = head_dim or d_model // n_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary positions, got {self.head_dim}")
        self.v_dim = self.head_dim * value_factor
        H, K, V = n_heads, self.head_dim, self.v_dim
        self.q_proj = nn.Linear(d_model, H * K, bias=False)
        self.k_proj = nn.Linear(d_model, H * K, bias=False)
        self.v_proj = nn.Linear(d_model, H * V, bias=False)
        self.g_proj = nn.Linear(d_model, H * V, bias=False)
        self.gate_bias = nn.Parameter(torch.full((H * V,), OPEN)) if open_gate else None
        self.o_proj = nn.Linear(H * V, d_model, bias=False)
        self.conv = ShortConv(2 * H * K + H * V, conv_size, bias=False) if conv_size else None
        # a_h = 1 - 2^(-5-h): head 0 remembers ~32 tokens, later heads ever longer
        self.register_buffer("log_decay", torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64))).float())

    def mix_flops(self, T):
        """The write k v^T and the read q S per head, K x V."""
        return 4.0 * self.n_heads * self.head_dim * self.v_dim

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        state = {"S": self.zeros(batch_size, self.n_heads, self.head_dim, self.v_dim, device=device, dtype=dtype),
                 "pos": torch.zeros(batch_size, dtype=torch.long, device=device)}
        return self.with_conv(state, batch_size=batch_size, device=device, dtype=dtype)

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_dim, self.v_dim
        pos = seq.positions(T, 0 if state is None else state["pos"], x.device)
        (q, k, v), conv = self.conv_projections([self.q_proj(x), self.k_proj(x), self.v_proj(x)], state, seq)
        q, k, v = apply_rotary(q.view(B, T, H, K), pos), apply_rotary(k.view(B, T, H, K), pos), v.view(B, T, H, V)
        g = self.log_decay.to(state_dtype(x.dtype))
        o, S = seq.recurrence(retention, q, k, v, g, mode=self.mode, chunk_size=self.chunk_size,
                              initial_state=None if state is None else state["S"])
        o = F.layer_norm(o, (V,))                                           # group norm, one group per head
        r = self.g_proj(x) if self.gate_bias is None else self.g_proj(x) + self.gate_bias
        y = self.o_proj(F.silu(r) * o.reshape(B, T, H * V))
        end = seq.tokens(B, T, x.device) + (0 if state is None else state["pos"].to(x.device))
        return y, self.with_conv({"S": S, "pos": end}, conv)

    def extra_repr(self):
        return f"d_model={self.d_model}, heads={self.n_heads}, head_dim={self.head_dim}, v_dim={self.v_dim}, mode={self.mode}"


