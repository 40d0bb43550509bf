"""Shared transformer blocks (Zyphra's Zamba2, arXiv:2411.15242, after Zamba, arXiv:2405.16712): a few
attention + MLP blocks whose weights serve several layers of a Mamba-2 stack, each use with LoRA adapters of
its own. ``ModelConfig.shared`` lists the layers that use one; use j takes block j mod ``blocks``. There:

    u = rmsnorm([h, e])                              e the token embeddings, h the stream: (B, T, 2D)
    a = attn_b(u)        q, k, v = (W_b + B_j A_j) u      use j's adapters on q, k, v (``attention_adapter``)
    t = W_j mlp_b(rmsnorm(a))   gate, up = (W_b + B_j A_j) x   use j's adapter on the MLP's gate and up
    h = h + mixer(rmsnorm(h + t))                    the layer's own mixer (``lm.SharedUseBlock``)

The attention reads 2D and writes D, in heads of 2D / n_heads dims, its scores scaled by ``scale`` (Zamba2:
(head_dim / 2)^-1/2), rotary with ``rotary`` and without positions otherwise. The MLP is gated (``act``:
GeLU for Zamba2) and has no residual: t enters only the mixer's input.

The blocks are the model's (``LanguageModel.shared``), one parameter object per weight: a use refers to its
block without holding it as a submodule, so the state dict names each shared weight once (``shared.{b}.*``)
and each use's own weights under its layer (``blocks.{i}.use.*``). Each use is a mixer (``SharedUse``)
with its own decoding state: a KV cache per use, not per block.
"""

from __future__ import annotations

import torch
from torch import nn

from subquad.layers.attention import SoftmaxAttention
from subquad.layers.base import Mixer
from subquad.layers.mlp import ACTS, SwiGLU
from subquad.layers.norm import RMSNorm

EMBEDDINGS = "embeddings"      # the carry entry the uses read: the embedded tokens (B, T, D) (lm.LanguageModel._carry)
DEFAULTS = {"blocks": 1, "hidden": None, "act": "gelu", "rotary": False, "rotary_base": 10000.0, "scale": None,
            "adapter_rank": 0, "attention_adapter": False}


def check_shared(s, n_layers: int) -> dict:
    """The ``ModelConfig.shared`` option with its defaults filled in; ValueError naming the key otherwise.

    layers (required) the layers that use a block, in order; blocks: how many blocks (use j takes j mod blocks);
    hidden: the MLP's width (None: the model's ``mlp_hidden``); act: "gelu", "gelu_tanh" or "silu"; rotary,
    rotary_base; scale: the attention scores' (None: head_dim^-1/2); adapter_rank: the LoRA adapters' rank on
    the MLP's gate and up (0: none); attention_adapter: adapters of that rank on q, k and v too."""
    if not isinstance(s, dict) or "layers" not in s:
        raise ValueError(f"shared must be a dict like {{'layers': [2, 5], 'blocks': 1}} or None, got {s!r}")
    unknown = set(s) - set(DEFAULTS) - {"layers"}
    if unknown:
        raise ValueError(f"unknown shared keys {sorted(unknown)}; known: layers, {', '.join(DEFAULTS)}")
    s = {**DEFAULTS, **s}
    layers = s["layers"]
    if not isinstance(layers, (list, tuple)) or not layers or len(set(layers)) != len(layers) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers for i in layers):
        raise ValueError(f"shared['layers'] must be distinct layer indices in [0, {n_layers}), got {layers!r}")
    s["layers"] = sorted(layers)
    for key, low in (("blocks", 1), ("adapter_rank", 0)):
        if isinstance(s[key], bool) or not isinstance(s[key], int) or s[key] < low:
            raise ValueError(f"shared['{key}'] must be an int >= {low}, got {s[key]!r}")
    hidden = s["hidden"]
    if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1):
        raise ValueError(f"shared['hidden'] must be a positive int or None, got {s['hidden']!r}")
    if s["act"] not in ACTS:
        raise ValueError(f"shared['act'] must be one of {', '.join(ACTS)}, got {s['act']!r}")
    for key in ("rotary", "attention_adapter"):
        if not isinstance(s[key], bool):
            raise ValueError(f"shared['{key}'] must be a bool, got {s[key]!r}")
    if s["attention_adapter"] and not s["adapter_rank"]:
        raise ValueError("shared['attention_adapter'] needs an adapter_rank >= 1")
    for key in ("rotary_base", "scale"):
        v = s[key]
        if (v is not None or key == "rotary_base") and (isinstance(v, bool) or not isinstance(v, (int, float))
                                                        or not 0 < v < float("inf")):
            raise ValueError(f"shared['{key}'] must be a positive number, got {v!r}")
    return s


class SharedTransformer(nn.Module):
    """One shared block: ``norm1`` (2D), ``attn`` (2D -> D), ``norm2`` (D), ``mlp`` (a gated MLP); run by its
    uses (``SharedUse``), never by itself."""

    def __init__(self, cfg):
        super().__init__()
        s, D = cfg.shared, cfg.d_model
        self.d_model = D
        self.norm1 = RMSNorm(2 * D, cfg.norm_eps)
        self.attn = SoftmaxAttention(2 * D, cfg.n_heads, cfg.n_kv_heads, rotary=s["rotary"],
                                     rotary_base=s["rotary_base"], scale=s["scale"], d_out=D)
        self.norm2 = RMSNorm(D, cfg.norm_eps)
        self.mlp = SwiGLU(D, s["hidden"] or cfg.mlp_hidden, s["act"])


def _lora(d_in: int, rank: int, d_out: int) -> nn.Sequential:
    """x -> B A x, A (rank, d_in), B (d_out, rank): a LoRA adapter (Hu et al. 2021, arXiv:2106.09685)."""
    return nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))


class SharedUse(Mixer):
    """One use of a shared block (module doc): h (B, T, D) and the embeddings (from ``carry``) -> t (B, T, D).
    Its own weights: the adapters (``q_adapter``, ``k_adapter``, ``v_adapter``, ``mlp_adapter``; None without)
    and ``proj``. State: {"kv": this use's KV cache} (``SoftmaxAttention``'s)."""

    uses_carry = True

    def __init__(self, shared: SharedTransformer, adapter_rank: int = 0, attention_adapter: bool = False):
        attn = shared.attn
        super().__init__(shared.d_model, attn.mode, attn.chunk_size)
        self._shared = (shared,)                  # a reference, not a submodule: the model holds the block once
        D, r = shared.d_model, adapter_rank
        self.q_adapter, self.k_adapter, self.v_adapter = (
            [_lora(2 * D, r, p.out_features) for p in (attn.q_proj, attn.k_proj, attn.v_proj)] if attention_adapter
            else (None, None, None))
        self.mlp_adapter = _lora(D, r, 2 * shared.mlp.w_up.out_features) if r else None
        self.proj = nn.Linear(D, D, bias=False)

    @property
    def shared(self) -> SharedTransformer:
        return self._shared[0]

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return self.shared.attn.empty_state(batch_size, device=device, dtype=dtype)

    def mix_flops(self, T):
        return 0.0                                # the attention's are in the shared block's count

    def flops_per_token(self, T: int) -> float:
        """Its own projections, and the shared block's weights and attention, which this use runs."""
        s = self.shared
        return (super().flops_per_token(T) + s.attn.flops_per_token(T)
                + 2.0 * sum(p.numel() for p in s.mlp.parameters() if p.dim() == 2))

    def mix(self, x, state, seq, carry):
        if not carry or EMBEDDINGS not in carry:
            raise ValueError("a shared block's use reads the token embeddings from the model's carry "
                             f"(carry[{EMBEDDINGS!r}]); it runs inside a LanguageModel")
        s = self.shared
        u = s.norm1(torch.cat([x, carry[EMBEDDINGS]], -1))                    # (B, T, 2D)
        q, k, v = s.attn.project(u)
        if self.q_adapter is not None:
            q, k, v = q + self.q_adapter(u), k + self.k_adapter(u), v + self.v_adapter(u)
        a, state = s.attn.attend(q, k, v, state, seq)                         # (B, T, D)
        a = s.norm2(a)
        gate, up = s.mlp.w_gate(a), s.mlp.w_up(a)
        if self.mlp_adapter is not None:
            dg, du = self.mlp_adapter(a).chunk(2, -1)
            gate, up = gate + dg, up + du
        return self.proj(s.mlp.w_down(s.mlp.act(gate) * up)), state
