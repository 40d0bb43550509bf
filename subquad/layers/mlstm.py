"""xLSTM's mLSTM layer (Beck et al. 2024, arXiv:2405.04517), as xLSTM-7B builds it (arXiv:2503.13427).

    q, k  = x W_q, x W_k                                  (B, T, H, K), K = expand_k * D / H
    v     = x W_v                                         (B, T, H, V), V = expand_v * D / H
    i, f  = cap tanh((x W_i + b_i) / cap), likewise f     (B, T, H), soft-capped gate pre-activations
    h     = mlstm(q, k, v, g = logsigmoid(f), i)          the matrix memory (``subquad.ops.mlstm``)
    y     = W_out (sigmoid(x W_o) * layernorm_per_head(h))

The gates' weights start at zero and their biases at xLSTM-7B's values: b_i = -10 (writes start weak) and
b_f from 3 to 6 over the heads (forget gates near 1: long memories). ``bias`` puts biases on the five other
projections and the per-head norm (the checkpoints' ``use_bias``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.ops import mlstm


def soft_cap(x, cap):
    """cap tanh(x / cap); None: x."""
    return x if cap is None else cap * torch.tanh(x / cap)


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's V channels (float32 for 16-bit input), then a weight (and bias) over all H V."""

    def __init__(self, n_heads: int, head_dim: int, eps: float = 1e-6, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(n_heads * head_dim)) if bias else None

    def forward(self, h):                                    # (B, T, H, V) -> (B, T, H V)
        hf = h.float() if h.dtype in (torch.float16, torch.bfloat16) else h
        hf = (hf - hf.mean(-1, keepdim=True)) * torch.rsqrt(hf.var(-1, keepdim=True, unbiased=False) + self.eps)
        y = hf.to(h.dtype).flatten(-2) * self.weight
        return y if self.bias is None else y + self.bias


class MLSTM(Mixer):
    """The mLSTM: a K x V matrix memory per head with an exponential input gate and a max-stabilised normaliser,
    C_t = f_t C_{t-1} + exp(i_t) k_t v_t^T, n_t = f_t n_{t-1} + exp(i_t) k_t, h_t = C_t^T q_t / max(|n_t . q_t|, 1)
    (kept divided by exp(m_t), the running max of the log gates: ``subquad.ops.mlstm``).

    Args: d_model; n_heads; expand_k, expand_v (key / value widths as fractions of d_model: xLSTM's qk_dim_factor
    and v_dim_factor); gate_soft_cap (the gates' soft cap, None: none); eps (the op's, after the normaliser's max);
    norm_eps (the per-head LayerNorm's); bias (biases on q, k, v, the output gate, the output projection and the
    norm); mode; chunk_size.
    State: {"C": (B, H, K, V), "n": (B, H, K), "m": (B, H)}, float32 (float64 for float64); empty: zeros.
    """
    piece_size = 1024   # fixed state: long forwards run in pieces (base.Mixer.forward)
    normed_output = True

    def __init__(self, d_model: int, n_heads: int = 4, expand_k: float = 0.5, expand_v: float = 1.0,
                 gate_soft_cap: float | None = 15.0, eps: float = 1e-6, norm_eps: float = 1e-6, bias: bool = False,
                 mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        self.n_heads = n_heads
        self.key_dim, self.value_dim = int(d_model * expand_k), int(d_model * expand_v)
        if self.key_dim % n_heads or self.value_dim % n_heads or not self.key_dim or not self.value_dim:
            raise ValueError(f"key dim {self.key_dim} and value dim {self.value_dim} must be positive multiples of "
                             f"n_heads={n_heads}")
        if gate_soft_cap is not None and not gate_soft_cap > 0:
            raise ValueError(f"gate_soft_cap must be a positive number or None, got {gate_soft_cap!r}")
        self.head_k, self.head_v = self.key_dim // n_heads, self.value_dim // n_heads
        self.gate_soft_cap, self.eps = gate_soft_cap, eps
        self.q_proj = nn.Linear(d_model, self.key_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, self.key_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, self.value_dim, bias=bias)
        self.o_gate = nn.Linear(d_model, self.value_dim, bias=bias)
        self.i_proj = nn.Linear(d_model, n_heads)
        self.f_proj = nn.Linear(d_model, n_heads)
        self.norm = HeadLayerNorm(n_heads, self.head_v, norm_eps, bias)
        self.out_proj = nn.Linear(self.value_dim, d_model, bias=bias)
        with torch.no_grad():                                # xLSTM-7B's gate init; the model's init leaves it
            for p, bias_init in ((self.i_proj, torch.full((n_heads,), -10.0)),
                                 (self.f_proj, torch.linspace(3.0, 6.0, n_heads))):
                p.weight.zero_()
                p.bias.copy_(bias_init)
                p.keep_init = True

    def mix_flops(self, T):
        """The write k v^T and the read q C per head (2 K V each), n as one more value column (as linear
        attention's normaliser)."""
        return 4.0 * self.n_heads * self.head_k * (self.head_v + 1)

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        B, H, K, V = batch_size, self.n_heads, self.head_k, self.head_v
        return {"C": self.zeros(B, H, K, V, device=device, dtype=dtype),
                "n": self.zeros(B, H, K, device=device, dtype=dtype), "m": self.zeros(B, H, device=device, dtype=dtype)}

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k, self.head_v
        q, k = self.q_proj(x).view(B, T, H, K), self.k_proj(x).view(B, T, H, K)
        v = self.v_proj(x).view(B, T, H, V)
        i = soft_cap(self.i_proj(x), self.gate_soft_cap)
        g = F.logsigmoid(soft_cap(self.f_proj(x), self.gate_soft_cap))
        h, (C, n, m) = seq.recurrence(mlstm, q, k, v, g, i, eps=self.eps, mode=self.mode, chunk_size=self.chunk_size,
                                      initial_state=None if state is None else (state["C"], state["n"], state["m"]))
        y = self.out_proj(torch.sigmoid(self.o_gate(x)) * self.norm(h))
        return y, {"C": C, "n": n, "m": m}
