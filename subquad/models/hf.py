"""Hugging Face model folders <-> subquad ``LanguageModel``s, without importing transformers.

    model, tokenizer = from_pretrained("path/to/folder", dtype=None, device=None)
    save_pretrained(model, "path/to/out")

A folder holds ``config.json``, the weights (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) and, when present, ``tokenizer.json`` (loaded with ``tokenizers``).
Each ``model_type`` has a mapping: its config to a ``ModelConfig`` - every field that changes the math
honoured or refused with a ``ValueError`` naming it - and its weight names to subquad's. A missing
weight, an unexpected one or a wrong shape is refused by name: never a silently different model.

Supported: ``mamba`` (MambaForCausalLM), ``falcon_mamba`` (its RMS norms on dt, B and C), ``mamba2``
(Mamba2ForCausalLM: ``n_groups``, the gated norm per group with the config's epsilon, ``time_step_limit``),
``bamba`` (Mamba-2 layers and softmax attention layers at ``attn_layer_indices``, partial rotary, SwiGLU
MLPs), ``jamba`` (Mamba layers with weighted RMS norms on dt, B and C, attention without positions every
``attn_layer_period``, a sparse mixture-of-experts MLP every ``expert_layer_period``), and the Gated DeltaNet
hybrids ``qwen3_next`` and ``olmo_hybrid`` (``hf_delta.py``) and Kimi Delta Attention's ``kimi_linear``
(``hf_kimi.py``), and lightning attention's ``minimax`` (``hf_minimax.py``).

A name map takes subquad's parameter names to the checkpoint's; a tuple of checkpoint names is one tensor
of ours stacked along dim 0 (the experts of an MoE layer, one tensor per expert in the checkpoint). A
mapping may also ``unpack`` the checkpoint's tensors first (fused projections split, per-part convolutions
joined, zero-centred norm weights shifted) and ``pack`` them back on saving.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from subquad.models.config import ModelConfig

_INIT_ONLY = {"initializer_range", "rescale_prenorm_residual", "time_step_scale", "time_step_min", "time_step_max",
              "time_step_init_scheme", "time_step_floor"}   # fields that shape only a fresh model's weights


class _Mamba:
    """MambaForCausalLM: embedding, blocks of rmsnorm -> Mamba mixer (a residual each, no MLP), rmsnorm,
    tied or untied head."""

    model_type = "mamba"
    conv_bias_key = "use_conv_bias"

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        """Whether a subquad model of this structure (``opts``: its layers' options, ``_layer_options``) is
        this type (Falcon-Mamba's norms make the other)."""
        return _pure(cfg, "mamba") and opts["mamba"]["bcdt_rms_eps"] is None

    @staticmethod
    def config(c: dict) -> ModelConfig:
        _require(c, "hidden_act", "silu")
        _require(c, "use_bias", False)
        H, E = c["hidden_size"], c.get("expand", 2)
        if c.get("intermediate_size", E * H) != E * H:
            raise ValueError(f"config field intermediate_size={c['intermediate_size']} must be expand * hidden_size "
                             f"= {E * H}")
        rank = c.get("time_step_rank", "auto")
        rank = math.ceil(H / 16) if rank == "auto" else int(rank)
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=c["num_hidden_layers"], n_heads=1,
                           pattern="mamba", mlp=False, norm_eps=c.get("layer_norm_epsilon", 1e-5),
                           tie_embeddings=c.get("tie_word_embeddings", True), context_length=1 << 20,
                           mixer_options={"mamba": {"d_state": c.get("state_size", 16), "expand": E,
                                                    "conv_size": c.get("conv_kernel", 4), "dt_rank": rank}})

    @staticmethod
    def names(cfg: ModelConfig) -> dict:
        """subquad parameter name -> the checkpoint's."""
        return _backbone_names(cfg, ("A_log", "D", "in_proj.weight", "x_proj.weight", "dt_proj.weight",
                                     "dt_proj.bias", "out_proj.weight"))

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o = opts["mamba"]
        return {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "state_size": o["d_state"],
                "expand": o["expand"], "intermediate_size": o["expand"] * cfg.d_model, "conv_kernel": o["conv_size"],
                "time_step_rank": o["dt_rank"], "layer_norm_epsilon": cfg.norm_eps, "use_bias": False,
                "use_conv_bias": True, "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
                "residual_in_fp32": True}


class _FalconMamba(_Mamba):
    """FalconMambaForCausalLM: Mamba with a weightless RMS norm on dt, B and C (``mixer_rms_eps``)."""

    model_type = "falcon_mamba"

    @staticmethod
    def config(c: dict) -> ModelConfig:
        cfg = _Mamba.config(c)
        cfg.mixer_options["mamba"]["bcdt_rms_eps"] = c.get("mixer_rms_eps", 1e-6)
        return cfg

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        return {**_Mamba.to_config(cfg, opts), "model_type": "falcon_mamba",
                "architectures": ["FalconMambaForCausalLM"], "mixer_rms_eps": opts["mamba"]["bcdt_rms_eps"]}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        return _pure(cfg, "mamba") and opts["mamba"]["bcdt_rms_eps"] is not None and not opts["mamba"]["bcdt_rms_weight"]


class _Mamba2:
    """Mamba2ForCausalLM: embedding, blocks of rmsnorm -> Mamba-2 mixer (SSD, B and C per group, gated norm
    per group), rmsnorm, head (untied by default)."""

    model_type = "mamba2"
    conv_bias_key = "use_conv_bias"

    @staticmethod
    def config(c: dict) -> ModelConfig:
        _require(c, "hidden_act", "silu")
        _require(c, "use_bias", False)
        _require(c, "rms_norm", True)
        _require(c, "norm_before_gate", False)
        H, E = c["hidden_size"], c.get("expand", 2)
        heads, hd = c.get("num_heads", 128), c.get("head_dim", 64)
        if heads * hd != int(E * H):
            raise ValueError(f"config fields num_heads={heads} x head_dim={hd} must equal expand x hidden_size = "
                             f"{int(E * H)}")
        eps = c.get("layer_norm_epsilon", 1e-5)
        opts = {"d_state": c.get("state_size", 128), "head_dim": hd, "expand": E, "conv_size": c.get("conv_kernel", 4),
                "n_groups": c.get("n_groups", 1), "norm_eps": eps}
        limit = tuple(_float(v) for v in c.get("time_step_limit", (0.0, float("inf"))))
        if limit != (0.0, float("inf")):
            opts["dt_limit"] = limit
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=c["num_hidden_layers"], n_heads=1,
                           pattern="mamba2", mlp=False, norm_eps=eps, tie_embeddings=c.get("tie_word_embeddings", False),
                           context_length=1 << 20, mixer_options={"mamba2": opts})

    @staticmethod
    def names(cfg: ModelConfig) -> dict:
        return _backbone_names(cfg, ("dt_bias", "A_log", "D", "in_proj.weight", "norm.weight", "out_proj.weight"))

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o = opts["mamba2"]
        return {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "state_size": o["d_state"],
                "head_dim": o["head_dim"], "num_heads": o["expand"] * cfg.d_model // o["head_dim"],
                "expand": o["expand"], "n_groups": o["n_groups"], "conv_kernel": o["conv_size"],
                "layer_norm_epsilon": cfg.norm_eps, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
                "time_step_limit": [_json_float(v) for v in o["dt_limit"]],
                "tie_word_embeddings": cfg.tie_embeddings, "residual_in_fp32": True}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        return _pure(cfg, "mamba2") and opts["mamba2"]["norm_eps"] == cfg.norm_eps


def _pure(cfg: ModelConfig, layer: str) -> bool:
    """Every layer is ``layer``, with no MLP and no learned positions (the Mamba family's structure)."""
    return set(cfg.layers) == {layer} and not cfg.mlp and cfg.pos_emb == "none"


_ATTN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
_MLP = {"w_gate.weight": "gate_proj.weight", "w_up.weight": "up_proj.weight", "w_down.weight": "down_proj.weight"}


# experts written as w1 (gate), w3 (up), w2 (down): Mixtral's names, kept by Kimi Linear and MiniMax
_W132 = {"w_gate": "w1.weight", "w_up": "w3.weight", "w_down": "w2.weight"}


def _expert_names(a: str, f: str, cfg: ModelConfig, router: str, names: dict | None = None) -> dict:
    """A mixture-of-experts block's router and routed experts: ours ``{a}mlp.router.weight`` and
    ``{a}mlp.{w_gate, w_up, w_down}`` (stacked) -> the checkpoint's ``{f}{router}`` and one
    ``{f}experts.{e}.{name}`` per expert (``names``: ours -> name; default gate_proj / up_proj / down_proj)."""
    names = names or {ours.removesuffix(".weight"): theirs for ours, theirs in _MLP.items()}
    out = {a + "mlp.router.weight": f + router}
    out.update({a + "mlp." + ours: tuple(f"{f}experts.{e}.{theirs}" for e in range(cfg.moe["experts"]))
                for ours, theirs in names.items()})
    return out


def _join_convs(tensors: dict, module: str) -> dict:
    """``{module}.q_conv1d``, ``k_conv1d``, ``v_conv1d`` (written per part by OLMo-Hybrid and Kimi Linear) ->
    one ``{module}.conv1d`` over [q, k, v], as transformers and subquad hold it; other tensors as they are."""
    out = dict(tensors)
    for name in list(tensors):
        if name.endswith(f"{module}.q_conv1d.weight"):
            p = name.removesuffix("q_conv1d.weight")
            parts = [p + f"{x}_conv1d.weight" for x in "qkv"]
            if all(x in out for x in parts):
                out[p + "conv1d.weight"] = torch.cat([out.pop(x) for x in parts], 0)
    return out


def _split_conv(name: str, t: torch.Tensor, sizes: list) -> dict:
    """The inverse of ``_join_convs`` for one ``...conv1d.weight``: its q, k, v parts by ``sizes``."""
    p = name.removesuffix("conv1d.weight")
    return {p + f"{x}_conv1d.weight": part for x, part in zip("qkv", t.split(sizes, 0))}


def _hybrid_names(cfg: ModelConfig, mixer_params: dict) -> dict:
    """subquad name -> the checkpoint's, for the hybrid layout of Bamba and Jamba: model.{embed_tokens,
    layers.i.{input_layernorm, mamba.* | self_attn.*, pre_ff_layernorm, feed_forward.*}, final_layernorm}
    and lm_head. ``mixer_params``: ours -> theirs for the recurrent layer's parameters."""
    out = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.final_layernorm.weight"}
    moe = set(cfg.moe_layers)
    for i, name in enumerate(cfg.layers):
        a, b = f"blocks.{i}.", f"model.layers.{i}."
        out[a + "norm1.weight"] = b + "input_layernorm.weight"
        out[a + "norm2.weight"] = b + "pre_ff_layernorm.weight"
        if name == "softmax":
            out.update({a + "mixer." + p: b + "self_attn." + p for p in _ATTN})
        else:
            out.update({a + "mixer." + ours: b + "mamba." + theirs for ours, theirs in mixer_params.items()})
        f = b + "feed_forward."
        if i in moe:
            out.update(_expert_names(a, f, cfg, "router.weight"))
        else:
            out.update({a + "mlp." + ours: f + theirs for ours, theirs in _MLP.items()})
    if not cfg.tie_embeddings:
        out["head.weight"] = "lm_head.weight"
    return out


def _check_hybrid(c: dict) -> None:
    """The fields Bamba and Jamba share that subquad implements one way."""
    _require(c, "hidden_act", "silu")
    _require(c, "mamba_proj_bias", False)
    _require(c, "attention_bias", False)
    _require(c, "mlp_bias", False)
    hd = c.get("head_dim")
    if hd is not None and hd != c["hidden_size"] // c["num_attention_heads"]:
        raise ValueError(f"config field head_dim={hd} is not supported (subquad's attention uses hidden_size / "
                         f"num_attention_heads = {c['hidden_size'] // c['num_attention_heads']})")


def _common(c: dict, pattern: str, eps: float, **fields) -> ModelConfig:
    return ModelConfig(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
                       n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads"), pattern=pattern,
                       mlp=True, mlp_size=c["intermediate_size"], norm_eps=eps,
                       tie_embeddings=c.get("tie_word_embeddings", False), context_length=1 << 20, **fields)


class _Bamba:
    """BambaForCausalLM: Mamba-2 layers (as Mamba2ForCausalLM's) and softmax attention layers (GQA, rotary
    on the first half of each head's dims) at ``attn_layer_indices``, each followed by a SwiGLU MLP."""

    model_type = "bamba"
    conv_bias_key = "mamba_conv_bias"

    @staticmethod
    def config(c: dict) -> ModelConfig:
        _check_hybrid(c)
        rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 10000.0)}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config field rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                             "(subquad implements 'default')")
        H, E, n = c["hidden_size"], c.get("mamba_expand", 2), c["num_hidden_layers"]
        heads = c.get("mamba_n_heads", 128)
        hd = c.get("mamba_d_head", "auto")
        hd = E * H // heads if hd == "auto" else hd
        if heads * hd != E * H:
            raise ValueError(f"config fields mamba_n_heads={heads} x mamba_d_head={hd} must equal mamba_expand x "
                             f"hidden_size = {E * H}")
        attn = set(c.get("attn_layer_indices") or ())
        if any(not 0 <= i < n for i in attn):
            raise ValueError(f"config field attn_layer_indices={sorted(attn)} names layers outside [0, {n})")
        eps = c.get("rms_norm_eps", 1e-5)
        m2 = {"d_state": c.get("mamba_d_state", 256), "head_dim": hd, "expand": E, "conv_size": c.get("mamba_d_conv", 4),
              "n_groups": c.get("mamba_n_groups", 1), "norm_eps": eps}
        limit = tuple(_float(v) for v in (c.get("time_step_limit") or (0.0, float("inf"))))
        if limit != (0.0, float("inf")):
            m2["dt_limit"] = limit
        soft = {"rotary_base": float(rope.get("rope_theta", 10000.0)),
                "rotary_fraction": float(rope.get("partial_rotary_factor", 0.5))}
        pattern = ",".join("softmax" if i in attn else "mamba2" for i in range(n))
        return _common(c, pattern, eps, mixer_options={"mamba2": m2, "softmax": soft})

    @staticmethod
    def names(cfg: ModelConfig) -> dict:
        p = ("dt_bias", "A_log", "D", "in_proj.weight", "norm.weight", "out_proj.weight")
        return _hybrid_names(cfg, {**{x: x for x in p}, "conv.weight": "conv1d.weight", "conv.bias": "conv1d.bias"})

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
                "time_step_limit": [_json_float(v) for v in o["dt_limit"]],
                "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": a.get("rotary_base", 10000.0),
                                    "partial_rotary_factor": 0.5},
                "tie_word_embeddings": cfg.tie_embeddings}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        a = opts.get("softmax", {"rotary": True, "rotary_fraction": 0.5, "window": None})
        return (set(cfg.layers) <= {"mamba2", "softmax"} and "mamba2" in cfg.layers and cfg.mlp and cfg.moe is None
                and cfg.pos_emb == "none" and _plain_attention(cfg, opts) and opts["mamba2"]["norm_eps"] == cfg.norm_eps
                and a["rotary"] and a["rotary_fraction"] == 0.5 and a["window"] is None)


class _Jamba:
    """JambaForCausalLM: Mamba layers with weighted RMS norms on dt, B and C, softmax attention without
    positional encoding at every ``attn_layer_period``-th layer from ``attn_layer_offset``, and after each a
    SwiGLU MLP - a top-k mixture of experts at every ``expert_layer_period``-th layer from ``expert_layer_offset``."""

    model_type = "jamba"
    conv_bias_key = "mamba_conv_bias"

    @staticmethod
    def config(c: dict) -> ModelConfig:
        _check_hybrid(c)
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
        return _common(c, pattern, eps, moe=moe, mixer_options={"mamba": mamba, "softmax": {"rotary": False}})

    @staticmethod
    def names(cfg: ModelConfig) -> dict:
        p = ("A_log", "D", "in_proj.weight", "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "out_proj.weight")
        return _hybrid_names(cfg, {**{x: x for x in p}, "conv.weight": "conv1d.weight", "conv.bias": "conv1d.bias",
                                   "bcdt_norms.dt_norm.weight": "dt_layernorm.weight",
                                   "bcdt_norms.b_norm.weight": "b_layernorm.weight",
                                   "bcdt_norms.c_norm.weight": "c_layernorm.weight"})

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o, n = opts["mamba"], cfg.n_layers
        attn = [i for i, name in enumerate(cfg.layers) if name == "softmax"]
        period, offset = _period(attn, n)
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
        return (cfg.mlp and cfg.pos_emb == "none" and _plain_attention(cfg, opts) and o["bcdt_rms_weight"]
                and o["bcdt_rms_eps"] == cfg.norm_eps
                and not a["rotary"] and a["window"] is None and _period(attn, cfg.n_layers) is not None
                and (cfg.moe is None or (not cfg.moe["renormalize"] and _plain_moe(cfg.moe) and not cfg.moe["shared"]
                                         and cfg.moe["hidden"] in (None, cfg.mlp_hidden))))


def _layer_options(model) -> dict:
    """{mixer name: the options its layers were built with, read from the first such layer} for the names
    the checkpoint types use (defaults included, which a config's mixer_options may leave out)."""
    out = {}
    for block in model.blocks:
        name, m = block.mixer_name, block.mixer
        if name in out:
            continue
        if name == "mamba":
            out[name] = {"d_state": m.d_state, "expand": m.d_inner // m.d_model, "conv_size": m.conv.kernel_size,
                         "dt_rank": m.dt_rank, "bcdt_rms_eps": m.bcdt_rms_eps, "bcdt_rms_weight": m.bcdt_norms is not None}
        elif name == "mamba2":
            out[name] = {"d_state": m.d_state, "head_dim": m.head_dim, "expand": m.d_inner // m.d_model,
                         "n_groups": m.n_groups, "conv_size": m.conv.kernel_size, "dt_limit": m.dt_limit,
                         "norm_eps": m.norm.eps}
        elif name == "softmax":
            out[name] = {"rotary": m.rotary, "rotary_base": m.rotary_base, "window": m.window,
                         "rotary_fraction": m.rotary_dim / m.head_dim, "head_dim": m.head_dim,
                         "qk_norm": m.qk_norm, "qk_norm_eps": m.q_norm.eps if m.qk_norm else None,
                         "output_gate": m.output_gate}
        elif name == "lightning":
            out[name] = {"n_heads": m.n_heads, "head_dim": m.head_dim, "norm_eps": m.norm.eps}
        elif name == "kda":
            out[name] = {"n_heads": m.n_heads, "head_dim": m.head_dim, "conv_size": m.conv.kernel_size,
                         "gate_rank": m.gate_rank, "qk_eps": m.qk_eps, "norm_eps": m.norm.eps}
        elif name == "mla":
            out[name] = {"kv_rank": m.kv_rank, "rope_dim": m.rope_dim, "nope_dim": m.nope_dim,
                         "v_head_dim": m.v_head_dim, "q_rank": m.q_rank, "latent_eps": m.kv_a_norm.eps,
                         "rotary": m.rotary}
        elif name == "gated_deltanet":
            out[name] = {"n_heads": m.n_heads, "n_key_heads": m.n_key_heads, "head_dim": m.head_dim,
                         "value_head_dim": m.value_head_dim, "conv_size": m.conv.kernel_size,
                         "open_gate": m.gate_bias is not None, "qk_eps": m.qk_eps,
                         "allow_neg_eigval": m.allow_neg_eigval, "norm_eps": m.norm.eps}
    return out


def _plain_moe(m: dict) -> bool:
    """A softmax-routed MoE placed by every/offset (Jamba's, Qwen3-Next's)."""
    return m["router"] == "softmax" and m["layers"] is None and m["scale"] == 1.0


def _plain_attention(cfg: ModelConfig, opts: dict) -> bool:
    """Softmax layers (if any) without the options Bamba and Jamba do not have, in pre-norm blocks."""
    a = opts.get("softmax")
    return not cfg.post_norm and cfg.scaled_residual is None and (
        a is None or (a["qk_norm"] is None and not a["output_gate"] and a["head_dim"] * cfg.n_heads == cfg.d_model))


def _period(indices: list, n: int):
    """(period, offset) with ``i % period == offset`` exactly for ``indices`` among range(n), or None."""
    if not indices:
        return n + 1, n                               # never: no layer index reaches n
    for period in range(1, n + 1):
        offset = indices[0] % period
        if [i for i in range(n) if i % period == offset] == indices:
            return period, offset
    return None




def _backbone_names(cfg: ModelConfig, mixer_params) -> dict:
    """subquad name -> the checkpoint's, for the Mamba family's layout: backbone.{embeddings, layers.i.{norm,
    mixer.*}, norm_f} and lm_head; the mixer's short convolution is ``conv1d`` there, ``conv`` here."""
    out = {"embed.weight": "backbone.embeddings.weight", "norm.weight": "backbone.norm_f.weight"}
    for i in range(cfg.n_layers):
        a, b = f"blocks.{i}.", f"backbone.layers.{i}."
        out[a + "norm1.weight"] = b + "norm.weight"
        for p in mixer_params:
            out[a + "mixer." + p] = b + "mixer." + p
        out[a + "mixer.conv.weight"] = b + "mixer.conv1d.weight"
        out[a + "mixer.conv.bias"] = b + "mixer.conv1d.bias"
    if not cfg.tie_embeddings:
        out["head.weight"] = "lm_head.weight"
    return out


def _float(v) -> float:
    """A float from config.json; transformers writes infinities as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def _json_float(v: float):
    return {"__float__": "Infinity" if v > 0 else "-Infinity"} if math.isinf(v) else v


def _require(c: dict, key: str, value):
    if key in c and c[key] != value:
        raise ValueError(f"config field {key}={c[key]!r} is not supported (subquad implements {key}={value!r})")


def read_config(path) -> dict:
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not a model folder: it has no config.json")
    c = json.loads((path / "config.json").read_text())
    mt = c.get("model_type")
    if mt not in MAPPINGS:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {', '.join(sorted(MAPPINGS))}")
    return c


def eos_token_ids(path, config: dict | None = None) -> list[int]:
    """The folder's end-of-text ids, where transformers' ``generate`` stops: ``eos_token_id`` (an int or a
    list) of ``generation_config.json`` when it names one, else of ``config.json``; [] when neither does."""
    path = Path(path)
    gen = path / "generation_config.json"
    for source in ([json.loads(gen.read_text())] if gen.exists() else []) + [config or read_config(path)]:
        eos = source.get("eos_token_id")
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
        return sorted(set(ids))
    return []


def read_weights(path) -> dict:
    """Every tensor of the folder's safetensors file(s), by name."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} holds no model.safetensors (nor a sharded model.safetensors.index.json)")
    out = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def from_pretrained(path, dtype=None, device=None, quantize=None):
    """(LanguageModel in eval mode, tokenizer or None) from a Hugging Face model folder (see the module doc).
    ``quantize`` "int8" or "bf16" quantises the projections for inference (``models.quant``; from float32)."""
    from subquad.models.lm import LanguageModel
    from subquad.models.quant import QUANTIZE

    if quantize is not None and (quantize not in QUANTIZE or dtype not in (None, torch.float32)):
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)} with float32 weights, got quantize="
                         f"{quantize!r}, dtype={dtype}")

    c = read_config(path)
    mapping = MAPPINGS[c["model_type"]]
    cfg = mapping.config(c)
    cfg.eos_token_ids = [t for t in eos_token_ids(path, c) if t < cfg.vocab_size]   # generate stops there
    with torch.device("meta"):                        # no memory and no random init: the weights come next
        model = LanguageModel(cfg)
    names = mapping.names(cfg)
    tensors = read_weights(path)
    if hasattr(mapping, "unpack"):                    # fused or shifted tensors -> one per parameter of ours
        tensors = mapping.unpack(tensors, cfg, dtype)
    own = model.state_dict()
    if c.get(mapping.conv_bias_key, True) is False:   # no conv bias in the checkpoint: ours stays zero
        for ours, theirs in names.items():
            if ours.endswith("mixer.conv.bias"):
                tensors[theirs] = torch.zeros(own[ours].shape)
    wanted = [t for theirs in names.values() for t in (theirs if isinstance(theirs, tuple) else (theirs,))]
    missing = [t for t in wanted if t not in tensors]
    if missing:
        raise ValueError(f"{path}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    extra = set(tensors) - set(wanted) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if extra:
        raise ValueError(f"{path}: unexpected weights in the checkpoint: {', '.join(sorted(extra)[:5])}")
    state = {}
    for ours, theirs in names.items():
        parts = theirs if isinstance(theirs, tuple) else (theirs,)
        want = own[ours].shape[1:] if isinstance(theirs, tuple) else own[ours].shape
        for t in parts:
            if tensors[t].shape != want:
                raise ValueError(f"{path}: weight {t} has shape {tuple(tensors[t].shape)}, the config implies "
                                 f"{tuple(want)}")
        t = torch.stack([tensors.pop(t) for t in parts]) if isinstance(theirs, tuple) else tensors.pop(theirs)
        state[ours] = t.to(dtype) if dtype is not None and t.is_floating_point() else t   # one copy at a time
    model.load_state_dict(state, strict=True, assign=True)
    del state
    model.decode_layout()                             # the weights as one-token decoding reads them fastest
    if quantize is not None:
        from subquad.models.quant import quantize as quantize_model

        quantize_model(model, quantize)
    if device is not None:
        model.to(device=device)
    tok = None
    if (Path(path) / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return model.eval(), tok


def save_pretrained(model, path) -> None:
    """Write ``model`` as a Hugging Face folder (config.json, model.safetensors) that ``from_pretrained``
    and transformers read back. The model must have the structure of a supported type."""
    from safetensors.torch import save_file

    if getattr(model, "quantized", None):
        raise ValueError(f"a quantised model ({model.quantized}) is not saved: save the float model it came from")
    cfg = model.config
    opts = _layer_options(model)
    kind = next((m for m in MAPPINGS.values() if m.matches(cfg, opts)), None)
    if kind is None:
        raise ValueError(f"no Hugging Face model type has this structure (pattern {cfg.pattern!r}, mlp={cfg.mlp}, "
                         f"moe={cfg.moe}, options {cfg.mixer_options}); supported: {', '.join(sorted(MAPPINGS))}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    own = model.state_dict()
    tensors = {}
    for ours, theirs in kind.names(cfg).items():
        t = own[ours].detach().cpu()
        if isinstance(theirs, tuple):                       # stacked experts: one tensor each
            tensors.update({name: part.contiguous() for name, part in zip(theirs, t.unbind(0))})
        else:
            tensors[theirs] = t.contiguous()
    if hasattr(kind, "pack"):
        tensors = {n: t.contiguous() for n, t in kind.pack(tensors, cfg).items()}
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    conf = kind.to_config(cfg, opts)
    if cfg.eos_token_ids:
        conf["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids
    (path / "config.json").write_text(json.dumps(conf, indent=1))


from subquad.models.hf_delta import _OlmoHybrid, _Qwen3Next  # noqa: E402  (they use the helpers above)
from subquad.models.hf_kimi import _KimiLinear  # noqa: E402
from subquad.models.hf_minimax import _MiniMax  # noqa: E402

MAPPINGS = {m.model_type: m for m in (_Mamba, _FalconMamba, _Mamba2, _Bamba, _Jamba, _Qwen3Next, _OlmoHybrid,
                                      _KimiLinear, _MiniMax)}
