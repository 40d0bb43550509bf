"""``nemotron_h`` (NemotronHForCausalLM, NVIDIA Nemotron-H and Nemotron 3): every layer is one norm, one sublayer
and a residual, the sublayer chosen by ``hybrid_override_pattern`` (or ``layers_block_type``): "M" Mamba-2 (a
gated norm per group, dt clamped from ``time_step_min``), "*" softmax attention without positions (a head_dim of
its own), "-" an ungated squared-ReLU MLP, y = W_down relu(W_up x)^2, and "E" a mixture of experts (Nemotron 3
Nano's): ``n_routed_experts`` ungated squared-ReLU experts of ``moe_intermediate_size`` beside one shared
expert of ``moe_shared_expert_intermediate_size`` (``n_shared_experts`` changes nothing in transformers' math:
the shared width is that field alone), routed as DeepSeek-V3 - sigmoid scores, the score-correction bias to
choose, ``n_group`` / ``topk_group`` grouped top-``num_experts_per_tok``, weights renormalised with
``norm_topk_prob`` and times ``routed_scaling_factor`` (``models.moe``, ``router="sigmoid"``). With
``moe_latent_size`` the routed experts run in that narrower space (``fc1_latent_proj`` / ``fc2_latent_proj``);
the router and the shared expert read the layer's input. The head is ``lm_head`` whatever
``tie_word_embeddings`` says (transformers' Nemotron-H never ties it); a tied subquad model writes it out.

subquad's block is a mixer and an optional MLP, so each "M" or "*" layer becomes a block and an "-" or "E" layer
right after it becomes that block's MLP (``ModelConfig.mlp_layers`` lists the blocks that have one,
``mlp_kind="relu2"``; ``moe["layers"]`` those whose MLP is the mixture of experts): "M-M*EM" is four blocks,
the first, second and third with MLPs, the third's a MoE. An "-" or "E" layer after another "-" or "E" (or
first) is refused by name. The checkpoint's layer indices are the pattern's, so the name table writes a
block's parts against "M" (its mixer layer) and "F" (its MLP layer) and ``names`` numbers them.

Multi-token prediction (``num_nextn_predict_layers`` 1, the ``mtp.*`` tensors of checkpoints that carry it; which
transformers skips) loads as ``model.mtp`` (``models.mtp``, the drafter of ``generate(speculative="mtp")``): its
block is two layers, ``mtp_layers_block_type`` ["full_attention", "moe"] (or "mlp"), named as the backbone's,
"mtp.layers.0." the attention with the head's own ``enorm``, ``hnorm`` and ``eh_proj`` (the fc over [enorm(embed);
hnorm(h)]) and "mtp.layers.1." the MoE with the final ``final_layernorm`` - vLLM's ``nemotron_h_mtp.py`` reading.
A saved folder writes the head back and declares it; without one it says ``num_nextn_predict_layers`` 0.

Routing precision: transformers computes the router in float32 whatever the model's dtype; subquad computes the
router's logits in the model's dtype (the sigmoid and the choice in float32 at least), as for Kimi Linear - equal
in float32 and float64, and a bfloat16 model may route a near tie differently.
"""

from __future__ import annotations

import re

from subquad.models.config import ModelConfig
from subquad.models.hf.common import Format, config_float, json_float, require

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
_PART = re.compile(r"backbone\.layers\.(\d+)\.([MF])\.")


def layer_types(c: dict) -> list:
    """One of "linear_attention", "full_attention", "mlp", "moe" per checkpoint layer."""
    pattern = c.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if set(pattern) - set(PATTERN):
            raise ValueError(f"config field hybrid_override_pattern={pattern!r} may hold only M, *, - and E")
        return [PATTERN[ch] for ch in pattern]
    types = c.get("layers_block_type") or c.get("layer_types")
    if not isinstance(types, list):
        raise ValueError("config field hybrid_override_pattern (or layers_block_type) must give the layers")
    return [LEGACY_TYPES.get(t, t) for t in types]


def blocks(types: list) -> tuple[list, list, list]:
    """(the blocks' mixers, the blocks that have an MLP, those whose MLP is a MoE) from the checkpoint's layers."""
    mixers, mlps, moes = [], [], []
    for i, t in enumerate(types):
        if t in ("linear_attention", "full_attention"):
            mixers.append("mamba2" if t == "linear_attention" else "softmax")
        elif t in ("mlp", "moe") and types[i - 1:i] in (["linear_attention"], ["full_attention"]):
            mlps.append(len(mixers) - 1)
            if t == "moe":
                moes.append(len(mixers) - 1)
        elif t in ("mlp", "moe"):
            raise ValueError(f"config field hybrid_override_pattern: the {'MLP' if t == 'mlp' else 'MoE'} layer {i} "
                             "does not follow a Mamba or attention layer (subquad places an MLP after a mixer only)")
        else:
            raise ValueError(f"config field hybrid_override_pattern: layer {i} is {t!r}, which is not supported "
                             "(subquad reads M, *, - and E)")
    return mixers, mlps, moes


def _int(c: dict, key: str, default: int, low: int = 1) -> int:
    v = c.get(key, default)
    v = default if v is None else v
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"config field {key}={v!r} must be an int >= {low}")
    return v


def moe_options(c: dict, layers: list) -> dict:
    """``ModelConfig.moe`` from the config's MoE fields (module doc), the MoE blocks ``layers``."""
    experts = _int(c, "n_routed_experts", c.get("num_local_experts") or 8, 2)
    top_k, groups = _int(c, "num_experts_per_tok", 2), _int(c, "n_group", 1)
    topk_groups = _int(c, "topk_group", 1)
    if top_k > experts:
        raise ValueError(f"config field num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    if experts % groups or topk_groups > groups:
        raise ValueError(f"config fields n_group={groups} must divide n_routed_experts={experts} and topk_group="
                         f"{topk_groups} be at most n_group")
    if topk_groups * (experts // groups) < top_k:
        raise ValueError(f"config fields topk_group={topk_groups} groups of {experts // groups} experts hold fewer "
                         f"than num_experts_per_tok={top_k}")
    scale = config_float(c.get("routed_scaling_factor", 1.0))
    if not scale > 0:
        raise ValueError(f"config field routed_scaling_factor={scale!r} must be positive")
    moe = {"experts": experts, "top_k": top_k, "hidden": _int(c, "moe_intermediate_size", 7688),
           "shared": _int(c, "moe_shared_expert_intermediate_size", 7688), "shared_gate": False,
           "router": "sigmoid", "groups": groups, "topk_groups": topk_groups, "scale": scale,
           "renormalize": bool(c.get("norm_topk_prob", True)), "renorm_eps": 1e-20, "aux_loss_coef": 0.0,
           "layers": layers}
    if c.get("moe_latent_size") is not None:
        moe["latent"] = _int(c, "moe_latent_size", 1)
    return moe


class NemotronHFormat(Format):
    model_type = "nemotron_h"
    conv_bias_key = "use_conv_bias"
    any_mlp = True
    latent_moe = True
    mtp_layers = 2                                     # the head's block: its attention layer, its MoE (or MLP)
    mtp_own = {"mtp.fc.weight": "mtp.layers.0.eh_proj.weight", "mtp.norm_embed.weight": "mtp.layers.0.enorm.weight",
               "mtp.norm_hidden.weight": "mtp.layers.0.hnorm.weight",
               "mtp.norm.weight": "mtp.layers.1.final_layernorm.weight"}
    top = {"embed.weight": "backbone.embeddings.weight", "norm.weight": "backbone.norm_f.weight",
           "head.weight": "lm_head.weight"}
    layer = "backbone.layers.{i}."                     # {i} the block; M. and F. its two layers (module doc)
    layers = {"mamba2": {"mixer.conv.{p}": "M.mixer.conv1d.{p}", "mixer.{p}": "M.mixer.{p}"},
              "softmax": {"mixer.{p}": "M.mixer.{p}"},
              "*": {"norm1.weight": "M.norm.weight", "norm2.weight": "F.norm.weight",
                    "mlp.w_up.weight": "F.mixer.up_proj.weight", "mlp.w_down.weight": "F.mixer.down_proj.weight",
                    "mlp.router.weight": "F.mixer.gate.weight",
                    "mlp.score_bias": "F.mixer.gate.e_score_correction_bias",
                    "mlp.w_up": "F.mixer.experts.{e}.up_proj.weight",               # stacked experts: one each
                    "mlp.w_down": "F.mixer.experts.{e}.down_proj.weight",
                    "mlp.shared.w_up.weight": "F.mixer.shared_experts.up_proj.weight",
                    "mlp.shared.w_down.weight": "F.mixer.shared_experts.down_proj.weight",
                    "mlp.latent_in.weight": "F.mixer.fc1_latent_proj.weight",
                    "mlp.latent_out.weight": "F.mixer.fc2_latent_proj.weight"}}

    @staticmethod
    def mtp_fields(head) -> dict:
        return {"num_nextn_predict_layers": 1,
                "mtp_layers_block_type": ["full_attention", "moe" if head.config.moe is not None else "mlp"]}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "mamba_hidden_act", "silu")
        require(c, "mlp_hidden_act", "relu2")
        for key in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias"):
            require(c, key, False)
        require(c, "sliding_window", None)
        mixers, mlps, moes = blocks(layer_types(c))
        H, eps = c["hidden_size"], c.get("layer_norm_epsilon", 1e-5)
        heads, hd = c.get("mamba_num_heads", 128), c.get("mamba_head_dim", 64)
        if heads * hd % H:
            raise ValueError(f"config fields mamba_num_heads={heads} x mamba_head_dim={hd} must be a multiple of "
                             f"hidden_size={H} (subquad's Mamba-2 is expand x hidden_size wide)")
        m2 = {"d_state": c.get("ssm_state_size", 128), "head_dim": hd, "expand": heads * hd // H,
              "conv_size": c.get("conv_kernel", 4), "n_groups": c.get("n_groups", 8), "norm_eps": eps,
              # transformers clamps dt to [time_step_min, inf) (time_step_limit unread)
              "dt_limit": (config_float(c.get("time_step_min", 0.001)), float("inf"))}
        soft = {"rotary": False, "head_dim": c.get("head_dim") or H // c["num_attention_heads"]}
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=len(mixers),
                           n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads"),
                           pattern=",".join(mixers), mlp=bool(mlps), mlp_size=c.get("intermediate_size"),
                           mlp_kind="relu2", mlp_layers=mlps or None, norm_eps=eps,
                           moe=moe_options(c, moes) if moes else None,
                           tie_embeddings=False, context_length=1 << 20,   # transformers never ties them
                           mixer_options={"mamba2": m2, "softmax": soft})

    @classmethod
    def names(cls, cfg: ModelConfig, shapes: dict) -> dict:
        """The table's names, each block's M. and F. turned into its mixer's and MLP's checkpoint layers."""
        with_mlp = set(range(cfg.n_layers) if cfg.mlp_layers is None else cfg.mlp_layers) if cfg.mlp else set()
        first = [b + sum(1 for x in with_mlp if x < b) for b in range(cfg.n_layers)]   # a block's mixer layer

        def real(name):
            return _PART.sub(lambda m: f"backbone.layers.{first[int(m[1])] + (m[2] == 'F')}.", name)

        return {k: tuple(map(real, v)) if isinstance(v, tuple) else real(v)
                for k, v in super().names(cfg, shapes).items()}

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """Names under ``model.`` (transformers' in memory) read as the checkpoint's ``backbone.``."""
        return {"backbone." + n.removeprefix("model.") if n.startswith("model.") else n: t for n, t in tensors.items()}

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        """A tied head written out (transformers' Nemotron-H reads lm_head whatever tie_word_embeddings says)."""
        if cfg.tie_embeddings:
            tensors = {**tensors, "lm_head.weight": tensors["backbone.embeddings.weight"].clone()}
        return tensors

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o, a = opts.get("mamba2"), opts.get("softmax")
        with_mlp = set(range(cfg.n_layers) if cfg.mlp_layers is None else cfg.mlp_layers) if cfg.mlp else set()
        moes, m = set(cfg.moe_layers), cfg.moe
        pattern = "".join(("M" if n == "mamba2" else "*") + ("E" if b in moes else "-" if b in with_mlp else "")
                          for b, n in enumerate(cfg.layers))
        out = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.d_model, "num_hidden_layers": len(pattern), "hybrid_override_pattern": pattern,
               "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
               "head_dim": a["head_dim"] if a else cfg.d_model // cfg.n_heads, "intermediate_size": cfg.mlp_hidden,
               "layer_norm_epsilon": cfg.norm_eps, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
               "use_bias": False, "mlp_bias": False, "attention_bias": False, "use_conv_bias": True,
               "tie_word_embeddings": False, "num_nextn_predict_layers": 0,     # no multi-token prediction written
               "layers_block_type": [{"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}[x]
                                     for x in pattern]}
        if m is not None:
            out.update({"n_routed_experts": m["experts"], "num_experts_per_tok": m["top_k"],
                        "moe_intermediate_size": m["hidden"] or cfg.mlp_hidden,
                        "moe_shared_expert_intermediate_size": m["shared"],     # n_shared_experts: unused
                        "n_group": m["groups"], "topk_group": m["topk_groups"], "routed_scaling_factor": m["scale"],
                        "norm_topk_prob": m["renormalize"], "moe_latent_size": m.get("latent")})
        if o is not None:
            out.update({"mamba_num_heads": o["expand"] * cfg.d_model // o["head_dim"], "mamba_head_dim": o["head_dim"],
                        "ssm_state_size": o["d_state"], "n_groups": o["n_groups"], "conv_kernel": o["conv_size"],
                        "expand": o["expand"], "time_step_min": json_float(o["dt_limit"][0])})
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        o, a, m = opts.get("mamba2"), opts.get("softmax"), cfg.moe
        moe_ok = m is None or (m["router"] == "sigmoid" and not m["shared_gate"] and m["shared"] > 0
                               and m["renorm_eps"] == 1e-20)
        return (set(cfg.layers) <= {"mamba2", "softmax"} and moe_ok and cfg.pos_emb == "none"
                and not cfg.post_norm and cfg.scaled_residual is None and (not cfg.mlp or cfg.mlp_kind == "relu2")
                and (o is None or (o["norm_eps"] == cfg.norm_eps and o["dt_limit"][1] == float("inf")))
                and (a is None or (not a["rotary"] and a["qk_norm"] is None and not a["output_gate"]
                                   and a["window"] is None)))
