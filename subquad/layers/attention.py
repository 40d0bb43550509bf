"""Softmax attention layer: rotary positions, grouped-query attention, optional sliding window.

    q = rotary(x W_q) (B, T, H, K);  k, v = rotary(x W_k), x W_v  (B, T, H_kv, K)
    o = softmax_attention(q, repeat(k), repeat(v), window=W);   y = W_o o

Checkpoints' variants are options: ``head_dim`` other than d_model / n_heads (Qwen3-Next: 256), RMS norms
on q and k before the rotation (``qk_norm="head"``: per head, Qwen3; ``"all"``: over all heads' dims,
OLMo-2/OLMo-Hybrid), a sigmoid output gate (``output_gate``: Qwen3-Next's gated attention - W_q
writes each head's query and then its gate, o_h = o_h * sigmoid(gate_h) before W_o), one sigmoid gate per head
(``head_gate``: LFM3's, o_h = o_h * sigmoid(W_g x)_h, a scalar per head and token from the layer's input), a bias on W_o
(``o_bias``: RecurrentGemma's local attention), a scale on the scores other than K^-1/2 and an output
width other than the input's (``scale``, ``d_out``: Zamba2's shared attention, ``models.shared``).

The decoding state is a KVCache of the H_kv key/value heads only, so grouped-query
attention (n_kv_heads < n_heads) shrinks the cache by n_heads / n_kv_heads; with a
window W it holds the last W tokens. Default mode is "parallel" (SDPA), the fast
form of softmax attention at training lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from subquad.layers.base import Mixer
from subquad.layers.norm import RMSNorm
from subquad.layers.rotary import apply_rotary
from subquad.layers.sequence import SingleDevice
from subquad.ops import KVCache

GQA_SDPA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)     # SDPA's enable_gqa


class SoftmaxAttention(Mixer):
    """Causal softmax attention with rotary positions, grouped-query heads and an optional sliding window.

    Recurrence: the KV cache grows by (k_t, v_t); o_t = softmax(q_t K^T / sqrt(K)) V over the keys it sees.
    Args: d_model; n_heads; n_kv_heads (grouped-query attention, default n_heads); window W (a query sees
    itself and the W tokens before it; the cache keeps W); rotary (False: no positions at all, as Jamba's
    attention layers); rotary_base (RoPE's theta); rotary_fraction (the leading fraction of each head's dims
    that rotate: Bamba's partial rotary 0.5); mode ("parallel": SDPA, "chunk":
    blockwise online softmax; both O(T W) with a window); chunk_size; head_dim (default d_model / n_heads);
    qk_norm (None, "head" or "all") with qk_norm_eps; output_gate; head_gate (``g_proj``: d_model -> n_heads); o_bias (a bias on the output projection);
    scale (the scores', default K^-1/2); d_out (the output width, default d_model).
    ``mix`` is ``attend(*project(x))``: a caller that adds to q, k, v (``models.shared``'s adapters) calls the two.
    State: {"kv": a ``KVCache`` of k (B, L, n_kv_heads, K) and v (B, L, n_kv_heads, K)}, L the tokens seen
    (at most W with a window). A state passed in is never modified (the layer appends to a fork).
    """
    def __init__(self, d_model: int, n_heads: int = 4, n_kv_heads: int | None = None, window: int | None = None,
                 rotary: bool = True, rotary_base: float = 10000.0, rotary_fraction: float = 1.0,
                 head_dim: int | None = None, qk_norm: str | None = None, qk_norm_eps: float = 1e-6,
                 output_gate: bool = False, o_bias: bool = False, scale: float | None = None,
                 d_out: int | None = None, head_gate: bool = False, mode: str = "parallel", chunk_size: int = 64):
        super().__init__(d_model, mode, chunk_size)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        if head_dim is None and d_model % n_heads:
            raise ValueError(f"d_model={d_model} must divide by n_heads={n_heads} (or give head_dim)")
        if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
            raise ValueError(f"head_dim must be a positive int or None, got {head_dim!r}")
        if qk_norm not in (None, "head", "all"):
            raise ValueError(f"qk_norm must be None, 'head' or 'all', got {qk_norm!r}")
        if not isinstance(output_gate, bool):
            raise ValueError(f"output_gate must be a bool, got {output_gate!r}")
        if not isinstance(head_gate, bool):
            raise ValueError(f"head_gate must be a bool, got {head_gate!r}")
        if not isinstance(o_bias, bool):
            raise ValueError(f"o_bias must be a bool, got {o_bias!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
            raise ValueError(f"scale must be a positive number or None (K^-1/2), got {scale!r}")
        if d_out is not None and (isinstance(d_out, bool) or not isinstance(d_out, int) or d_out < 1):
            raise ValueError(f"d_out must be a positive int or None (d_model), got {d_out!r}")
        if n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
            raise ValueError(f"window must be a non-negative int or None, got {window!r}")
        self.head_dim = head_dim or d_model // n_heads
        self.qk_norm, self.output_gate = qk_norm, output_gate
        self.scale = None if scale is None else float(scale)
        self.window, self.rotary, self.rotary_base = window, rotary, float(rotary_base)
        self.rotary_dim = int(self.head_dim * rotary_fraction)
        if rotary and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_fraction={rotary_fraction} of head dim {self.head_dim} must give an even "
                             f"number of rotating dims in (0, {self.head_dim}]")
        K, Hk = self.head_dim, self.n_kv_heads
        self.q_proj = nn.Linear(d_model, n_heads * K * (2 if output_gate else 1), bias=False)
        self.k_proj = nn.Linear(d_model, Hk * K, bias=False)
        self.v_proj = nn.Linear(d_model, Hk * K, bias=False)
        self.o_proj = nn.Linear(n_heads * K, d_out or d_model, bias=o_bias)
        self.head_gate = head_gate
        self.g_proj = nn.Linear(d_model, n_heads, bias=False) if head_gate else None
        if qk_norm is not None:
            self.q_norm = RMSNorm(K if qk_norm == "head" else n_heads * K, qk_norm_eps)
            self.k_norm = RMSNorm(K if qk_norm == "head" else Hk * K, qk_norm_eps)

    def mix_flops(self, T):
        """q k^T and p v over the keys each query sees, on average over T queries: (T + 1) / 2 causally; with
        a window W, query t sees min(t + 1, W + 1) keys, (W + 1)(T - W / 2) / T on average once T > W + 1."""
        W = self.window
        seen = (T + 1) / 2 if W is None or T <= W + 1 else (W + 1) * (T - W / 2) / T
        return 4.0 * self.n_heads * self.head_dim * seen

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"kv": KVCache.empty(batch_size, self.n_kv_heads, self.head_dim, self.head_dim, dtype=dtype,
                                    device=device, window=self.window)}

    def _repeat(self, x):
        rep = self.n_heads // self.n_kv_heads
        return x if rep == 1 else x.repeat_interleave(rep, dim=2)

    def mix(self, x, state, seq):
        return self.attend(*self.project(x), state, seq, x)

    def project(self, x):
        """x (B, T, d_model) -> W_q x (B, T, H K; 2 H K with the output gate), W_k x, W_v x (B, T, H_kv K)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def attend(self, q, k, v, state, seq, x=None):
        """The projections (``project``) -> (y (B, T, d_out), state): gate, norms, rotation, attention, W_o
        (``x``: the layer's input, which the head gate reads)."""
        B, T, _ = q.shape
        H, Hk, K = self.n_heads, self.n_kv_heads, self.head_dim
        cache = None if state is None else state["kv"]
        v = v.view(B, T, Hk, K)
        gate = None
        if self.output_gate:                              # per head: its query's K dims, then its gate's
            q, gate = q.view(B, T, H, 2 * K).chunk(2, dim=-1)
        if self.qk_norm == "all":
            q, k = self.q_norm(q.reshape(B, T, H * K)), self.k_norm(k)
        q, k = q.reshape(B, T, H, K), k.view(B, T, Hk, K)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            pos = seq.positions(T, 0 if cache is None else cache.next_position, q.device)
            q = apply_rotary(q, pos, self.rotary_base, self.rotary_dim)
            k = apply_rotary(k, pos, self.rotary_base, self.rotary_dim)
        new = self._extend(cache, k, v, seq)              # a fork: ``cache`` itself keeps its entries
        if self._one_token(q, cache, seq):
            mask = new.key_mask()                         # a ragged cache: each row's left padding masked
            o = F.scaled_dot_product_attention(q.transpose(1, 2), new.k.transpose(1, 2), new.v.transpose(1, 2),
                                               attn_mask=None if mask is None else mask[:, None, None, :],
                                               scale=self.scale, enable_gqa=H != Hk).transpose(1, 2)
        else:
            o, _ = seq.attention(q, self._repeat(k), self._repeat(v), window=self.window, mode=self.mode,
                                 chunk_size=self.chunk_size, scale=self.scale,
                                 initial_state=self._op_state(cache, seq))
        if gate is not None:
            o = o * torch.sigmoid(gate)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)           # (B, T, H, 1)
        return self.o_proj(o.reshape(B, T, H * K)), {"kv": new}

    def _one_token(self, q, cache, seq) -> bool:
        """Whether this call is one decoding token against a cache without a window - rows of one length, or a
        ragged batch (left-padded rows: the padding masked) -, no packing, one process, no gradient, a positive
        scale (the op folds a scale <= 0 into q): then SDPA reads the appended cache directly, the grouped heads
        through ``enable_gqa`` (torch >= 2.5), where the op's route repeats the cached keys and values for every
        query head, concatenates the new token and builds a mask (a layer step at d_model 768, 12 heads over 4,
        256 cached tokens: 1.5 -> 0.85 ms). Not while compiling (the decoding graph keeps the op).
        ``seq.attention`` stays the reference (tests/layers/test_attention_one_token.py)."""
        return (q.shape[1] == 1 and cache is not None and len(cache) > 0
                and cache.window is None and self.window is None and seq.cu_seqlens is None
                and type(seq) is SingleDevice and not torch.is_grad_enabled() and GQA_SDPA
                and (self.scale is None or self.scale > 0) and not torch.compiler.is_compiling())

    def _op_state(self, cache, seq):
        """The cache as the op takes it: query heads' keys and values (grouped heads repeated); with packed
        sequences, one one-row cache per sequence."""
        if cache is None:
            return None
        if seq.cu_seqlens is not None:
            return [KVCache(self._repeat(c.k), self._repeat(c.v), window=self.window, seen=c.seen)
                    for c in cache.unstack()]
        if not len(cache) and not cache.ragged:
            return None
        return KVCache(self._repeat(cache.k), self._repeat(cache.v), window=self.window, seen=cache.seen,
                       pad=cache.pad, row_seen=cache.row_seen)

    def _extend(self, cache, k, v, seq):
        """The cache after this call: k, v themselves, or the cache's keys and values followed by them."""
        if seq.cu_seqlens is not None:                    # packed: each sequence's own cache, stacked ragged
            olds = [None] * len(seq.lengths) if cache is None else cache.unstack()
            news = [KVCache(ki, vi, window=self.window) if c is None else
                    KVCache(torch.cat([c.k, ki], 1), torch.cat([c.v, vi], 1), window=self.window,
                            seen=c.seen + ki.shape[1])
                    for c, ki, vi in zip(olds, k.split(seq.lengths, 1), v.split(seq.lengths, 1))]
            return KVCache.stack(news)
        if cache is None:
            return KVCache(k, v, window=self.window)
        if torch.is_grad_enabled() and (k.requires_grad or cache.k.requires_grad):
            T = k.shape[1]
            return KVCache(torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1), window=self.window,
                           seen=cache.seen + T, pad=cache.pad,
                           row_seen=None if cache.row_seen is None else cache.row_seen + T)
        return cache.fork().append(k, v)   # decoding: amortised O(1) per token; the caller's cache unchanged
