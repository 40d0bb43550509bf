"""``granitemoehybrid`` (GraniteMoeHybridForCausalLM, IBM Granite 4): Mamba-2 layers (Bamba's) and softmax
attention layers - without positions (``position_embedding_type`` "nope" or null) or with full rotary ("rope")
- each followed by a SwiGLU MLP: a top-k mixture of experts plus an ungated shared expert
(``block_sparse_moe`` + ``shared_mlp``), or the shared one alone (``num_local_experts`` 0). The MLPs' gate and
up projections are fused (``input_linear``: [gate, up]) and the experts stacked; ``unpack`` splits them.

Granite's four multipliers are linear maps on the weights' outputs, so they are folded into the weights
on loading - exact, and the model is a plain subquad model afterwards:

    embedding_multiplier m   h = m embed(x)                 -> embed x m
    residual_multiplier r    h = h + r branch(norm(h))      -> each branch's output projection x r
                                                               (out_proj, o_proj, the experts' and shared
                                                               expert's down projections)
    attention_multiplier a   softmax(a q k^T)               -> q_proj x a sqrt(head_dim) (subquad scales by
                                                               1 / sqrt(head_dim))
    logits_scaling s         logits = head(norm(h)) / s     -> head / s; with tied embeddings the final norm
                                                               / (m s), which also undoes m on the head

``save_pretrained`` writes the folded weights with multipliers of 1 (and the attention multiplier
1 / sqrt(head_dim)): the same function. Training a loaded model trains the folded weights - the same
model, but not Granite's multiplier parametrisation of it (its learning-rate scales).
"""

from __future__ import annotations

import math

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (TOP, Format, check_hybrid, check_layer_types, check_rope_type, mamba2_config,
                                      mamba2_options, transformer_config)

LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}   # written by the released configs
_GATE, _UP = ".gate_half", ".up_half"           # the two halves of a fused input_linear (unpack's names)


class GraniteMoeHybridFormat(Format):
    model_type = "granitemoehybrid"
    conv_bias_key = "mamba_conv_bias"
    top = TOP
    layers = {"softmax": {"mixer.{p}": "self_attn.{p}"},
              "mamba2": {"mixer.conv.{p}": "mamba.conv1d.{p}", "mixer.{p}": "mamba.{p}"},
              "*": {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
                    "mlp.router.weight": "block_sparse_moe.router.layer.weight",
                    "mlp.w_gate": "block_sparse_moe.input_linear.weight" + _GATE,
                    "mlp.w_up": "block_sparse_moe.input_linear.weight" + _UP,
                    "mlp.w_down": "block_sparse_moe.output_linear.weight",
                    "mlp.shared.w_gate.weight": "shared_mlp.input_linear.weight" + _GATE,
                    "mlp.shared.w_up.weight": "shared_mlp.input_linear.weight" + _UP,
                    "mlp.shared.w_down.weight": "shared_mlp.output_linear.weight",
                    "mlp.w_gate.weight": "shared_mlp.input_linear.weight" + _GATE,     # no experts: the shared
                    "mlp.w_up.weight": "shared_mlp.input_linear.weight" + _UP,         # MLP alone, as dense
                    "mlp.w_down.weight": "shared_mlp.output_linear.weight"}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        check_hybrid(c)
        n, eps = c["num_hidden_layers"], c.get("rms_norm_eps", 1e-6)
        types = c.get("layer_types") or c.get("layers_block_type") or ["linear_attention"] * n
        types = check_layer_types([LEGACY_TYPES.get(t, t) for t in types], n)
        pe = c.get("position_embedding_type")
        if pe not in (None, "nope", "rope"):
            raise ValueError(f"config field position_embedding_type={pe!r} is not supported (subquad implements "
                             "'rope', 'nope' and null)")
        soft = {"rotary": False}
        if pe == "rope":
            rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 10000.0)}
            check_rope_type(rope)
            soft = {"rotary": True, "rotary_base": float(rope.get("rope_theta", 10000.0)),
                    "rotary_fraction": float(rope.get("partial_rotary_factor", 1.0))}
        shared = c.get("shared_intermediate_size", 1024)
        moe = None
        if c.get("num_local_experts", 8) > 0:
            moe = {"experts": c.get("num_local_experts", 8), "top_k": c.get("num_experts_per_tok", 2),
                   "renormalize": True, "aux_loss_coef": c.get("router_aux_loss_coef", 0.001),
                   "hidden": c["intermediate_size"], "shared": shared, "shared_gate": False}
        pattern = ",".join("softmax" if t == "full_attention" else "mamba2" for t in types)
        cfg = transformer_config({**c, "intermediate_size": shared}, pattern, eps, moe=moe,
                                 mixer_options={"mamba2": mamba2_options(c, eps), "softmax": soft})
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        # the multipliers, folded into the weights by unpack (module doc); one ModelConfig per load carries them
        cfg.granite_multipliers = {k: float(c.get(k, 1.0)) for k in ("embedding_multiplier", "residual_multiplier",
                                                                      "logits_scaling")}
        cfg.granite_multipliers["q_scale"] = float(c.get("attention_multiplier", 1.0)) * math.sqrt(head_dim)
        return cfg

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """input_linear ((E,) 2 I, d) -> its gate and up halves; the multipliers folded in (module doc)."""
        mult = getattr(cfg, "granite_multipliers", None)
        if mult is None:
            raise ValueError("granitemoehybrid: unpack needs the config's multipliers (GraniteMoeHybridFormat.config)")
        m, r, s, q = (mult[k] for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "q_scale"))
        scale = {"model.embed_tokens.weight": m, "lm_head.weight": 1 / s}
        if cfg.tie_embeddings:
            scale["model.norm.weight"] = 1 / (m * s)
        out = {}
        for name, t in tensors.items():
            if name.endswith("input_linear.weight"):
                out[name + _GATE], out[name + _UP] = t.chunk(2, dim=-2)
                continue
            f = scale.get(name, 1.0)
            if name.endswith(("mamba.out_proj.weight", "self_attn.o_proj.weight", "output_linear.weight")):
                f = r
            elif name.endswith("self_attn.q_proj.weight") and abs(q - 1) > 1e-12:
                f = q
            out[name] = t if f == 1.0 else (t.double() * f).to(dtype or t.dtype)
        return out

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        out = {}
        for name, t in tensors.items():
            if name.endswith(_GATE):
                out[name.removesuffix(_GATE)] = torch.cat([t, tensors[name.removesuffix(_GATE) + _UP]], dim=-2)
            elif not name.endswith(_UP):
                out[name] = t
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        a, m = opts.get("softmax", {"rotary": False}), cfg.moe
        out = {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"],
               "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
               "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
               "layer_types": ["full_attention" if x == "softmax" else "linear_attention" for x in cfg.layers],
               "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_bias": False,
               "tie_word_embeddings": cfg.tie_embeddings, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
               "logits_scaling": 1.0, "attention_multiplier": (cfg.d_model // cfg.n_heads) ** -0.5,
               "position_embedding_type": "rope" if a["rotary"] else "nope",
               "rope_parameters": {"rope_type": "default", "rope_theta": a.get("rotary_base", 10000.0)},
               **mamba2_config(cfg, opts["mamba2"])}
        if m is None:
            out.update({"num_local_experts": 0, "shared_intermediate_size": cfg.mlp_hidden,
                        "intermediate_size": cfg.mlp_hidden})
        else:
            out.update({"num_local_experts": m["experts"], "num_experts_per_tok": m["top_k"],
                        "intermediate_size": m["hidden"] or cfg.mlp_hidden, "shared_intermediate_size": m["shared"],
                        "router_aux_loss_coef": m["aux_loss_coef"]})
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if not (set(cfg.layers) <= {"mamba2", "softmax"} and "mamba2" in cfg.layers):
            return False
        a, m = opts.get("softmax"), cfg.moe
        attn_ok = a is None or (a["qk_norm"] is None and not a["output_gate"] and a["window"] is None
                                and a["head_dim"] * cfg.n_heads == cfg.d_model
                                and (not a["rotary"] or a["rotary_fraction"] == 1.0))
        moe_ok = m is None or (m["router"] == "softmax" and m["layers"] is None and m["every"] == 1
                               and m["renormalize"] and m["scale"] == 1.0 and m["shared"] > 0 and not m["shared_gate"])
        return (attn_ok and moe_ok and cfg.mlp and cfg.pos_emb == "none" and not cfg.post_norm
                and cfg.scaled_residual is None and opts["mamba2"]["norm_eps"] == cfg.norm_eps)
