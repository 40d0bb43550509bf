"""``rwkv7`` (fla-hub's RWKV7ForCausalLM, flash-linear-attention's ``fla/models/rwkv7``): embedding, a LayerNorm
on it (layer 0's ``pre_norm``), blocks of LayerNorm -> RWKV-7 time mix (``layers/rwkv7.py``) and LayerNorm ->
channel mix (``layers/channel_mix.py``), all norms with biases, a final LayerNorm and an untied head.

fla's names are subquad's but for the prefixes and the LoRAs' ``lora.`` level; its token-shift mixes
``attn.x_r`` .. ``attn.x_g`` are (1, 1, D) (ours (D,)), and layer 0 has no ``v_lora`` (the first layer has no
value residual; subquad's layer 0 holds an unused one, zeros on loading, dropped on saving). The per-head
GroupNorm's epsilon is ``head_dim * norm_eps`` (BlinkDL's 64e-5). The BlinkDL ``.pth`` layout of the same
model is ``rwkv7_pth.py``.
"""

from __future__ import annotations

import math

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import Format, require

MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
LORAS = ("w", "a", "v", "g")


def rwkv7_config(vocab: int, d_model: int, n_layers: int, head_dim: int, ranks: dict, mlp_size: int,
                 norm_eps: float, group_norm_eps: float, tie: bool = False) -> ModelConfig:
    """The ModelConfig of an RWKV-7 model: ``ranks`` {"decay_rank", "a_rank", "v_rank", "gate_rank"} (None: the
    layer's default), LayerNorms (``norm_eps``) with layer 0's ``ln0``, channel-mix MLPs of ``mlp_size``."""
    if head_dim <= 0 or d_model % head_dim:
        raise ValueError(f"head_dim={head_dim} must divide hidden_size={d_model}")
    return ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=d_model // head_dim,
                       pattern="rwkv7", mixer_options={"rwkv7": {**ranks, "norm_eps": group_norm_eps}},
                       mlp=True, mlp_size=mlp_size, mlp_kind="rwkv7", norm="layer", embed_norm=True,
                       norm_eps=norm_eps, tie_embeddings=tie, context_length=1 << 20)


def is_rwkv7(cfg: ModelConfig) -> bool:
    """Every layer RWKV-7 in RWKV's block layout (what both RWKV-7 formats hold)."""
    return (set(cfg.layers) == {"rwkv7"} and cfg.norm == "layer" and cfg.embed_norm and cfg.mlp
            and cfg.mlp_kind == "rwkv7" and cfg.moe is None and cfg.pos_emb == "none" and not cfg.post_norm
            and cfg.scaled_residual is None)


def first_layer_v_lora(tensors: dict, cfg: ModelConfig, names: dict) -> dict:
    """``tensors`` plus zeros for layer 0's value-residual LoRA where the checkpoint has none (it is unused):
    ``names`` {"down", "up", "bias"} -> layer 0's checkpoint names, the tensors in subquad's shapes."""
    D, r = cfg.d_model, tensors_rank(cfg)
    out = dict(tensors)
    for part, shape in (("down", (r, D)), ("up", (D, r)), ("bias", (D,))):
        out.setdefault(names[part], torch.zeros(shape))
    return out


def tensors_rank(cfg: ModelConfig) -> int:
    """The value-residual LoRA's width as the built layers resolve it (``v_rank``, else the layer's default)."""
    from subquad.layers.rwkv7 import default_ranks

    opts = cfg.mixer_options["rwkv7"]
    return opts.get("v_rank") or default_ranks(cfg.d_model, cfg.d_model // cfg.n_heads)["v_rank"]


class RWKV7Format(Format):
    model_type = "rwkv7"
    any_mlp = any_norm = True            # matches() holds the model to RWKV's channel mix and LayerNorms (is_rwkv7)
    top = {"embed.weight": "model.embeddings.weight", "embed_norm.{p}": "model.layers.0.pre_norm.{p}",
           "norm.{p}": "model.norm.{p}", "head.weight": "lm_head.weight"}
    layer = "model.layers.{i}."
    layers = {"*": {"norm1.{p}": "attn_norm.{p}", "norm2.{p}": "ffn_norm.{p}",
                    **{f"mixer.{n}_lora.{{p}}": f"attn.{n}_lora.lora.{{p}}" for n in LORAS},
                    "mixer.{p}": "attn.{p}", "mlp.{p}": "ffn.{p}"}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_act", "sqrelu")
        require(c, "norm_first", True)
        require(c, "norm_bias", True)
        if c.get("attn") is not None:
            raise ValueError(f"config field attn={c['attn']!r} (softmax attention layers in an RWKV-7 model) is not "
                             "supported")
        D, n = c["hidden_size"], c["num_hidden_layers"]
        vd = c.get("value_dim")
        if vd is not None and any(v != D for v in (vd if isinstance(vd, list) else [vd])):
            raise ValueError(f"config field value_dim={vd!r} is not supported (subquad's RWKV-7 has value_dim = "
                             f"hidden_size = {D})")
        head_dim = c.get("head_dim", 64)               # fla's default; its layer takes head_dim over num_heads
        if head_dim is None:
            head_dim = D // c["num_heads"]
        elif c.get("num_heads") not in (None, D // head_dim):
            raise ValueError(f"config fields head_dim={head_dim} and num_heads={c['num_heads']} disagree with "
                             f"hidden_size={D}")
        mlp = c.get("intermediate_size")
        if mlp is None:                                  # fla: hidden_ratio * D rounded up to a multiple of 32
            mlp = 32 * -(-int(D * (c.get("hidden_ratio") or 4)) // 32)
        eps = c.get("norm_eps", 1e-5)
        ranks = {"decay_rank": c.get("decay_low_rank_dim"), "a_rank": c.get("a_low_rank_dim"),
                 "v_rank": c.get("v_low_rank_dim"), "gate_rank": c.get("gate_low_rank_dim")}
        return rwkv7_config(c["vocab_size"], D, n, head_dim, ranks, mlp, eps, head_dim * eps,
                            c.get("tie_word_embeddings", False))

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o = opts["rwkv7"]
        return {"model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "head_dim": cfg.d_model // cfg.n_heads,
                "num_heads": cfg.n_heads, "decay_low_rank_dim": o["decay_rank"], "a_low_rank_dim": o["a_rank"],
                "v_low_rank_dim": o["v_rank"], "gate_low_rank_dim": o["gate_rank"], "hidden_act": "sqrelu",
                "intermediate_size": cfg.mlp_hidden,
                "norm_first": True, "norm_bias": True, "norm_eps": cfg.norm_eps, "attn": None, "value_dim": None,
                "tie_word_embeddings": cfg.tie_embeddings}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        return is_rwkv7(cfg) and math.isclose(opts["rwkv7"]["norm_eps"], cfg.d_model // cfg.n_heads * cfg.norm_eps)

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        out = {k: (t.reshape(-1) if k.rsplit(".", 1)[-1] in MIXES and ".attn." in k else t) for k, t in tensors.items()}
        p = "model.layers.0.attn.v_lora.lora."
        return first_layer_v_lora(out, cfg, {"down": p + "0.weight", "up": p + "2.weight", "bias": p + "2.bias"})

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        return {k: (t.reshape(1, 1, -1) if k.rsplit(".", 1)[-1] in MIXES and ".attn." in k else t)
                for k, t in tensors.items() if not k.startswith("model.layers.0.attn.v_lora.")}
