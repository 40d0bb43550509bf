"""``lfm2`` (Lfm2ForCausalLM, Liquid AI's LFM2): gated short-convolution layers (``layers/short_conv.py``:
out(c * conv(b * x)), ``conv_L_cache`` taps) and softmax attention layers (GQA, full rotary, RMS norms on
each head's q and k) as ``layer_types`` says ("conv" / "full_attention"; the legacy ``full_attn_idxs``),
each followed by a SwiGLU MLP (Mixtral's w1, w3, w2). The final norm is ``embedding_norm``.

The MLP's width is transformers' rule: with ``block_auto_adjust_ff_dim``, 2/3 of ``intermediate_size``, times
``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of`` (the released configs'); ``save_pretrained``
writes the width itself with the adjustment off. The released configs' legacy names ``tie_embedding``,
``block_ff_dim`` and a top-level ``rope_theta`` read as transformers reads them.
"""

from __future__ import annotations

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import TOP, W132, Format, HFConfig, check_rope_type, experts, swiglu

LAYER_TYPES = {"conv": "gated_conv", "full_attention": "softmax"}


def mlp_width(c: dict) -> int:
    """The SwiGLU's hidden width as transformers' Lfm2MLP computes it from the config."""
    size = dict.get(c, "block_ff_dim", None) or c["intermediate_size"]
    adjust = dict.get(c, "block_auto_adjust_ff_dim", True)     # "_dim" would read as an int field: checked here
    if not isinstance(adjust, bool) or not isinstance(size, int) or isinstance(size, bool):
        raise ValueError(f"config fields block_auto_adjust_ff_dim={adjust!r} must be a bool and intermediate_size="
                         f"{size!r} an int")
    if adjust:
        size = int(2 * size / 3)
        mult = c.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            of = dict.get(c, "block_multiple_of", 256)
            if isinstance(of, bool) or not isinstance(of, int) or of < 1:
                raise ValueError(f"config field block_multiple_of must be a positive int, got {of!r}")
            size = of * ((int(mult * size) + of - 1) // of)
    return size


class Lfm2Format(Format):
    model_type = "lfm2"
    top = {**TOP, "norm.weight": "model.embedding_norm.weight"}
    layers = {"gated_conv": {"mixer.{p}": "conv.{p}"},
              "softmax": {"mixer.o_proj.weight": "self_attn.out_proj.weight",
                          "mixer.q_norm.weight": "self_attn.q_layernorm.weight",
                          "mixer.k_norm.weight": "self_attn.k_layernorm.weight", "mixer.{p}": "self_attn.{p}"},
              "*": {"norm1.weight": "operator_norm.weight", "norm2.weight": "ffn_norm.weight",
                    **swiglu("mlp.", "feed_forward.", W132)}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        n, eps = c["num_hidden_layers"], c.get("norm_eps", 1e-5)
        types = c.get("layer_types")
        if types is None:
            full = c.get("full_attn_idxs")
            full = range(n) if full is None else full
            types = ["full_attention" if i in full else "conv" for i in range(n)]
        if not isinstance(types, list) or len(types) != n or set(types) - set(LAYER_TYPES):
            raise ValueError(f"config field layer_types={types!r} must name 'conv' or 'full_attention' for each of "
                             f"the {n} layers")
        conv_size = dict.get(c, "conv_L_cache", 3)
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 1:
            raise ValueError(f"config field conv_L_cache must be a positive int, got {conv_size!r}")
        rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 1e6)}
        check_rope_type(rope)
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"config field rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']} "
                             "is not supported (LFM2 rotates every dim)")
        H, heads = c["hidden_size"], c["num_attention_heads"]
        soft = {"rotary_base": float(rope.get("rope_theta", 1e6)), "head_dim": c.get("head_dim") or H // heads,
                "qk_norm": "head", "qk_norm_eps": eps}
        tie = dict.get(c, "tie_embedding", None)
        tie = c.get("tie_word_embeddings", True) if tie is None else tie
        if not isinstance(tie, bool):
            raise ValueError(f"config field tie_embedding must be a bool, got {tie!r}")
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=n, n_heads=heads,
                           n_kv_heads=c.get("num_key_value_heads"), pattern=",".join(LAYER_TYPES[t] for t in types),
                           mlp=True, mlp_size=mlp_width(c), norm_eps=eps, tie_embeddings=tie, context_length=1 << 20,
                           mixer_options={"gated_conv": {"conv_size": conv_size, "bias": c.get("conv_bias", False)},
                                          "softmax": soft})

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        g, a = opts["gated_conv"], opts.get("softmax", {"rotary_base": 1e6})
        return {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
                "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
                "layer_types": ["full_attention" if n == "softmax" else "conv" for n in cfg.layers],
                "intermediate_size": cfg.mlp_hidden, "block_auto_adjust_ff_dim": False, "norm_eps": cfg.norm_eps,
                "conv_L_cache": g["conv_size"], "conv_bias": g["bias"], "tie_word_embeddings": cfg.tie_embeddings,
                "rope_parameters": {"rope_type": "default", "rope_theta": a["rotary_base"]}}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        a = opts.get("softmax")
        attn_ok = a is None or (a["rotary"] and a["rotary_fraction"] == 1.0 and a["qk_norm"] == "head"
                                and a["qk_norm_eps"] == cfg.norm_eps and not a["output_gate"] and a["window"] is None
                                and a["head_dim"] * cfg.n_heads == cfg.d_model)
        return (set(cfg.layers) <= {"gated_conv", "softmax"} and "gated_conv" in cfg.layers and attn_ok and cfg.mlp
                and cfg.moe is None and cfg.pos_emb == "none" and not cfg.post_norm and cfg.scaled_residual is None)


class Lfm2MoeFormat(Lfm2Format):
    """``lfm2_moe`` (Lfm2MoeForCausalLM, LFM2-8B-A1B): LFM2's layers, the first ``num_dense_layers`` with a dense
    SwiGLU of ``intermediate_size`` (no width adjustment), the rest a mixture of ``num_experts`` SwiGLU experts of
    ``moe_intermediate_size``: sigmoid scores, chosen by score + ``expert_bias`` (``use_expert_bias``), the
    chosen scores renormalised as w / (sum w + 1e-6) (``norm_topk_prob``) times ``routed_scaling_factor``
    (``models.moe``'s sigmoid router). The checkpoint holds each expert's w1, w3, w2 (as transformers writes
    them); experts fused as transformers holds them in memory (``experts.gate_up_proj`` (E, 2 I, d),
    ``experts.down_proj``) are split by ``unpack``."""

    model_type = "lfm2_moe"
    layers = {**Lfm2Format.layers,
              "*": {**Lfm2Format.layers["*"], "mlp.score_bias": "feed_forward.expert_bias",
                    **experts("mlp.", "feed_forward.", "gate.weight", W132)}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        n = c["num_hidden_layers"]
        dense = c.get("num_dense_layers", 2)
        cfg = Lfm2Format.config(HFConfig({**c, "block_auto_adjust_ff_dim": False}, getattr(c, "where", "config.json")))
        moe = {"experts": c.get("num_experts", 32), "top_k": c.get("num_experts_per_tok", 4), "router": "sigmoid",
               "renormalize": _bool(c, "norm_topk_prob", True), "scale": c.get("routed_scaling_factor", 1.0),
               "hidden": c.get("moe_intermediate_size", 1792), "renorm_eps": 1e-6,
               "layers": list(range(dense, n)), "aux_loss_coef": 0.0}
        cfg = ModelConfig(**{**cfg.to_dict(), "moe": moe if dense < n else None})
        cfg.lfm2_expert_bias = _bool(c, "use_expert_bias", True)
        return cfg

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """Fused experts -> one tensor per expert; without ``use_expert_bias``, a zero bias (the same routing)."""
        out = {}
        for name, t in tensors.items():
            if name.endswith("experts.gate_up_proj"):
                p = name.removesuffix("gate_up_proj")
                for e, (g, u) in enumerate(x.chunk(2, dim=0) for x in t.unbind(0)):
                    out[f"{p}{e}.w1.weight"], out[f"{p}{e}.w3.weight"] = g, u
            elif name.endswith("experts.down_proj"):
                p = name.removesuffix("down_proj")
                out.update({f"{p}{e}.w2.weight": x for e, x in enumerate(t.unbind(0))})
            else:
                out[name] = t
        if not getattr(cfg, "lfm2_expert_bias", True):
            for i in cfg.moe_layers:
                out[f"model.layers.{i}.feed_forward.expert_bias"] = torch.zeros(cfg.moe["experts"])
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        out = {k: v for k, v in Lfm2Format.to_config(cfg, opts).items() if k != "block_auto_adjust_ff_dim"}
        m = cfg.moe
        return {**out, "model_type": "lfm2_moe", "architectures": ["Lfm2MoeForCausalLM"],
                "num_dense_layers": m["layers"][0] if m["layers"] else cfg.n_layers, "num_experts": m["experts"],
                "num_experts_per_tok": m["top_k"], "moe_intermediate_size": m["hidden"] or cfg.mlp_hidden,
                "norm_topk_prob": m["renormalize"], "routed_scaling_factor": m["scale"], "use_expert_bias": True}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        m = cfg.moe
        if m is None or not m["layers"] or m["layers"] != list(range(m["layers"][0], cfg.n_layers)):
            return False
        plain = cfg.moe is None or (m["router"] == "sigmoid" and m["groups"] == 1 and m["shared"] == 0
                                    and m["renorm_eps"] == 1e-6)
        return plain and Lfm2Format.matches(ModelConfig(**{**cfg.to_dict(), "moe": None}), opts)


def _bool(c: dict, key: str, default: bool) -> bool:
    v = c.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"config field {key} must be a bool, got {v!r}")
    return v
