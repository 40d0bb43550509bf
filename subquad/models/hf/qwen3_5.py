"""``qwen3_5`` and ``qwen3_5_moe`` (Qwen3_5[Moe]ForConditionalGeneration), and their language models alone,
``qwen3_5_text`` and ``qwen3_5_moe_text`` (Qwen3_5[Moe]ForCausalLM): Qwen3-Next's hybrid (``qwen3_next.py``:
Gated DeltaNet, gated attention, zero-centred norms) with the Gated DeltaNet's projections fused by part
rather than per key head (``in_proj_qkv`` = [q, k, v], ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), a dense
SwiGLU MLP in every layer (``qwen3_5``) or a MoE with a gated shared expert in every layer (``qwen3_5_moe``).

The multimodal types keep the language model's config in ``text_config`` and its weights under
``model.language_model.``; what subquad does not load - the vision tower (``model.visual.``) and the
multi-token-prediction head (``mtp.``) - is named in a warning and left out. Their rotary is M-RoPE
(``mrope_section``): for text every position axis holds the same index, which makes it plain rotary over
the first ``partial_rotary_factor`` of each head's dims - exactly what subquad computes.

``save_pretrained(model, path, model_type="qwen3_5_text")`` writes a text-only folder (transformers reads it as
Qwen3_5ForCausalLM); a multimodal folder is never written without its vision tower.
"""

from __future__ import annotations


import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (TOP, Format, attention_types, experts, gated_attention, gdn_config,
                                      gdn_layer_types, gdn_matches, gdn_options, gdn_rope, require, swiglu,
                                      transformer_config)

class Qwen3_5TextFormat(Format):
    model_type = "qwen3_5_text"
    architecture = "Qwen3_5ForCausalLM"
    moe = False
    conv_bias_key = "linear_conv_bias"
    prefix = "model."                                 # the language model's; the multimodal types nest it
    not_loaded = {"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction head"}
    layers = {"softmax": {"mixer.{p}": "self_attn.{p}"},
              "gated_deltanet": {"mixer.conv.weight": "linear_attn.conv1d.weight",
                                 "mixer.o_proj.weight": "linear_attn.out_proj.weight",
                                 "mixer.g_proj.weight": "linear_attn.in_proj_z.weight",
                                 "mixer.b_proj.weight": "linear_attn.in_proj_b.weight",
                                 "mixer.a_proj.weight": "linear_attn.in_proj_a.weight",
                                 "mixer.{p}": "linear_attn.{p}"},   # q, k, v: in_proj_qkv (unpack)
              "*": {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
                    **swiglu("mlp.", "mlp."), **experts("mlp.", "mlp.", "gate.weight"),
                    **swiglu("mlp.shared.", "mlp.shared_expert."),
                    "mlp.shared_gate.weight": "mlp.shared_expert_gate.weight"}}
    _ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                     "self_attn.k_norm.weight")

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls._set_prefix()

    @classmethod
    def _set_prefix(cls):
        cls.top = {k: v if v == "lm_head.weight" else cls.prefix + v.removeprefix("model.") for k, v in TOP.items()}
        cls.layer = cls.prefix + "layers.{i}."

    @staticmethod
    def text_config(c: dict) -> dict:
        return c

    @classmethod
    def config(cls, c: dict) -> ModelConfig:
        t = cls.text_config(c)
        require(t, "hidden_act", "silu")
        require(t, "attention_bias", False)
        require(t, "attn_output_gate", True)          # Qwen3.5's configs write it; its attention is gated
        n, eps = t["num_hidden_layers"], t.get("rms_norm_eps", 1e-6)
        types = gdn_layer_types(t, n)
        soft = {**gdn_rope(t, 0.25), "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
                "qk_norm": "head", "qk_norm_eps": eps, "output_gate": True}
        moe = None
        if cls.moe:
            moe = {"experts": t["num_experts"], "top_k": t.get("num_experts_per_tok", 8), "renormalize": True,
                   "aux_loss_coef": t.get("router_aux_loss_coef", 0.001), "hidden": t["moe_intermediate_size"],
                   "shared": t.get("shared_expert_intermediate_size", 512)}
            t = {**t, "intermediate_size": t.get("intermediate_size") or t["moe_intermediate_size"]}  # unused
        pattern = ",".join("softmax" if x == "full_attention" else "gated_deltanet" for x in types)
        return transformer_config({**t, "tie_word_embeddings": c.get("tie_word_embeddings", False)}, pattern, eps,
                                  moe=moe,
                                  mixer_options={"softmax": soft, "gated_deltanet": gdn_options(t, eps, False)})

    @staticmethod
    def _sizes(cfg: ModelConfig):
        o = cfg.mixer_options["gated_deltanet"]
        return o["n_key_heads"] * o["head_dim"], o["n_heads"] * o["value_head_dim"]

    @classmethod
    def _zero_centred(cls, name: str) -> bool:
        return name == cls.top.get("norm.weight") or name.endswith(cls._ZERO_CENTRED)

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """in_proj_qkv ((2 Hk K + H V), d) -> q, k, v; fused experts (``experts.gate_up_proj`` (E, 2 I, d),
        ``experts.down_proj``) -> one tensor per expert; zero-centred norms + 1."""
        qk, v = cls._sizes(cfg) if "gated_deltanet" in cfg.layers else (0, 0)
        out = {}
        for name, t in tensors.items():
            if name.endswith("linear_attn.in_proj_qkv.weight"):
                p = name.removesuffix("in_proj_qkv.weight")
                for part, x in zip("qkv", t.split([qk, qk, v], dim=0)):
                    out[f"{p}{part}_proj.weight"] = x
            elif name.endswith("mlp.experts.gate_up_proj"):
                p = name.removesuffix("gate_up_proj")
                for e, (g, u) in enumerate(x.chunk(2, dim=0) for x in t.unbind(0)):
                    out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = g, u
            elif name.endswith("mlp.experts.down_proj"):
                p = name.removesuffix("down_proj")
                out.update({f"{p}{e}.down_proj.weight": x for e, x in enumerate(t.unbind(0))})
            elif cls._zero_centred(name):
                out[name] = (t.float() + 1).to(dtype or t.dtype)
            else:
                out[name] = t
        return out

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        out = {}
        for name, t in tensors.items():
            if name.endswith("linear_attn.q_proj.weight"):
                p = name.removesuffix("q_proj.weight")
                out[p + "in_proj_qkv.weight"] = torch.cat([tensors[f"{p}{x}_proj.weight"] for x in "qkv"], 0)
            elif "linear_attn." in name and name.endswith(("k_proj.weight", "v_proj.weight")):
                continue
            elif cls._zero_centred(name):
                out[name] = (t.float() - 1).to(t.dtype)
            else:
                out[name] = t
        return out

    @classmethod
    def to_config(cls, cfg: ModelConfig, opts: dict) -> dict:
        a = opts.get("softmax", {"head_dim": cfg.d_model // cfg.n_heads, "rotary_base": 10000.0,
                                 "rotary_fraction": 0.25})
        out = {"model_type": cls.model_type, "architectures": [cls.architecture], "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
               "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "head_dim": a["head_dim"],
               "layer_types": attention_types(cfg), "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
               "attention_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
               "rope_parameters": {"rope_type": "default", "rope_theta": a.get("rotary_base", 10000.0),
                                   "partial_rotary_factor": a.get("rotary_fraction", 0.25)},
               **gdn_config(opts["gated_deltanet"])}
        m = cfg.moe
        if m is None:
            out["intermediate_size"] = cfg.mlp_hidden
        else:
            out.update({"num_experts": m["experts"], "num_experts_per_tok": m["top_k"],
                        "moe_intermediate_size": m["hidden"] or cfg.mlp_hidden,
                        "shared_expert_intermediate_size": m["shared"], "router_aux_loss_coef": m["aux_loss_coef"]})
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if not (set(cfg.layers) <= {"gated_deltanet", "softmax"} and "gated_deltanet" in cfg.layers):
            return False
        attn_ok = gated_attention(opts.get("softmax"), cfg.norm_eps)
        m = cfg.moe
        moe_ok = m is None if not cls.moe else (
            m is not None and m["router"] == "softmax" and m["layers"] is None and m["scale"] == 1.0
            and m["every"] == 1 and m["renormalize"] and m["shared"] > 0 and m["shared_gate"])
        return (attn_ok and moe_ok and cfg.mlp and cfg.pos_emb == "none" and not cfg.post_norm
                and cfg.scaled_residual is None and gdn_matches(opts["gated_deltanet"], cfg.norm_eps, False))


Qwen3_5TextFormat._set_prefix()


class Qwen3_5MoeTextFormat(Qwen3_5TextFormat):
    model_type = "qwen3_5_moe_text"
    architecture = "Qwen3_5MoeForCausalLM"
    moe = True


class _Multimodal:
    """The ForConditionalGeneration folders: the language model's config in ``text_config``, its weights under
    ``model.language_model.``; read, never written (that would need the vision tower)."""

    prefix = "model.language_model."

    @staticmethod
    def text_config(c: dict) -> dict:
        t = c.get("text_config")
        if not isinstance(t, dict):
            raise ValueError(f"config field text_config must hold the language model's config, got {t!r}")
        return t

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        return False


class Qwen3_5Format(_Multimodal, Qwen3_5TextFormat):
    model_type = "qwen3_5"


class Qwen3_5MoeFormat(_Multimodal, Qwen3_5MoeTextFormat):
    model_type = "qwen3_5_moe"
