"""``olmo_hybrid`` (OlmoHybridForCausalLM): Gated DeltaNet layers (pre-norm; beta in [0, 2] with
``linear_allow_neg_eigval``, separate q/k/v convolutions in the checkpoint) and softmax layers with OLMo-2's
post-norm blocks and q/k RMS norms over all heads, rotary or none (NoPE); SwiGLU MLPs.

``unpack`` joins the q, k, v convolutions into one over [q, k, v], as transformers holds it; ``pack`` splits it.
"""

from __future__ import annotations

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (Format, attention_types, gdn_config, gdn_layer_types, gdn_matches, gdn_options,
                                      gdn_rope, join_convs, require, split_conv, swiglu, transformer_config)


class OlmoHybridFormat(Format):
    model_type = "olmo_hybrid"
    conv_bias_key = "linear_conv_bias"
    _O_NORM_EPS = 1e-5                                 # transformers' (and fla's) fixed epsilon of the output norm
    layers = {"softmax": {"norm1.weight": "feedforward_layer_norm.weight",           # post-norm blocks
                          "norm2.weight": "post_feedforward_layernorm.weight",
                          "mixer.{p}": "self_attn.{p}"},
              "gated_deltanet": {"norm1.weight": "attention_layer_norm.weight",
                                 "norm2.weight": "feedforward_layer_norm.weight",
                                 "mixer.norm.weight": "linear_attn.o_norm.weight",
                                 "mixer.conv.weight": "linear_attn.conv1d.weight",   # q, k, v convs (unpack)
                                 "mixer.{p}": "linear_attn.{p}"},
              "*": swiglu("mlp.", "mlp.")}

    @classmethod
    def config(cls, c: dict) -> ModelConfig:
        require(c, "hidden_act", "silu")
        require(c, "attention_bias", False)
        H, heads = c["hidden_size"], c["num_attention_heads"]
        hd = c.get("head_dim")
        if hd is not None and hd != H // heads:
            raise ValueError(f"config field head_dim={hd} is not supported (OLMo-Hybrid's attention uses "
                             f"hidden_size / num_attention_heads = {H // heads})")
        n, eps = c["num_hidden_layers"], c.get("rms_norm_eps", 1e-6)
        types = gdn_layer_types(c, n)
        rope = gdn_rope(c, 1.0)
        if rope.get("rotary_fraction", 1.0) != 1.0:
            raise ValueError(f"config field rope_parameters.partial_rotary_factor={rope['rotary_fraction']} is not "
                             "supported (OLMo-Hybrid rotates whole heads)")
        soft = {**rope, "qk_norm": "all", "qk_norm_eps": eps}
        gdn = gdn_options(c, cls._O_NORM_EPS, bool(c.get("linear_allow_neg_eigval", True)))
        pattern = ",".join("softmax" if t == "full_attention" else "gated_deltanet" for t in types)
        return transformer_config(c, pattern, eps, post_norm=["softmax"],
                                  mixer_options={"softmax": soft, "gated_deltanet": gdn})

    @staticmethod
    def _conv_sizes(cfg):
        o = cfg.mixer_options["gated_deltanet"]
        key = o["n_key_heads"] * o["head_dim"]
        return [key, key, o["n_heads"] * o["value_head_dim"]]

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """The checkpoint's q_conv1d, k_conv1d, v_conv1d -> one convolution over [q, k, v] (as transformers)."""
        return join_convs(tensors, "linear_attn")

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        out = {}
        for name, t in tensors.items():
            if name.endswith("linear_attn.conv1d.weight"):
                out.update(split_conv(name, t, cls._conv_sizes(cfg)))
            else:
                out[name] = t
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        a, o = opts["softmax"], opts["gated_deltanet"]
        rope = {"rope_type": "default", "rope_theta": a["rotary_base"] if a["rotary"] else None}
        return {"model_type": "olmo_hybrid", "architectures": ["OlmoHybridForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
                "layer_types": attention_types(cfg), "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
                "attention_bias": False, "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope,
                "linear_allow_neg_eigval": o["allow_neg_eigval"], "pad_token_id": None, "eos_token_id": None,
                **gdn_config(o)}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if set(cfg.layers) != {"gated_deltanet", "softmax"}:
            return False
        a = opts["softmax"]
        return (cfg.mlp and cfg.moe is None and cfg.pos_emb == "none" and cfg.post_norm == ["softmax"]
                and a["qk_norm"] == "all" and a["qk_norm_eps"] == cfg.norm_eps and not a["output_gate"]
                and a["window"] is None and a["rotary_fraction"] == 1.0 and a["head_dim"] * cfg.n_heads == cfg.d_model
                and gdn_matches(opts["gated_deltanet"], cls._O_NORM_EPS, None))
