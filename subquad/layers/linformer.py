"""Linformer layer (Wang et al. 2020): softmax attention over keys and values projected to k rows along time.

An encoder layer: ``forward(x)`` sees the whole sequence; there is no causal form
and no decoding state (``forward(x, state)`` raises). In the table of mechanisms
as ``linformer``, declared ``encoder_only``: language-model patterns refuse it.
"""

from __future__ import annotations

import torch
from torch import nn

from subquad.layers.base import Mixer
from subquad.ops.linformer import linformer_attention


class Linformer(Mixer):
    """Linformer: softmax attention over keys and values projected to k rows along time (encoder only).

        o_t = softmax(q_t (E K)^T / sqrt(K)) (F V)       E, F (k, T): every position's keys, future included

    Args: d_model; n_heads; max_len (longest sequence the projections cover); k (projected length);
    share_heads; share_kv. State: none - there is no causal or recurrent form, and ``empty_state`` says so.
    """
    def __init__(self, d_model: int, n_heads: int = 4, max_len: int = 1024, k: int = 256, share_heads: bool = True,
                 share_kv: bool = False):
        super().__init__(d_model, "parallel", 64)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must divide by n_heads={n_heads}")
        self.n_heads, self.head_dim, self.max_len, self.k = n_heads, d_model // n_heads, max_len, k
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        shape = (k, max_len) if share_heads else (n_heads, k, max_len)
        self.E = nn.Parameter(torch.randn(shape) / k ** 0.5)
        self.F = self.E if share_kv else nn.Parameter(torch.randn(shape) / k ** 0.5)

    def mix_flops(self, T: int) -> float:
        """E K and F V (k rows from T tokens), q K'^T and p V' (k keys per query): 2 k d_model each."""
        return 8.0 * self.k * self.d_model

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        raise ValueError("Linformer is an encoder mechanism: it has no decoding state")

    def mix(self, x, state, seq):
        if state is not None:
            raise ValueError("Linformer cannot decode token by token: it has no recurrent state or causal form")
        if not seq.whole_sequence or seq.cu_seqlens is not None:
            raise ValueError("Linformer projects the whole sequence at once: it takes no shard of a sequence and "
                             "no packed sequences (cu_seqlens)")
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        q, k, v = (p(x).view(B, T, H, K) for p in (self.q_proj, self.k_proj, self.v_proj))
        o, _ = linformer_attention(q, k, v, self.E, self.F)
        return self.o_proj(o.reshape(B, T, H * K)), None
