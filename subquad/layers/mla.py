"""Multi-head latent attention (MLA; DeepSeek-V2, Kimi Linear's full-attention layers).

    q            = x W_q   or   rmsnorm(x W_qa) W_qb                      (B, T, H, N + R)  [q_nope, q_rope]
    [c, k_rope]  = x W_kva;  c = rmsnorm(c)                               latent (B, T, C) and a shared (B, T, R)
    [k_nope, v]  = c W_kvb                                                (B, T, H, N), (B, T, H, V)
    k            = [k_nope, k_rope repeated over heads]
    o            = softmax_attention(q, k, v, scale = (N + R)^-1/2);  y = W_o o

The decoding state caches the latent c and k_rope only - C + R numbers per token, against
H (N + R + V) for the expanded keys and values (Kimi Linear: 576 against 10,240 per layer and token).
A long call expands the cached latents (as transformers does); a short continuation of a cache - decoding -
attends in the latent space instead (DeepSeek-V2's absorbed form, the same sums reassociated):

    q_c = q_nope W_k^T  (B, T, H, C);  p = softmax(scale (q_c c^T + q_rope k_rope^T));  o = (p c) W_v^T

which costs O(L H (C + R)) per token where expanding the cache costs O(L C H (N + V)) - 50x less at Kimi
Linear's shapes. With ``rotary`` the R dims of q and k_rope rotate (DeepSeek); Kimi Linear's MLA has no
positions (``rotary=False``). ``head_gate``: one sigmoid gate per head from the layer's input on o before W_o
(Ling's, ``SoftmaxAttention``'s option).
"""

from __future__ import annotations

import torch
from torch import nn

from subquad.layers.attention import SoftmaxAttention
from subquad.layers.norm import RMSNorm
from subquad.layers.rotary import apply_rotary
from subquad.ops import KVCache
from subquad.ops.common.routes import ABSORBED_MAX_T


class LatentAttention(SoftmaxAttention):
    """MLA (see the module docstring).

    Recurrence: the cache grows by the latents (c_t, k_rope_t); o_t = softmax(q_t K^T scale) V over the keys
    and values the cached latents expand to. Args: d_model; n_heads H; kv_rank C; rope_dim R; nope_dim N (default
    d_model / H); v_head_dim V (default N); q_rank (None: a full W_q); latent_eps (the latents' RMS norm
    epsilon); rotary / rotary_base; mode; chunk_size.
    State: {"kv": a ``KVCache`` of the latents c (B, L, 1, C) and k_rope (B, L, 1, R)}."""

    keep_float = ("kv_b_proj",)     # read as a matrix by the absorbed form: quantisation leaves it (models.quant)

    def __init__(self, d_model: int, n_heads: int = 4, n_kv_heads: int | None = None, kv_rank: int = 64,
                 rope_dim: int = 16, nope_dim: int | None = None, v_head_dim: int | None = None,
                 q_rank: int | None = None, latent_eps: float = 1e-6, rotary: bool = True,
                 rotary_base: float = 10000.0, head_gate: bool = False, mode: str = "parallel", chunk_size: int = 64):
        nope = nope_dim or d_model // n_heads
        super().__init__(d_model, n_heads, rotary=False, head_dim=nope + rope_dim, head_gate=head_gate, mode=mode,
                         chunk_size=chunk_size)
        for name, v in (("kv_rank", kv_rank), ("rope_dim", rope_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if rotary and rope_dim % 2:
            raise ValueError(f"rope_dim={rope_dim} must be even to rotate")
        self.kv_rank, self.rope_dim, self.nope_dim = kv_rank, rope_dim, nope
        self.v_head_dim = v_head_dim or nope
        self.q_rank = q_rank
        self.rotary, self.rotary_base, self.rotary_dim = rotary, float(rotary_base), rope_dim
        H, Q = n_heads, nope + rope_dim
        del self.q_proj, self.k_proj, self.v_proj
        if q_rank is None:
            self.q_proj = nn.Linear(d_model, H * Q, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_rank, bias=False)
            self.q_a_norm = RMSNorm(q_rank, latent_eps)
            self.q_b_proj = nn.Linear(q_rank, H * Q, bias=False)
        self.kv_a_proj = nn.Linear(d_model, kv_rank + rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(kv_rank, latent_eps)
        self.kv_b_proj = nn.Linear(kv_rank, H * (nope + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_head_dim, d_model, bias=False)

    def mix_flops(self, T):
        """q k^T over (N + R) dims and p v over V, over the keys each query sees ((T + 1) / 2 on average);
        the latents' expansion (kv_b_proj) is counted as a projection, once per token."""
        return 2.0 * self.n_heads * (self.head_dim + self.v_head_dim) * (T + 1) / 2

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {"kv": KVCache.empty(batch_size, 1, self.kv_rank, self.rope_dim, dtype=dtype, device=device)}

    def _expand(self, c, k_rope):
        """Latents c (B, L, 1, C) and k_rope (B, L, 1, R) -> k (B, L, H, N + R), v (B, L, H, V)."""
        B, L = c.shape[:2]
        H, N = self.n_heads, self.nope_dim
        k_nope, v = self.kv_b_proj(c.reshape(B, L, -1)).view(B, L, H, N + self.v_head_dim).split(
            [N, self.v_head_dim], dim=-1)
        return torch.cat([k_nope, k_rope.expand(B, L, H, self.rope_dim)], dim=-1), v

    def mix(self, x, state, seq):
        B, T, _ = x.shape
        H, N = self.n_heads, self.nope_dim
        cache = None if state is None else state["kv"]
        q = self.q_proj(x) if self.q_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(B, T, H, N + self.rope_dim)
        c, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_norm(c).view(B, T, 1, -1), k_rope.reshape(B, T, 1, -1)
        if self.rotary:
            pos = seq.positions(T, 0 if cache is None else cache.next_position, x.device)
            q = torch.cat([q[..., :N], apply_rotary(q[..., N:], pos, self.rotary_base)], dim=-1)
            k_rope = apply_rotary(k_rope, pos, self.rotary_base)
        if cache is not None and len(cache) and T <= ABSORBED_MAX_T and seq.cu_seqlens is None:
            new = self._extend(cache, c, k_rope, seq)
            return self._out(self._absorbed(q, new), x), {"kv": new}
        k, v = self._expand(c, k_rope)
        o, _ = seq.attention(q, k, v, mode=self.mode, chunk_size=self.chunk_size,
                             initial_state=self._op_state(cache, seq))
        return self._out(o, x), {"kv": self._extend(cache, c, k_rope, seq)}

    def _out(self, o, x):
        """o (B, T, H, V), gated per head with ``head_gate``, -> W_o o (B, T, d_model)."""
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)
        return self.o_proj(o.flatten(2))

    def _absorbed(self, q, cache):
        """Attention of q (B, T, H, N + R) - the last T tokens of ``cache`` - over the cached latents, in the
        latent space (module doc): (B, T, H, V)."""
        B, T, H, _ = q.shape
        N, R, C, V = self.nope_dim, self.rope_dim, self.kv_rank, self.v_head_dim
        W = self.kv_b_proj.weight.view(H, N + V, C)
        q_c = torch.einsum("bthn,hnc->bhtc", q[..., :N], W[:, :N]).reshape(B, H * T, C)
        q_r = q[..., N:].transpose(1, 2).reshape(B, H * T, R)
        c, kr = cache.k[:, :, 0], cache.v[:, :, 0]                         # (B, L, C), (B, L, R)
        L = c.shape[1]
        s = (q_c @ c.transpose(1, 2) + q_r @ kr.transpose(1, 2)).view(B, H, T, L) * (N + R) ** -0.5
        cols = torch.arange(L, device=q.device)
        allowed = cols.view(1, L) <= (L - T + torch.arange(T, device=q.device)).view(T, 1)    # causal
        km = cache.key_mask()
        allowed = allowed.view(1, 1, T, L) if km is None else allowed.view(1, 1, T, L) & km.view(B, 1, 1, L)
        s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32)).to(c.dtype)
        o_c = (p.view(B, H * T, L) @ c).view(B, H, T, C)
        return torch.einsum("bhtc,hvc->bthv", o_c, W[:, N:])

    def _op_state(self, cache, seq):
        """The cached latents expanded to the heads' keys and values (per sequence when packed)."""
        if cache is None:
            return None
        if seq.cu_seqlens is not None:
            return [KVCache(*self._expand(c.k, c.v), seen=c.seen) for c in cache.unstack()]
        if not len(cache) and not cache.ragged:
            return None
        return KVCache(*self._expand(cache.k, cache.v), seen=cache.seen, pad=cache.pad, row_seen=cache.row_seen)
