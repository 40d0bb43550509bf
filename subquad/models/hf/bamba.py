"""``bamba`` (BambaForCausalLM): Mamba-2 layers (as Mamba2ForCausalLM's) and softmax attention layers (GQA,
rotary on the first half of each head's dims) at ``attn_layer_indices``, each followed by a SwiGLU MLP."""

from __future__ import annotations

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (HYBRID_BLOCK, HYBRID_TOP, Format, check_hybrid, check_rope_type, json_float,
                                      mamba2_options, plain_attention, transformer_config)


class BambaFormat(Format):
    model_type = "bamba"
    conv_bias_key = "mamba_conv_bias"
    top = HYBRID_TOP
    layers = {"softmax": {"mixer.{p}": "self_attn.{p}"},
              "mamba2": {"mixer.conv.{p}": "mamba.conv1d.{p}",
                         "mixer.{p}": "mamba.{p}"},
              "*": HYBRID_BLOCK}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        check_hybrid(c)
        rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 10000.0)}
        check_rope_type(rope)
        n = c["num_hidden_layers"]
        attn = set(c.get("attn_layer_indices") or ())
        if any(not 0 <= i < n for i in attn):
            raise ValueError(f"config field attn_layer_indices={sorted(attn)} names layers outside [0, {n})")
        eps = c.get("rms_norm_eps", 1e-5)
        m2 = mamba2_options(c, eps)
        soft = {"rotary_base": float(rope.get("rope_theta", 10000.0)),
                "rotary_fraction": float(rope.get("partial_rotary_factor", 0.5))}
        pattern = ",".join("softmax" if i in attn else "mamba2" for i in range(n))
        return transformer_config(c, pattern, eps, mixer_options={"mamba2": m2, "softmax": soft})

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o, a = opts["mamba2"], opts.get("softmax", {})
        return {"model_type": "bamba", "architectures": ["BambaForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
                "attn_layer_indices": [i for i, n in enumerate(cfg.layers) if n == "softmax"],
                "mamba_n_heads": o["expand"] * cfg.d_model // o["head_dim"], "mamba_d_head": o["head_dim"],
                "mamba_n_groups": o["n_groups"], "mamba_d_state": o["d_state"], "mamba_d_conv": o["conv_size"],
                "mamba_expand": o["expand"], "mamba_conv_bias": True, "mamba_proj_bias": False,
                "time_step_limit": [json_float(v) for v in o["dt_limit"]],
                "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": a.get("rotary_base", 10000.0),
                                    "partial_rotary_factor": 0.5},
                "tie_word_embeddings": cfg.tie_embeddings}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        a = opts.get("softmax", {"rotary": True, "rotary_fraction": 0.5, "window": None})
        return (set(cfg.layers) <= {"mamba2", "softmax"} and "mamba2" in cfg.layers and cfg.mlp and cfg.moe is None
                and cfg.pos_emb == "none" and plain_attention(cfg, opts) and opts["mamba2"]["norm_eps"] == cfg.norm_eps
                and a["rotary"] and a["rotary_fraction"] == 0.5 and a["window"] is None)
