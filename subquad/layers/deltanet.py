"""DeltaNet (Yang et al. 2024, arXiv:2406.06484) and Gated DeltaNet (Yang et al. 2024, arXiv:2412.06464).

    q, k, v = silu(conv(x W_q)), silu(conv(x W_k)), silu(conv(x W_v))   short causal convs, own decoding state
    q, k    = q / |q|, k / |k|                                          (L2 per head: keeps b |k|^2 <= 1)
    beta    = sigmoid(x W_b)                                            (B, T, H); 2 sigmoid with allow_neg_eigval
    g       = -exp(A_log) * softplus(x W_a + dt_bias)                   (Gated DeltaNet only)
    o       = delta_rule(q, k, v, beta)  |  gated_delta_rule(q, k, v, g, beta)
    y       = W_o rmsnorm_per_head(o)            (Gated DeltaNet: rmsnorm(o) * silu(x W_g + b_g); sigmoid with
                                                  ``output_gate="sigmoid"``, Qwen4-Exp's ``output_gate_type``)

Gated DeltaNet's output gate bias b_g starts at 1.28, where silu is 1: the gate starts open
(``open_gate``; the paper's gate has no bias and starts nearly closed after the norm, which stalled
learning on MQAR: benchmarks/RESULTS.md, "Recall"). ``open_gate=False`` is the paper's gate.

The checkpoints' variants are options: ``n_key_heads`` < ``n_heads`` shares each query/key head among
n_heads / n_key_heads consecutive value heads (Qwen3-Next; the op runs on the key heads repeated, which is
the same map), ``value_head_dim`` != ``head_dim`` (OLMo-Hybrid: V = 2K), ``qk_eps`` (fla's L2 norm
x rsqrt(|x|^2 + eps) instead of x / max(|x|, 1e-12)), ``allow_neg_eigval`` (beta = 2 sigmoid, in [0, 2]:
the delta rule's negative-eigenvalue option) and ``norm_eps`` (the output norm's epsilon).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from subquad import kernels
from subquad.layers.base import Mixer
from subquad.layers.conv import ShortConv
from subquad.layers.gla import OPEN
from subquad.layers.norm import RMSNorm
from subquad.layers.sequence import SingleDevice
from subquad.ops import delta_rule, gated_delta_rule
from subquad.ops.common.checks import default_scale
from subquad.ops.delta import fused_step


GATES = {"silu": F.silu, "sigmoid": torch.sigmoid}     # Gated DeltaNet's output gate activations


class DeltaNet(Mixer):
    """DeltaNet: S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t (see the module docstring).

    Args: d_model; n_heads (value heads H); head_dim K (query/key, default d_model / n_heads); value_head_dim
    V (default K); n_key_heads Hk (query/key heads, default H; H must be a multiple); conv_size (short
    convolutions on q, k, v); open_gate (Gated DeltaNet: a learned output-gate bias ``gate_bias`` starting
    where silu is 1; False: the paper's bias-free gate); qk_eps (None: F.normalize; a float: fla's
    x rsqrt(|x|^2 + eps)); allow_neg_eigval; norm_eps; output_gate (Gated DeltaNet's gate activation, "silu" or
    "sigmoid"); mode; chunk_size.
    State: {"S": (B, H, K, V) float32 (float64 for float64), "conv": (B, conv_size - 1, 2 Hk K + H V)}.
    """
    piece_size = 1024   # fixed state: long forwards run in pieces (base.Mixer.forward); bench_pieces.py's best
    gated = False

    normed_output = True

    def __init__(self, d_model: int, n_heads: int = 4, head_dim: int | None = None, conv_size: int = 4,
                 open_gate: bool = True, value_head_dim: int | None = None, n_key_heads: int | None = None,
                 qk_eps: float | None = None, allow_neg_eigval: bool = False, norm_eps: float = 1e-6,
                 output_gate: str = "silu", mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        self.n_heads = n_heads
        self.n_key_heads = n_key_heads or n_heads
        if n_heads % self.n_key_heads:
            raise ValueError(f"n_heads={n_heads} (value heads) must be a multiple of n_key_heads={self.n_key_heads}")
        if qk_eps is not None and not (isinstance(qk_eps, (int, float)) and qk_eps > 0):
            raise ValueError(f"qk_eps must be a positive float or None, got {qk_eps!r}")
        if not isinstance(allow_neg_eigval, bool):
            raise ValueError(f"allow_neg_eigval must be a bool, got {allow_neg_eigval!r}")
        if output_gate not in GATES:
            raise ValueError(f"output_gate must be one of {', '.join(GATES)}, got {output_gate!r}")
        self.output_gate = output_gate
        self.head_dim = head_dim or d_model // n_heads
        self.value_head_dim = value_head_dim or self.head_dim
        self.qk_eps, self.allow_neg_eigval = qk_eps, allow_neg_eigval
        key, inner = self.n_key_heads * self.head_dim, n_heads * self.value_head_dim
        self.q_proj = nn.Linear(d_model, key, bias=False)
        self.k_proj = nn.Linear(d_model, key, bias=False)
        self.v_proj = nn.Linear(d_model, inner, bias=False)
        self.conv = ShortConv(2 * key + inner, conv_size, bias=False)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        self.norm = RMSNorm(self.value_head_dim, norm_eps)
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        if self.gated:
            self.a_proj = nn.Linear(d_model, n_heads, bias=False)
            self.g_proj = nn.Linear(d_model, inner, bias=False)
            self.gate_bias = nn.Parameter(torch.full((inner,), OPEN)) if open_gate else None
            self.A_log = nn.Parameter(torch.log(torch.empty(n_heads).uniform_(1, 16)))
            dt = torch.exp(torch.rand(n_heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def mix_flops(self, T):
        """S^T k (the prediction), the rank-1 correction and the read q S per head, K x V."""
        return 6.0 * self.n_heads * self.head_dim * self.value_head_dim

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"S": self.zeros(batch_size, self.n_heads, self.head_dim, self.value_head_dim, device=device,
                                dtype=dtype),
                "conv": self.conv.empty_state(batch_size, device, dtype)}

    def _l2(self, x):
        if self.qk_eps is None:
            return F.normalize(x, dim=-1)
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + self.qk_eps)

    def mix(self, x, state, seq):
        if state is not None and type(seq) is SingleDevice and self.conv.bias is None \
                and (self.qk_eps is None or self.qk_eps > 0) \
                and kernels.usable(fused_step.KERNEL, x, state["S"], state["conv"], self.conv.weight, self.norm.weight,
                                   *((self.A_log, self.dt_bias, self.gate_bias) if self.gated else ())):
            return self._fused_step(x, state)       # one decoding token: the kernel (float32 CPU, no gradient)
        B, T, _ = x.shape
        H, Hk, K, V = self.n_heads, self.n_key_heads, self.head_dim, self.value_head_dim
        (q, k, v), conv = self.conv_projections([self.q_proj(x), self.k_proj(x), self.v_proj(x)], state, seq)
        q, k = self._l2(q.view(B, T, Hk, K)), self._l2(k.view(B, T, Hk, K))
        if Hk != H:                                       # each key head serves H / Hk consecutive value heads
            q, k = q.repeat_interleave(H // Hk, dim=2), k.repeat_interleave(H // Hk, dim=2)
        v = v.view(B, T, H, V)
        beta = torch.sigmoid(self.b_proj(x))
        if self.allow_neg_eigval:
            beta = 2 * beta
        kw = dict(mode=self.mode, chunk_size=self.chunk_size, initial_state=None if state is None else state["S"],
                  allow_neg_eigval=self.allow_neg_eigval)
        if self.gated:
            g = -torch.exp(self.A_log) * F.softplus(self.a_proj(x) + self.dt_bias)
            o, S = seq.recurrence(gated_delta_rule, q, k, v, g, beta, **kw)
            r = self.g_proj(x) if self.gate_bias is None else self.g_proj(x) + self.gate_bias
            o = self.norm(o) * GATES[self.output_gate](r).view(B, T, H, V)
        else:
            o, S = seq.recurrence(delta_rule, q, k, v, beta, **kw)
            o = self.norm(o)
        return self.o_proj(o.reshape(B, T, H * V)), {"S": S, "conv": conv}

    def _fused_step(self, x, state):
        """One token through ``ops.delta.fused_step`` (the same math as ``mix``'s ops, in one call)."""
        gated = self.gated
        o, conv, S = fused_step.delta_step(
            self.q_proj(x), self.k_proj(x), self.v_proj(x), state["conv"], self.conv.weight, self.b_proj(x),
            self.a_proj(x) if gated else None, self.A_log if gated else None, self.dt_bias if gated else None,
            self.g_proj(x) if gated else None, self.gate_bias if gated else None, state["S"], self.norm.weight,
            self.allow_neg_eigval, self.qk_eps, default_scale(None, self.head_dim), self.norm.eps,
            gated and self.output_gate == "sigmoid")
        return self.o_proj(o[:, None]), {"S": S, "conv": conv}


class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet: S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T with a_t = exp(g_t) per head and
    token, output rmsnorm(o) * silu(x W_g).

    Args: as ``DeltaNet``. State: as ``DeltaNet``, {"S": (B, H, K, K), "conv": (B, conv_size - 1, 3 H K)}.
    """
    gated = True
