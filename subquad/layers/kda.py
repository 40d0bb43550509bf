"""Kimi Delta Attention (KDA; Kimi Linear, Moonshot AI 2025): Gated DeltaNet with a decay per key channel.

    q, k, v = silu(conv(x W_q)), silu(conv(x W_k)), silu(conv(x W_v))    short causal convs, (B, T, H, K)
    q, k    = x / sqrt(|x|^2 + eps)                                      (fla's L2 norm, per head)
    g       = -exp(A_log_h) * softplus(x W_fa W_fb + dt_bias)            (B, T, H, K): log-decay per channel
    beta    = sigmoid(x W_b)                                             (B, T, H)
    o       = gated_delta_rule(q, k, v, g, beta)                         S_t = (I - b k k^T) diag(e^g_t) S + b k v^T
    y       = W_o (rmsnorm_per_head(o) * sigmoid(x W_ga W_gb))

The forget gate and the output gate are low-rank (d_model -> ``gate_rank`` -> H K), or full-rank with
``full_gates`` (Ling's ``f_proj``, ``g_proj``: d_model -> H K). With ``gate_bound`` b < 0 the forget gate is
Ling's bounded ("safe") one, g = b * sigmoid(exp(A_log_h) * (x W_f + dt_bias)) in (b, 0). The output gate is a
sigmoid after the norm (at init sigmoid(0) = 0.5: half open, not the nearly-closed swish of Gated
DeltaNet's paper gate). A_log ~ log U[1, 16] and dt_bias the inverse softplus of dt ~ logU[1e-3, 0.1]
(fla's init, as transformers'); the model's init re-draws only Linear and Embedding weights, so they stay.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.conv import ShortConv
from subquad.layers.norm import RMSNorm
from subquad.ops import gated_delta_rule


class KimiDeltaAttention(Mixer):
    """KDA (see the module docstring): S_t = (I - b_t k_t k_t^T) diag(exp g_t) S_{t-1} + b_t k_t v_t^T.

    Args: d_model; n_heads H; head_dim K (keys and values, default d_model / n_heads); conv_size; gate_rank
    (the low-rank gates' width, default K); full_gates (full-rank gates ``f_proj``, ``g_proj`` in place of the
    low-rank pairs); gate_bound (None: Kimi's softplus decay; a negative float: Ling's bounded one, module doc);
    qk_eps (fla's L2-norm epsilon); norm_eps (the output norm's); mode; chunk_size.
    State: {"S": (B, H, K, K) float32 (float64 for float64), "conv": (B, conv_size - 1, 3 H K)}.
    """
    piece_size = 1024
    normed_output = True

    def __init__(self, d_model: int, n_heads: int = 4, head_dim: int | None = None, conv_size: int = 4,
                 gate_rank: int | None = None, qk_eps: float = 1e-6, norm_eps: float = 1e-6, full_gates: bool = False,
                 gate_bound: float | None = None, mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        if not isinstance(full_gates, bool):
            raise ValueError(f"full_gates must be a bool, got {full_gates!r}")
        if gate_bound is not None and (isinstance(gate_bound, bool) or not isinstance(gate_bound, (int, float))
                                       or not -float("inf") < gate_bound < 0):
            raise ValueError(f"gate_bound must be None or a negative number (a log-decay bound), got {gate_bound!r}")
        self.full_gates, self.gate_bound = full_gates, None if gate_bound is None else float(gate_bound)
        self.n_heads = n_heads
        self.head_dim = K = head_dim or d_model // n_heads
        self.gate_rank = r = gate_rank or K
        self.qk_eps = qk_eps
        inner = n_heads * K
        self.q_proj = nn.Linear(d_model, inner, bias=False)
        self.k_proj = nn.Linear(d_model, inner, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        self.conv = ShortConv(3 * inner, conv_size, bias=False)
        if full_gates:
            self.f_proj, self.g_proj = nn.Linear(d_model, inner, bias=False), nn.Linear(d_model, inner, bias=False)
        else:
            self.f_a_proj = nn.Linear(d_model, r, bias=False)
            self.f_b_proj = nn.Linear(r, inner, bias=False)
            self.g_a_proj = nn.Linear(d_model, r, bias=False)
            self.g_b_proj = nn.Linear(r, inner, bias=False)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        self.norm = RMSNorm(K, norm_eps)
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(n_heads).uniform_(1, 16)))
        dt = torch.exp(torch.rand(inner) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def mix_flops(self, T):
        """S^T k, the rank-1 correction and the read q S per head, K x K (the decay is elementwise)."""
        return 6.0 * self.n_heads * self.head_dim * self.head_dim

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"S": self.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device, dtype=dtype),
                "conv": self.conv.empty_state(batch_size, device, dtype)}

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        (q, k, v), conv = self.conv_projections([self.q_proj(x), self.k_proj(x), self.v_proj(x)], state, seq)
        q, k, v = (t.reshape(B, T, H, K) for t in (q, k, v))
        q, k = (t / torch.sqrt(t.square().sum(-1, keepdim=True) + self.qk_eps) for t in (q, k))
        f = (self.f_proj(x) if self.full_gates else self.f_b_proj(self.f_a_proj(x))) + self.dt_bias
        f = (f.float() if f.dtype != torch.float64 else f).view(B, T, H, K)
        if self.gate_bound is None:
            g = -torch.exp(self.A_log).view(H, 1) * F.softplus(f)
        else:                                                               # Ling's bounded gate, in (bound, 0)
            g = self.gate_bound * torch.sigmoid(torch.exp(self.A_log).view(H, 1) * f)
        beta = torch.sigmoid(self.b_proj(x))
        o, S = seq.recurrence(gated_delta_rule, q, k, v, g, beta, mode=self.mode, chunk_size=self.chunk_size,
                              initial_state=None if state is None else state["S"])
        gate = torch.sigmoid(self.g_proj(x) if self.full_gates else self.g_b_proj(self.g_a_proj(x))).view(B, T, H, K)
        return self.o_proj((self.norm(o) * gate).reshape(B, T, H * K)), {"S": S, "conv": conv}
