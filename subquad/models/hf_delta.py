"""Hugging Face mappings of the Gated DeltaNet hybrids: ``qwen3_next`` and ``olmo_hybrid`` (``hf.py`` loads them).

    qwen3_next:   pre-norm blocks, norms with zero-centred weights (x * (1 + w)); Gated DeltaNet with
                  fewer key heads than value heads and fused input projections (``in_proj_qkvz``,
                  ``in_proj_ba``, grouped per key head); gated softmax attention (q/k RMS norm per head,
                  partial rotary, sigmoid output gate, head_dim of its own); a sparse MoE with a gated
                  shared expert in every ``decoder_sparse_step``-th layer, else a SwiGLU MLP.
    olmo_hybrid:  Gated DeltaNet layers (pre-norm; beta in [0, 2] with ``linear_allow_neg_eigval``,
                  separate q/k/v convolutions in the checkpoint) and softmax layers with OLMo-2's
                  post-norm blocks and q/k RMS norms over all heads, rotary or none (NoPE); SwiGLU MLPs.

Both L2-normalise q and k as fla does (x rsqrt(|x|^2 + 1e-6)). ``unpack`` turns the checkpoint's tensors
into one per subquad parameter (split fused projections, concatenate convolutions, add the zero-centred
norms' 1) and ``pack`` undoes it for ``save_pretrained``.
"""

from __future__ import annotations

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf import _MLP, _common, _expert_names, _join_convs, _plain_moe, _require, _split_conv

_FLA_L2_EPS = 1e-6


def _layer_types(c: dict, n: int, default_every: int) -> list:
    types = c.get("layer_types")
    if types is None:
        every = c.get("full_attention_interval", default_every)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"config field layer_types={types!r} must name 'linear_attention' or 'full_attention' "
                         f"for each of the {n} layers")
    return types


def _rope(c: dict, partial_default: float):
    """(rotary options of the softmax layers) from rope_parameters - absent: the legacy fields or the defaults,
    as transformers reads it; a null rope_theta: no positions (NoPE, OLMo-Hybrid's released checkpoints)."""
    rope = c.get("rope_parameters")
    if rope is None:
        rope = {"rope_theta": c.get("rope_theta", 10000.0),
                "partial_rotary_factor": c.get("partial_rotary_factor", partial_default)}
    if rope.get("rope_theta") is None:
        return {"rotary": False}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"config field rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         "(subquad implements 'default')")
    return {"rotary": True, "rotary_base": float(rope["rope_theta"]),
            "rotary_fraction": float(rope.get("partial_rotary_factor", partial_default))}


def _gdn_options(c: dict, norm_eps: float, neg: bool) -> dict:
    return {"n_heads": c["linear_num_value_heads"], "n_key_heads": c["linear_num_key_heads"],
            "head_dim": c["linear_key_head_dim"], "value_head_dim": c["linear_value_head_dim"],
            "conv_size": c.get("linear_conv_kernel_dim", 4), "open_gate": False, "qk_eps": _FLA_L2_EPS,
            "allow_neg_eigval": neg, "norm_eps": norm_eps}


def _gdn_config(o: dict) -> dict:
    return {"linear_num_value_heads": o["n_heads"], "linear_num_key_heads": o["n_key_heads"],
            "linear_key_head_dim": o["head_dim"], "linear_value_head_dim": o["value_head_dim"],
            "linear_conv_kernel_dim": o["conv_size"]}


def _gdn_matches(o: dict, norm_eps: float, neg) -> bool:
    return (not o["open_gate"] and o["qk_eps"] == _FLA_L2_EPS and o["norm_eps"] == norm_eps
            and (neg is None or o["allow_neg_eigval"] == neg))


def _types_of(cfg: ModelConfig) -> list:
    return ["full_attention" if n == "softmax" else "linear_attention" for n in cfg.layers]


class _Qwen3Next:
    """Qwen3NextForCausalLM (module doc)."""

    model_type = "qwen3_next"
    conv_bias_key = "linear_conv_bias"                # never in its configs: the convolutions have no bias
    _GDN = ("A_log", "dt_bias", "conv.weight", "norm.weight", "o_proj.weight")
    _GDN_THEIRS = {"conv.weight": "conv1d.weight", "o_proj.weight": "out_proj.weight"}
    _ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                     "self_attn.k_norm.weight", "model.norm.weight")

    @staticmethod
    def config(c: dict) -> ModelConfig:
        _require(c, "hidden_act", "silu")
        _require(c, "attention_bias", False)
        if c.get("mlp_only_layers"):
            raise ValueError(f"config field mlp_only_layers={c['mlp_only_layers']!r} is not supported (subquad "
                             "places MoE layers by decoder_sparse_step alone)")
        n, eps = c["num_hidden_layers"], c.get("rms_norm_eps", 1e-6)
        types = _layer_types(c, n, 4)
        soft = {**_rope(c, 0.25), "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                "qk_norm": "head", "qk_norm_eps": eps, "output_gate": True}
        moe = None
        if c.get("num_experts", 0) > 0:
            step = c.get("decoder_sparse_step", 1)
            moe = {"experts": c["num_experts"], "top_k": c.get("num_experts_per_tok", 10), "every": step,
                   "offset": step - 1, "aux_loss_coef": c.get("router_aux_loss_coef", 0.001),
                   "renormalize": c.get("norm_topk_prob", True), "hidden": c["moe_intermediate_size"],
                   "shared": c.get("shared_expert_intermediate_size", 0)}
        pattern = ",".join("softmax" if t == "full_attention" else "gated_deltanet" for t in types)
        return _common(c, pattern, eps, moe=moe,
                       mixer_options={"softmax": soft, "gated_deltanet": _gdn_options(c, eps, False)})

    @classmethod
    def names(cls, cfg: ModelConfig) -> dict:
        out = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
        moe = set(cfg.moe_layers)
        for i, name in enumerate(cfg.layers):
            a, b = f"blocks.{i}.", f"model.layers.{i}."
            out[a + "norm1.weight"] = b + "input_layernorm.weight"
            out[a + "norm2.weight"] = b + "post_attention_layernorm.weight"
            if name == "softmax":
                out.update({a + "mixer." + p: b + "self_attn." + p
                            for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                      "q_norm.weight", "k_norm.weight")})
            else:   # the fused projections' parts under names of their own (unpack / pack)
                out.update({a + "mixer." + p: b + "linear_attn." + cls._GDN_THEIRS.get(p, p) for p in cls._GDN})
                out.update({a + f"mixer.{p}_proj.weight": b + f"linear_attn.{p}_proj.weight" for p in "qkvgba"})
            f = b + "mlp."
            if i in moe:
                out.update(_expert_names(a, f, cfg, "gate.weight"))
                out.update({a + "mlp.shared." + ours: f + "shared_expert." + theirs for ours, theirs in _MLP.items()})
                out[a + "mlp.shared_gate.weight"] = f + "shared_expert_gate.weight"
            else:
                out.update({a + "mlp." + ours: f + theirs for ours, theirs in _MLP.items()})
        if not cfg.tie_embeddings:
            out["head.weight"] = "lm_head.weight"
        return out

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
               "head_dim": a["head_dim"], "layer_types": _types_of(cfg), "rms_norm_eps": cfg.norm_eps,
               "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
               "rope_parameters": {"rope_type": "default", "rope_theta": a.get("rotary_base", 10000.0),
                                   "partial_rotary_factor": a.get("rotary_fraction", 0.25)},
               "num_experts": 0 if m is None else m["experts"], "mlp_only_layers": [],
               **_gdn_config(opts["gated_deltanet"])}
        if m is not None:
            out.update({"num_experts_per_tok": m["top_k"], "decoder_sparse_step": m["every"],
                        "moe_intermediate_size": m["hidden"] or cfg.mlp_hidden, "norm_topk_prob": m["renormalize"],
                        "shared_expert_intermediate_size": m["shared"], "router_aux_loss_coef": m["aux_loss_coef"]})
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if not (set(cfg.layers) <= {"gated_deltanet", "softmax"} and "gated_deltanet" in cfg.layers):
            return False
        a = opts.get("softmax")
        attn_ok = a is None or (a["output_gate"] and a["qk_norm"] == "head" and a["qk_norm_eps"] == cfg.norm_eps
                                and a["rotary"] and a["window"] is None)
        m = cfg.moe
        return (attn_ok and cfg.mlp and cfg.pos_emb == "none" and not cfg.post_norm and cfg.scaled_residual is None
                and _gdn_matches(opts["gated_deltanet"], cfg.norm_eps, False)
                and (m is None or (_plain_moe(m) and m["shared_gate"] and m["shared"] > 0
                                   and m["offset"] == m["every"] - 1)))


class _OlmoHybrid:
    """OlmoHybridForCausalLM (module doc)."""

    model_type = "olmo_hybrid"
    conv_bias_key = "linear_conv_bias"
    _O_NORM_EPS = 1e-5                                 # transformers' (and fla's) fixed epsilon of the output norm
    _GDN = ("A_log", "dt_bias", "q_proj.weight", "k_proj.weight", "v_proj.weight", "a_proj.weight", "b_proj.weight",
            "g_proj.weight", "o_proj.weight")

    @classmethod
    def config(cls, c: dict) -> ModelConfig:
        _require(c, "hidden_act", "silu")
        _require(c, "attention_bias", False)
        H, heads = c["hidden_size"], c["num_attention_heads"]
        hd = c.get("head_dim")
        if hd is not None and hd != H // heads:
            raise ValueError(f"config field head_dim={hd} is not supported (OLMo-Hybrid's attention uses "
                             f"hidden_size / num_attention_heads = {H // heads})")
        n, eps = c["num_hidden_layers"], c.get("rms_norm_eps", 1e-6)
        types = _layer_types(c, n, 4)
        rope = _rope(c, 1.0)
        if rope.get("rotary_fraction", 1.0) != 1.0:
            raise ValueError(f"config field rope_parameters.partial_rotary_factor={rope['rotary_fraction']} is not "
                             "supported (OLMo-Hybrid rotates whole heads)")
        soft = {**rope, "qk_norm": "all", "qk_norm_eps": eps}
        gdn = _gdn_options(c, cls._O_NORM_EPS, bool(c.get("linear_allow_neg_eigval", True)))
        pattern = ",".join("softmax" if t == "full_attention" else "gated_deltanet" for t in types)
        return _common(c, pattern, eps, post_norm=["softmax"], mixer_options={"softmax": soft, "gated_deltanet": gdn})

    @classmethod
    def names(cls, cfg: ModelConfig) -> dict:
        out = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
        for i, name in enumerate(cfg.layers):
            a, b = f"blocks.{i}.", f"model.layers.{i}."
            if name == "softmax":                    # post-norm: after attention, after the MLP
                out[a + "norm1.weight"] = b + "feedforward_layer_norm.weight"
                out[a + "norm2.weight"] = b + "post_feedforward_layernorm.weight"
                out.update({a + "mixer." + p: b + "self_attn." + p
                            for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                      "q_norm.weight", "k_norm.weight")})
            else:
                out[a + "norm1.weight"] = b + "attention_layer_norm.weight"
                out[a + "norm2.weight"] = b + "feedforward_layer_norm.weight"
                out.update({a + "mixer." + p: b + "linear_attn." + p for p in cls._GDN})
                out[a + "mixer.norm.weight"] = b + "linear_attn.o_norm.weight"
                out[a + "mixer.conv.weight"] = b + "linear_attn.conv1d.weight"      # q, k, v convs (unpack)
            out.update({a + "mlp." + ours: b + "mlp." + theirs for ours, theirs in _MLP.items()})
        if not cfg.tie_embeddings:
            out["head.weight"] = "lm_head.weight"
        return out

    @staticmethod
    def _conv_sizes(cfg):
        o = cfg.mixer_options["gated_deltanet"]
        key = o["n_key_heads"] * o["head_dim"]
        return [key, key, o["n_heads"] * o["value_head_dim"]]

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """The checkpoint's q_conv1d, k_conv1d, v_conv1d -> one convolution over [q, k, v] (as transformers)."""
        return _join_convs(tensors, "linear_attn")

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        out = {}
        for name, t in tensors.items():
            if name.endswith("linear_attn.conv1d.weight"):
                out.update(_split_conv(name, t, cls._conv_sizes(cfg)))
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
                "layer_types": _types_of(cfg), "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
                "attention_bias": False, "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope,
                "linear_allow_neg_eigval": o["allow_neg_eigval"], "pad_token_id": None, "eos_token_id": None,
                **_gdn_config(o)}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if set(cfg.layers) != {"gated_deltanet", "softmax"}:
            return False
        a = opts["softmax"]
        return (cfg.mlp and cfg.moe is None and cfg.pos_emb == "none" and cfg.post_norm == ["softmax"]
                and a["qk_norm"] == "all" and a["qk_norm_eps"] == cfg.norm_eps and not a["output_gate"]
                and a["window"] is None and a["rotary_fraction"] == 1.0 and a["head_dim"] * cfg.n_heads == cfg.d_model
                and _gdn_matches(opts["gated_deltanet"], cls._O_NORM_EPS, None))
