"""``nemotron_h`` (NemotronHForCausalLM, NVIDIA Nemotron-H): every layer is one norm, one sublayer and a
residual, the sublayer chosen by ``hybrid_override_pattern`` (or ``layers_block_type``): "M" Mamba-2 (a gated
norm per group, dt clamped from ``time_step_min``), "*" softmax attention without positions (a head_dim of
its own), "-" an ungated squared-ReLU MLP, y = W_down relu(W_up x)^2. The head is ``lm_head`` whatever
``tie_word_embeddings`` says (transformers' Nemotron-H never ties it); a tied subquad model writes it out.

subquad's block is a mixer and an optional MLP, so each "M" or "*" layer becomes a block and an "-" layer
right after it becomes that block's MLP (``ModelConfig.mlp_layers`` lists the blocks that have one,
``mlp_kind="relu2"``): "M-M*-M" is four blocks, the first, second and third with MLPs. An "-" layer after
another "-" (or first), and "E" (the mixture-of-experts layers of the MoE variants: ungated squared-ReLU
experts, sigmoid routing) are refused by name. The checkpoint's layer indices are the pattern's, so the name
table writes a block's parts against "M" (its mixer layer) and "F" (its MLP layer) and ``names`` numbers them.
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


def blocks(types: list) -> tuple[list, list]:
    """(the blocks' mixers, the blocks that have an MLP) from the checkpoint's layer types."""
    mixers, mlps = [], []
    for i, t in enumerate(types):
        if t in ("linear_attention", "full_attention"):
            mixers.append("mamba2" if t == "linear_attention" else "softmax")
        elif t == "mlp" and types[i - 1:i] in (["linear_attention"], ["full_attention"]):
            mlps.append(len(mixers) - 1)
        elif t == "mlp":
            raise ValueError(f"config field hybrid_override_pattern: the MLP layer {i} does not follow a Mamba or "
                             "attention layer (subquad places an MLP after a mixer only)")
        else:
            raise ValueError(f"config field hybrid_override_pattern: layer {i} is {t!r}, which is not supported "
                             "(subquad reads M, * and -; not Nemotron-H's mixture-of-experts layers, E)")
    return mixers, mlps


class NemotronHFormat(Format):
    model_type = "nemotron_h"
    conv_bias_key = "use_conv_bias"
    any_mlp = True
    top = {"embed.weight": "backbone.embeddings.weight", "norm.weight": "backbone.norm_f.weight",
           "head.weight": "lm_head.weight"}
    layer = "backbone.layers.{i}."                     # {i} the block; M. and F. its two layers (module doc)
    layers = {"mamba2": {"mixer.conv.{p}": "M.mixer.conv1d.{p}", "mixer.{p}": "M.mixer.{p}"},
              "softmax": {"mixer.{p}": "M.mixer.{p}"},
              "*": {"norm1.weight": "M.norm.weight", "norm2.weight": "F.norm.weight",
                    "mlp.w_up.weight": "F.mixer.up_proj.weight", "mlp.w_down.weight": "F.mixer.down_proj.weight"}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "mamba_hidden_act", "silu")
        require(c, "mlp_hidden_act", "relu2")
        for key in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias"):
            require(c, key, False)
        require(c, "sliding_window", None)
        mixers, mlps = blocks(layer_types(c))
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
        pattern = "".join(("M" if n == "mamba2" else "*") + ("-" if b in with_mlp else "")
                          for b, n in enumerate(cfg.layers))
        out = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.d_model, "num_hidden_layers": len(pattern), "hybrid_override_pattern": pattern,
               "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
               "head_dim": a["head_dim"] if a else cfg.d_model // cfg.n_heads, "intermediate_size": cfg.mlp_hidden,
               "layer_norm_epsilon": cfg.norm_eps, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
               "use_bias": False, "mlp_bias": False, "attention_bias": False, "use_conv_bias": True,
               "tie_word_embeddings": False}
        if o is not None:
            out.update({"mamba_num_heads": o["expand"] * cfg.d_model // o["head_dim"], "mamba_head_dim": o["head_dim"],
                        "ssm_state_size": o["d_state"], "n_groups": o["n_groups"], "conv_kernel": o["conv_size"],
                        "expand": o["expand"], "time_step_min": json_float(o["dt_limit"][0])})
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        o, a = opts.get("mamba2"), opts.get("softmax")
        return (set(cfg.layers) <= {"mamba2", "softmax"} and cfg.moe is None and cfg.pos_emb == "none"
                and not cfg.post_norm and cfg.scaled_residual is None and (not cfg.mlp or cfg.mlp_kind == "relu2")
                and (o is None or (o["norm_eps"] == cfg.norm_eps and o["dt_limit"][1] == float("inf")))
                and (a is None or (not a["rotary"] and a["qk_norm"] is None and not a["output_gate"]
                                   and a["window"] is None)))
