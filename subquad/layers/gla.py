"""Gated linear attention layer (GLA, Yang et al. 2024, arXiv:2312.06635).

    q, k  = x W_q, x W_k                                   (B, T, H, K), K = expand_k * D / H
    v     = x W_v                                          (B, T, H, V)
    g     = logsigmoid(x W_g1 W_g2 + b) / 16               (B, T, H, K), low-rank gate, the paper's normaliser
    o     = gla(q, k, v, g)
    y     = W_o (swish(x W_r + b_r) * rmsnorm_per_head(o))

The output gate's bias b_r starts at 1.28, where swish is 1: the gate starts open (``open_gate``). The
paper's gate has no bias, and after the norm it starts nearly closed (swish of N(0, 0.16) is +-0.08),
which scales down the gradient into q, k, v and g by ~10x and left GLA at chance on MQAR (benchmarks/
RESULTS.md, "Recall"); ``open_gate=False`` is the paper's (and the checkpoints') gate.

``conv_size`` > 0 puts a short causal convolution (with silu) on x W_q, x W_k, x W_v (fla's
``use_short_conv``); 0, the default, is the paper's layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.conv import ShortConv
from subquad.layers.norm import RMSNorm
from subquad.ops import gla


OPEN = 1.2785   # swish(1.2785) = 1.000: an output gate that starts open


class GatedLinearAttention(Mixer):
    """GLA: S_t = diag(a_t) S_{t-1} + k_t v_t^T with a per-key-dim gate a_t = exp(g_t), o_t = S_t^T q_t.

    Args: d_model; n_heads; expand_k, expand_v (key / value widths as fractions of d_model); gate_rank (the
    low-rank gate projection); gate_normalizer (g = logsigmoid(.) / gate_normalizer); open_gate (a learned
    output-gate bias ``gate_bias`` starting where swish is 1; False: the paper's bias-free gate); conv_size
    (0: none; else a short convolution on q, k, v); mode; chunk_size.
    State: {"S": (B, H, K, V) float32 (float64 for float64)}, plus {"conv": (B, conv_size - 1, 2 H K + H V)}
    with a convolution.
    """
    piece_size = 1024   # fixed state: long forwards run in pieces (base.Mixer.forward); bench_pieces.py's best
    normed_output = True
    def __init__(self, d_model: int, n_heads: int = 4, expand_k: float = 0.5, expand_v: float = 1.0,
                 gate_rank: int = 16, gate_normalizer: float = 16.0, open_gate: bool = True, conv_size: int = 0,
                 mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        self.n_heads = n_heads
        self.key_dim, self.value_dim = int(d_model * expand_k), int(d_model * expand_v)
        if self.key_dim % n_heads or self.value_dim % n_heads:
            raise ValueError(f"key dim {self.key_dim} and value dim {self.value_dim} must divide by n_heads={n_heads}")
        self.head_k, self.head_v = self.key_dim // n_heads, self.value_dim // n_heads
        self.gate_normalizer = gate_normalizer
        self.q_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.value_dim, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(d_model, gate_rank, bias=False), nn.Linear(gate_rank, self.key_dim))
        self.r_proj = nn.Linear(d_model, self.value_dim, bias=False)
        self.gate_bias = nn.Parameter(torch.full((self.value_dim,), OPEN)) if open_gate else None
        self.norm = RMSNorm(self.head_v)
        self.o_proj = nn.Linear(self.value_dim, d_model, bias=False)
        self.conv = ShortConv(2 * self.key_dim + self.value_dim, conv_size, bias=False) if conv_size else None

    def mix_flops(self, T):
        """The write k v^T and the read q S per head, K x V."""
        return 4.0 * self.n_heads * self.head_k * self.head_v

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        state = {"S": self.zeros(batch_size, self.n_heads, self.head_k, self.head_v, device=device, dtype=dtype)}
        return self.with_conv(state, batch_size=batch_size, device=device, dtype=dtype)

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k, self.head_v
        (q, k, v), conv = self.conv_projections([self.q_proj(x), self.k_proj(x), self.v_proj(x)], state, seq)
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V)
        g = F.logsigmoid(self.gk_proj(x)).view(B, T, H, K) / self.gate_normalizer
        o, S = seq.recurrence(gla, q, k, v, g, mode=self.mode, chunk_size=self.chunk_size,
                              initial_state=None if state is None else state["S"])
        r = self.r_proj(x) if self.gate_bias is None else self.r_proj(x) + self.gate_bias
        y = self.o_proj(F.silu(r) * self.norm(o).reshape(B, T, H * V))
        return y, self.with_conv({"S": S}, conv)
