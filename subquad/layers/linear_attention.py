"""Linear attention layer (Katharopoulos et al. 2020) with a selectable feature map.

    q, k = phi(x W_q), phi(x W_k)   (B, T, H, K') ;  v = x W_v  (B, T, H, V)
    o    = linear_attention(q, k, v)              (normalised: phi(q) S / phi(q) z)
    y    = W_o o

``conv_size`` > 0 puts a short causal convolution (with silu) on the projections x W_q, x W_k, x W_v
before the feature map, as fla's ``use_short_conv`` and Zoology's protocol do: it lets one layer bind a
token to its neighbours (a key to the value after it), which MQAR needs; 0 (the default) is the paper's.

``feature_map`` is any name in ``subquad.ops.FEATURE_MAPS``; ``qk_dim`` projects
q and k to a smaller dim first (Based uses 16 with the Taylor map, whose feature
dim is 1 + d + d^2).
"""

from __future__ import annotations

import torch
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.conv import ShortConv
from subquad.ops import feature_map as make_feature_map
from subquad.ops import linear_attention


class LinearAttention(Mixer):
    """Linear attention: S_t = S_{t-1} + phi(k_t) v_t^T, o_t = phi(q_t) S_t (/ phi(q_t) z_t when normalised).

    Args: d_model; n_heads; feature_map (a name in ``subquad.ops.FEATURE_MAPS``); normalize (performer
    needs it); qk_dim (project q and k to this dim first; Based uses 16 with taylor); num_features
    (performer's random features); conv_size (0: none; else a short convolution on q, k, v); mode;
    chunk_size.
    State: {"S": (B, H, F, V)} plus {"z": (B, H, F)} when normalised, F the feature dim; float32 (float64
    for float64); plus {"conv": (B, conv_size - 1, 2 H qk_dim + d_model)} with a convolution.
    """
    piece_size = 2048   # fixed state: long forwards run in pieces (base.Mixer.forward); bench_pieces.py's best
    def __init__(self, d_model: int, n_heads: int = 4, feature_map: str = "elu+1", normalize: bool = True,
                 qk_dim: int | None = None, num_features: int = 64, conv_size: int = 0, mode: str = "chunk",
                 chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must divide by n_heads={n_heads}")
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qk_dim = qk_dim or self.head_dim
        self.normalize = normalize
        if feature_map == "performer" and not normalize:
            raise ValueError("feature_map='performer' needs normalize=True: its per-query stabiliser exp(-max) "
                             "cancels only in the normalised ratio; unnormalised, every output row would be "
                             "scaled by it")
        kw = {"num_features": num_features} if feature_map == "performer" else {}
        self.phi = make_feature_map(feature_map, head_dim=self.qk_dim, **kw)
        self.feature_dim = self.phi.out_dim(self.qk_dim)
        self.q_proj = nn.Linear(d_model, n_heads * self.qk_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_heads * self.qk_dim, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.conv = ShortConv(2 * n_heads * self.qk_dim + d_model, conv_size, bias=False) if conv_size else None

    def mix_flops(self, T):
        """The write phi(k) v^T and the read phi(q) S per head, F x V (the normaliser's z and phi(q) z are one
        more value column, of ones), and the feature map of q and k (the performer's projection)."""
        F_, V = self.feature_dim, self.head_dim + (1 if self.normalize else 0)
        return self.n_heads * (4.0 * F_ * V + 2 * self.phi.flops(self.qk_dim))

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        S = self.zeros(batch_size, self.n_heads, self.feature_dim, self.head_dim, device=device, dtype=dtype)
        state = {"S": S}
        if self.normalize:
            state["z"] = self.zeros(batch_size, self.n_heads, self.feature_dim, device=device, dtype=dtype)
        return self.with_conv(state, batch_size=batch_size, device=device, dtype=dtype)

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        H = self.n_heads
        (q, k, v), conv = self.conv_projections([self.q_proj(x), self.k_proj(x), self.v_proj(x)], state, seq)
        q = self.phi(q.view(B, T, H, self.qk_dim), is_query=True).to(x.dtype)
        k = self.phi(k.view(B, T, H, self.qk_dim)).to(x.dtype)
        v = v.view(B, T, H, self.head_dim)
        init = None if state is None else ((state["S"], state["z"]) if self.normalize else state["S"])
        o, s = seq.recurrence(linear_attention, q, k, v, normalize=self.normalize, mode=self.mode,
                              chunk_size=self.chunk_size, initial_state=init)
        new = {"S": s[0], "z": s[1]} if self.normalize and s is not None else {"S": s}
        return self.o_proj(o.reshape(B, T, -1)), self.with_conv(new, conv)
