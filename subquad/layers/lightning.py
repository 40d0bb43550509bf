"""Lightning attention (MiniMax-01, 2025; Qin et al., "Lightning Attention-2"): linear attention with a fixed
per-head decay, its output normalised and gated.

    q, k, v = silu(x W_qkv)                                   (B, T, H, K) each; W_qkv per head [q, k, v]
    S_t     = exp(-s_h) S_{t-1} + k_t v_t^T,   o_t = q_t S_t  (no 1/sqrt(K) scale: ``retention`` with scale 1)
    y       = W_o (sigmoid(x W_g) * rmsnorm(o))                rmsnorm over all heads' dims together

The slopes follow ALiBi's geometric sequence scaled by depth, as MiniMax's: s_h = b^(h+1) (1 - l / (L - 1)
+ 1e-5) with b = 2^(-8 / H), for layer l of L (``place``, called by the model; the last layer barely
decays). They are a buffer: a checkpoint's own values load into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.norm import RMSNorm
from subquad.ops import retention


def slopes(n_heads: int, layer: int = 0, n_layers: int = 2) -> torch.Tensor:
    """MiniMax's per-head decay rates s_h (H,) for layer ``layer`` of ``n_layers``."""
    base = 1 / (2 ** (8 / n_heads))
    factor = 1 - layer / (n_layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(n_heads, dtype=torch.float64) + 1) * factor


class LightningAttention(Mixer):
    """Lightning attention (see the module docstring).

    Recurrence: S_t = exp(-s_h) S_{t-1} + k_t v_t^T, o_t = q_t S_t. Args: d_model; n_heads H; head_dim K
    (default d_model / H); norm_eps (the output norm's); mode; chunk_size.
    State: {"S": (B, H, K, K) float32 (float64 for float64)}.
    """
    piece_size = 1024
    normed_output = True

    def __init__(self, d_model: int, n_heads: int = 4, head_dim: int | None = None, norm_eps: float = 1e-6,
                 mode: str = "chunk", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        self.n_heads = n_heads
        self.head_dim = K = head_dim or d_model // n_heads
        self.qkv_proj = nn.Linear(d_model, 3 * n_heads * K, bias=False)
        self.output_gate = nn.Linear(d_model, n_heads * K, bias=False)
        self.norm = RMSNorm(n_heads * K, norm_eps)
        self.out_proj = nn.Linear(n_heads * K, d_model, bias=False)
        self.register_buffer("slope", slopes(n_heads).float())

    def place(self, layer: int, n_layers: int) -> None:
        """Set the slopes for layer ``layer`` of ``n_layers`` (the model calls it once, after building)."""
        with torch.no_grad():
            self.slope.copy_(slopes(self.n_heads, layer, n_layers))

    def mix_flops(self, T):
        """k v^T into the state and the read q S per head, K x K."""
        return 4.0 * self.n_heads * self.head_dim * self.head_dim

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"S": self.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device, dtype=dtype)}

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        q, k, v = F.silu(self.qkv_proj(x)).view(B, T, H, 3 * K).split(K, dim=-1)
        g = -self.slope.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        o, S = seq.recurrence(retention, q, k, v, g, mode=self.mode, chunk_size=self.chunk_size, scale=1.0,
                              initial_state=None if state is None else state["S"])
        y = torch.sigmoid(self.output_gate(x)) * self.norm(o.reshape(B, T, H * K))
        return self.out_proj(y), {"S": S}
