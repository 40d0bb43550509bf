"""``zamba`` (ZambaForCausalLM, Zyphra's Zamba v1, arXiv:2405.16712): multi-head Mamba layers (``n_mamba_heads``:
d_inner in heads, each with its own x_proj and dt_proj - ``layers.mamba.Mamba``'s ``heads``), and at the "hybrid"
layers of ``layers_block_type`` one shared attention + MLP block over [h, embeddings] whose output, projected by
the layer's ``linear``, enters that layer's Mamba input - Zamba2's structure (``models.shared``, ``zamba2.py``)
with one block, no LoRA adapters and no positions. The attention reads 2 hidden_size in heads of 2 hidden_size /
num_attention_heads dims, scores scaled by (head_dim / 2)^-1/2; the MLP is gated by ``hidden_act``.

The checkpoint's Mamba in_proj interleaves x and the gate row by row (row 2c: x's channel c, row 2c + 1: the
gate's, as transformers' ``view(B, -1, 2, T)`` reads it) and holds A_log (heads, d_inner / heads, N) and D
(heads, d_inner / heads) per head: ``unpack`` de-interleaves and flattens them, ``pack`` undoes it. The shared
block is named under the first hybrid layer (``model.layers.{L}.shared_transf.*``), the others being
transformers' aliases of it (``zamba2.py``'s handling of aliases).
"""

from __future__ import annotations

import math

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import require
from subquad.models.hf.zamba2 import ACTS, SHARED, Zamba2Format, layer_types

ZAMBA_SHARED = {**SHARED, "mlp.w_gate.weight": "feed_forward.gate_proj.weight",
                "mlp.w_up.weight": "feed_forward.up_proj.weight"}


def default_types(c: dict) -> list:
    """transformers' default ``layers_block_type``: two Mamba layers, a hybrid one, then a hybrid layer at every
    i % attn_layer_period == attn_layer_offset of the rest."""
    period, offset = c.get("attn_layer_period", 6), c.get("attn_layer_offset", 4)
    if period < 1:
        raise ValueError(f"config field attn_layer_period={period} must be at least 1")
    return ["mamba", "mamba", "hybrid"] + ["hybrid" if i % period == offset else "mamba"
                                           for i in range(c.get("num_hidden_layers", 76) - 3)]


class ZambaFormat(Zamba2Format):
    model_type = "zamba"
    shared_key = "shared_transf"
    shared_names = ZAMBA_SHARED
    fused_gate_up = False
    conv_bias_key = "mamba_conv_bias"

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_mamba_act", "silu")
        require(c, "mamba_proj_bias", False)
        act = c.get("hidden_act", "gelu")
        if act not in ACTS:
            raises = ", ".join(ACTS)
            raise ValueError(f"config field hidden_act={act!r} is not supported (subquad implements {raises})")
        if c.get("layers_block_type") is None:
            c = type(c)({**c, "layers_block_type": default_types(c)}, getattr(c, "where", "config.json"))
        types = layer_types(c)
        H, heads = c["hidden_size"], c.get("num_attention_heads", 16)
        kv = c.get("num_key_value_heads") or heads
        if (2 * H) % heads or heads % kv:
            raise ValueError(f"config field num_attention_heads={heads} must divide 2 hidden_size = {2 * H}, and "
                             f"num_key_value_heads={kv} divide it")
        for key, want in (("attention_hidden_size", 2 * H), ("attention_head_dim", 2 * H // heads)):
            if c.get(key) not in (None, want):
                raise ValueError(f"config field {key}={c[key]} is not supported (subquad's shared attention reads "
                                 f"[h, embeddings], {2 * H} wide, in heads of {2 * H // heads} dims)")
        E, mheads = c.get("mamba_expand", 2), c.get("n_mamba_heads", 2)
        if mheads < 1 or E * H % mheads:
            raise ValueError(f"config field n_mamba_heads={mheads} must divide mamba_expand x hidden_size = {E * H}")
        rank = c.get("mamba_dt_rank", "auto")
        rank = math.ceil(H / 16) if rank == "auto" else rank
        mamba = {"d_state": c.get("mamba_d_state", 16), "expand": E, "conv_size": c.get("mamba_d_conv", 4),
                 "dt_rank": rank, "heads": mheads}
        hybrid = [i for i, t in enumerate(types) if t == "hybrid"]
        shared = None if not hybrid else {
            "layers": hybrid, "blocks": 1, "hidden": c.get("intermediate_size", 14848), "act": ACTS[act],
            "rotary": False, "scale": (2 * H // heads / 2) ** -0.5, "adapter_rank": 0, "attention_adapter": False}
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=len(types), n_heads=heads, n_kv_heads=kv,
                           pattern="mamba", mlp=False, norm_eps=c.get("rms_norm_eps", 1e-5),
                           tie_embeddings=c.get("tie_word_embeddings", True), context_length=1 << 20,
                           mixer_options={"mamba": mamba}, shared=shared)

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """Aliases read once (``Zamba2Format.unpack``); in_proj de-interleaved, A_log and D flattened over heads."""
        out = super().unpack(tensors, cfg, dtype)
        for name, t in out.items():
            if name.endswith("mamba.in_proj.weight"):
                if t.shape[0] % 2:
                    raise ValueError(f"zamba: {name} has shape {tuple(t.shape)}; it interleaves x and the gate, an "
                                     "even number of rows")
                out[name] = torch.cat([t[0::2], t[1::2]], 0)
            elif name.endswith(("mamba.A_log", "mamba.D")) and t.dim() >= 2:
                out[name] = t.flatten(0, 1)
        return out

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        out = super().pack(tensors, cfg)
        heads = cfg.mixer_options.get("mamba", {}).get("heads", 1)
        for name, t in out.items():
            if name.endswith("mamba.in_proj.weight"):
                out[name] = torch.stack(t.chunk(2, 0), 1).flatten(0, 1)          # rows x0, z0, x1, z1, ...
            elif name.endswith(("mamba.A_log", "mamba.D")):
                out[name] = t.unflatten(0, (heads, -1))
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o, s = opts["mamba"], cfg.shared
        layers = set() if s is None else set(s["layers"])
        out = {"model_type": "zamba", "architectures": ["ZambaForCausalLM"], "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
               "layers_block_type": ["hybrid" if i in layers else "mamba" for i in range(cfg.n_layers)],
               "mamba_d_state": o["d_state"], "mamba_d_conv": o["conv_size"], "mamba_expand": o["expand"],
               "mamba_dt_rank": o["dt_rank"], "n_mamba_heads": o["heads"], "mamba_conv_bias": True,
               "mamba_proj_bias": False, "hidden_mamba_act": "silu", "num_attention_heads": cfg.n_heads,
               "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "rms_norm_eps": cfg.norm_eps,
               "attention_hidden_size": 2 * cfg.d_model, "attention_head_dim": 2 * cfg.d_model // cfg.n_heads,
               "tie_word_embeddings": cfg.tie_embeddings}
        if s is not None:
            out.update({"intermediate_size": s["hidden"] or cfg.mlp_hidden,
                        "hidden_act": next(k for k, v in ACTS.items() if v == s["act"])})
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        o, s = opts.get("mamba"), cfg.shared
        return (cfg.layers == ["mamba"] * cfg.n_layers and not cfg.mlp and cfg.moe is None and cfg.pos_emb == "none"
                and not cfg.parallel and not cfg.post_norm and cfg.scaled_residual is None
                and o["bcdt_rms_eps"] is None and (2 * cfg.d_model) % cfg.n_heads == 0
                and s is not None and s["blocks"] == 1 and s["adapter_rank"] == 0 and not s["rotary"]   # transformers'
                and s["scale"] is not None                                  # Zamba needs a hybrid layer to run
                and math.isclose(s["scale"], (cfg.d_model / cfg.n_heads) ** -0.5, rel_tol=1e-12))
