"""``qwen3_next`` (Qwen3NextForCausalLM): pre-norm blocks, norms with zero-centred weights (x * (1 + w)); Gated
DeltaNet with fewer key heads than value heads and fused input projections (``in_proj_qkvz``, ``in_proj_ba``,
grouped per key head); gated softmax attention (q/k RMS norm per head, partial rotary, sigmoid output gate,
head_dim of its own); a sparse MoE with a gated shared expert in every ``decoder_sparse_step``-th layer, else a
SwiGLU MLP.

``unpack`` splits the fused projections into one tensor per subquad parameter and adds the zero-centred
norms' 1; ``pack`` undoes it for ``save_pretrained``.
"""

from __future__ import annotations

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (Format, attention_types, experts, gated_attention, gdn_config, gdn_layer_types,
                                      gdn_matches, gdn_options, gdn_rope, plain_moe, require, swiglu,
                                      transformer_config)


class Qwen3NextFormat(Format):
    model_type = "qwen3_next"
    conv_bias_key = "linear_conv_bias"                # never in its configs: the convolutions have no bias
    layers = {"softmax": {"mixer.{p}": "self_attn.{p}"},
              "gated_deltanet": {"mixer.conv.weight": "linear_attn.conv1d.weight",
                                 "mixer.o_proj.weight": "linear_attn.out_proj.weight",
                                 "mixer.{p}": "linear_attn.{p}"},   # q, k, v, g, b, a_proj: fused (unpack)
              "*": {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
                    **swiglu("mlp.", "mlp."), **experts("mlp.", "mlp.", "gate.weight"),
                    **swiglu("mlp.shared.", "mlp.shared_expert."),
                    "mlp.shared_gate.weight": "mlp.shared_expert_gate.weight"}}
    _ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                     "self_attn.k_norm.weight", "model.norm.weight")

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_act", "silu")
        require(c, "attention_bias", False)
        if c.get("mlp_only_layers"):
            raise ValueError(f"config field mlp_only_layers={c['mlp_only_layers']!r} is not supported (subquad "
                             "places MoE layers by decoder_sparse_step alone)")
        n, eps = c["num_hidden_layers"], c.get("rms_norm_eps", 1e-6)
        types = gdn_layer_types(c, n)
        soft = {**gdn_rope(c, 0.25), "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                "qk_norm": "head", "qk_norm_eps": eps, "output_gate": True}
        moe = None
        if c.get("num_experts", 0) > 0:
            step = c.get("decoder_sparse_step", 1)
            moe = {"experts": c["num_experts"], "top_k": c.get("num_experts_per_tok", 10), "every": step,
                   "offset": step - 1, "aux_loss_coef": c.get("router_aux_loss_coef", 0.001),
                   "renormalize": c.get("norm_topk_prob", True), "hidden": c["moe_intermediate_size"],
                   "shared": c.get("shared_expert_intermediate_size", 0)}
        pattern = ",".join("softmax" if t == "full_attention" else "gated_deltanet" for t in types)
        return transformer_config(c, pattern, eps, moe=moe,
                                  mixer_options={"softmax": soft, "gated_deltanet": gdn_options(c, eps, False)})

    @staticmethod
    def _sizes(cfg: ModelConfig):
        o = cfg.mixer_options["gated_deltanet"]
        Hk, r = o["n_key_heads"], o["n_heads"] // o["n_key_heads"]
        return Hk, r, o["head_dim"], o["value_head_dim"]

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """in_proj_qkvz (Hk (2K + 2 r V), d): per key head [q (K), k (K), v (r V), z (r V)] -> q, k, v and the
        output gate g; in_proj_ba (Hk 2 r, d): per key head [b (r), a (r)]; zero-centred norms + 1."""
        Hk, r, K, V = cls._sizes(cfg) if "gated_deltanet" in cfg.layers else (0, 0, 0, 0)
        out = {}
        for name, t in tensors.items():
            if name.endswith("linear_attn.in_proj_qkvz.weight"):
                p = name.removesuffix("in_proj_qkvz.weight")
                q, k, v, z = t.view(Hk, 2 * K + 2 * r * V, -1).split([K, K, r * V, r * V], dim=1)
                for part, x in zip("qkvg", (q, k, v, z)):
                    out[f"{p}{part}_proj.weight"] = x.reshape(-1, t.shape[-1])
            elif name.endswith("linear_attn.in_proj_ba.weight"):
                p = name.removesuffix("in_proj_ba.weight")
                b, a = t.view(Hk, 2 * r, -1).split([r, r], dim=1)
                out[p + "b_proj.weight"], out[p + "a_proj.weight"] = (x.reshape(-1, t.shape[-1]) for x in (b, a))
            elif name.endswith(cls._ZERO_CENTRED):
                out[name] = (t.float() + 1).to(dtype or t.dtype)
            else:
                out[name] = t
        return out

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        Hk, r, K, V = cls._sizes(cfg) if "gated_deltanet" in cfg.layers else (0, 0, 0, 0)
        out = {}
        for name, t in tensors.items():
            if name.endswith("linear_attn.q_proj.weight"):
                p = name.removesuffix("q_proj.weight")
                parts = [tensors[f"{p}{x}_proj.weight"] for x in "qkvg"]
                d = t.shape[-1]
                out[p + "in_proj_qkvz.weight"] = torch.cat(
                    [x.view(Hk, -1, d) for x in parts], dim=1).reshape(-1, d)
                out[p + "in_proj_ba.weight"] = torch.cat(
                    [tensors[f"{p}{x}_proj.weight"].view(Hk, r, d) for x in "ba"], dim=1).reshape(-1, d)
            elif "linear_attn." in name and name.endswith(tuple(f".{x}_proj.weight" for x in "kvgba")):
                continue
            elif name.endswith(cls._ZERO_CENTRED):
                out[name] = (t.float() - 1).to(t.dtype)
            else:
                out[name] = t
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        a = opts.get("softmax", {"head_dim": cfg.d_model // cfg.n_heads, "rotary": True, "rotary_base": 10000.0,
                                 "rotary_fraction": 0.25})
        m = cfg.moe
        out = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.n_layers,
               "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
               "head_dim": a["head_dim"], "layer_types": attention_types(cfg), "rms_norm_eps": cfg.norm_eps,
               "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
               "rope_parameters": {"rope_type": "default", "rope_theta": a.get("rotary_base", 10000.0),
                                   "partial_rotary_factor": a.get("rotary_fraction", 0.25)},
               "num_experts": 0 if m is None else m["experts"], "mlp_only_layers": [],
               **gdn_config(opts["gated_deltanet"])}
        if m is not None:
            out.update({"num_experts_per_tok": m["top_k"], "decoder_sparse_step": m["every"],
                        "moe_intermediate_size": m["hidden"] or cfg.mlp_hidden, "norm_topk_prob": m["renormalize"],
                        "shared_expert_intermediate_size": m["shared"], "router_aux_loss_coef": m["aux_loss_coef"]})
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if not (set(cfg.layers) <= {"gated_deltanet", "softmax"} and "gated_deltanet" in cfg.layers):
            return False
        attn_ok = gated_attention(opts.get("softmax"), cfg.norm_eps)
        m = cfg.moe
        return (attn_ok and cfg.mlp and cfg.pos_emb == "none" and not cfg.post_norm and cfg.scaled_residual is None
                and gdn_matches(opts["gated_deltanet"], cfg.norm_eps, False)
                and (m is None or (plain_moe(m) and m["shared_gate"] and m["shared"] > 0
                                   and m["offset"] == m["every"] - 1)))
