"""``jamba`` (JambaForCausalLM): Mamba layers with weighted RMS norms on dt, B and C, softmax attention without
positional encoding at every ``attn_layer_period``-th layer from ``attn_layer_offset``, and after each a SwiGLU
MLP - a top-k mixture of experts at every ``expert_layer_period``-th layer from ``expert_layer_offset``."""

from __future__ import annotations

import math

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (HYBRID_BLOCK, HYBRID_TOP, Format, check_hybrid, plain_attention, plain_moe,
                                      transformer_config)


def attention_period(indices: list, n: int):
    """(period, offset) with ``i % period == offset`` exactly for ``indices`` among range(n), or None."""
    if not indices:
        return n + 1, n                               # never: no layer index reaches n
    for period in range(1, n + 1):
        offset = indices[0] % period
        if [i for i in range(n) if i % period == offset] == indices:
            return period, offset
    return None


class JambaFormat(Format):
    model_type = "jamba"
    conv_bias_key = "mamba_conv_bias"
    top = HYBRID_TOP
    layers = {"softmax": {"mixer.{p}": "self_attn.{p}"},
              "mamba": {"mixer.conv.{p}": "mamba.conv1d.{p}",
                        "mixer.bcdt_norms.dt_norm.weight": "mamba.dt_layernorm.weight",
                        "mixer.bcdt_norms.b_norm.weight": "mamba.b_layernorm.weight",
                        "mixer.bcdt_norms.c_norm.weight": "mamba.c_layernorm.weight",
                        "mixer.{p}": "mamba.{p}"},
              "*": HYBRID_BLOCK}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        check_hybrid(c)
        H, n = c["hidden_size"], c["num_hidden_layers"]
        period, offset = c.get("attn_layer_period", 8), c.get("attn_layer_offset", 4)
        rank = c.get("mamba_dt_rank", "auto")
        rank = math.ceil(H / 16) if rank == "auto" else int(rank)
        eps = c.get("rms_norm_eps", 1e-6)
        mamba = {"d_state": c.get("mamba_d_state", 16), "expand": c.get("mamba_expand", 2),
                 "conv_size": c.get("mamba_d_conv", 4), "dt_rank": rank, "bcdt_rms_eps": eps, "bcdt_rms_weight": True}
        experts = c.get("num_experts", c.get("num_local_experts", 16))
        moe = None
        if experts > 1:
            moe = {"experts": experts, "top_k": c.get("num_experts_per_tok", 2),
                   "every": c.get("expert_layer_period", 2), "offset": c.get("expert_layer_offset", 1),
                   "aux_loss_coef": c.get("router_aux_loss_coef", 0.001), "renormalize": False}
        pattern = ",".join("softmax" if i % period == offset else "mamba" for i in range(n))
        return transformer_config(c, pattern, eps, moe=moe, mixer_options={"mamba": mamba, "softmax": {"rotary": False}})

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o, n = opts["mamba"], cfg.n_layers
        attn = [i for i, name in enumerate(cfg.layers) if name == "softmax"]
        period, offset = attention_period(attn, n)
        m = cfg.moe or {"experts": 1, "top_k": 1, "every": 1, "offset": 0, "aux_loss_coef": 0.001}
        return {"model_type": "jamba", "architectures": ["JambaForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": n,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
                "attn_layer_period": period, "attn_layer_offset": offset, "num_experts": m["experts"],
                "num_experts_per_tok": m["top_k"], "expert_layer_period": m["every"], "expert_layer_offset": m["offset"],
                "router_aux_loss_coef": m["aux_loss_coef"], "mamba_d_state": o["d_state"],
                "mamba_d_conv": o["conv_size"], "mamba_expand": o["expand"], "mamba_dt_rank": o["dt_rank"],
                "mamba_conv_bias": True, "mamba_proj_bias": False, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
                "tie_word_embeddings": cfg.tie_embeddings}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if not (set(cfg.layers) <= {"mamba", "softmax"} and "mamba" in cfg.layers):
            return False
        o, a = opts["mamba"], opts.get("softmax", {"rotary": False, "window": None})
        attn = [i for i, name in enumerate(cfg.layers) if name == "softmax"]
        return (cfg.mlp and cfg.pos_emb == "none" and plain_attention(cfg, opts) and o["bcdt_rms_weight"]
                and o["bcdt_rms_eps"] == cfg.norm_eps
                and not a["rotary"] and a["window"] is None and attention_period(attn, cfg.n_layers) is not None
                and (cfg.moe is None or (not cfg.moe["renormalize"] and plain_moe(cfg.moe) and not cfg.moe["shared"]
                                         and cfg.moe["hidden"] in (None, cfg.mlp_hidden))))
