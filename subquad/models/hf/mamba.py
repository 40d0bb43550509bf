"""``mamba`` (MambaForCausalLM) and ``falcon_mamba`` (FalconMambaForCausalLM): embedding, blocks of rmsnorm ->
Mamba mixer (a residual each, no MLP), rmsnorm, tied or untied head. Falcon-Mamba adds a weightless RMS
norm on dt, B and C (``mixer_rms_eps``)."""

from __future__ import annotations

import math

from subquad.models.config import ModelConfig
from subquad.models.hf.common import Format, require

BACKBONE = {"embed.weight": "backbone.embeddings.weight", "norm.weight": "backbone.norm_f.weight",
            "head.weight": "lm_head.weight"}


def pure(cfg: ModelConfig, layer: str) -> bool:
    """Every layer is ``layer``, with no MLP and no learned positions (the Mamba family's structure)."""
    return set(cfg.layers) == {layer} and not cfg.mlp and cfg.pos_emb == "none"


class BackboneFormat(Format):
    """The names Mamba and Mamba-2 checkpoints share: ``backbone.layers.{i}.`` with a norm and a mixer."""
    conv_bias_key = "use_conv_bias"
    top = BACKBONE
    layer = "backbone.layers.{i}."
    layers = {"*": {"norm1.weight": "norm.weight",
                    "mixer.conv.{p}": "mixer.conv1d.{p}",
                    "mixer.{p}": "mixer.{p}"}}


class MambaFormat(BackboneFormat):
    model_type = "mamba"

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_act", "silu")
        require(c, "use_bias", False)
        H, E = c["hidden_size"], c.get("expand", 2)
        if c.get("intermediate_size", E * H) != E * H:
            raise ValueError(f"config fields intermediate_size={c['intermediate_size']}, expand={E} and "
                             f"hidden_size={H} disagree: intermediate_size must be expand * hidden_size = {E * H}")
        rank = c.get("time_step_rank", "auto")
        rank = math.ceil(H / 16) if rank == "auto" else int(rank)
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=c["num_hidden_layers"], n_heads=1,
                           pattern="mamba", mlp=False, norm_eps=c.get("layer_norm_epsilon", 1e-5),
                           tie_embeddings=c.get("tie_word_embeddings", True), context_length=1 << 20,
                           mixer_options={"mamba": {"d_state": c.get("state_size", 16), "expand": E,
                                                    "conv_size": c.get("conv_kernel", 4), "dt_rank": rank}})

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o = opts["mamba"]
        return {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "state_size": o["d_state"],
                "expand": o["expand"], "intermediate_size": o["expand"] * cfg.d_model, "conv_kernel": o["conv_size"],
                "time_step_rank": o["dt_rank"], "layer_norm_epsilon": cfg.norm_eps, "use_bias": False,
                "use_conv_bias": True, "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
                "residual_in_fp32": True}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        return pure(cfg, "mamba") and opts["mamba"]["bcdt_rms_eps"] is None and opts["mamba"]["heads"] == 1


class FalconMambaFormat(MambaFormat):
    model_type = "falcon_mamba"

    @staticmethod
    def config(c: dict) -> ModelConfig:
        cfg = MambaFormat.config(c)
        cfg.mixer_options["mamba"]["bcdt_rms_eps"] = c.get("mixer_rms_eps", 1e-6)
        return cfg

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        return {**MambaFormat.to_config(cfg, opts), "model_type": "falcon_mamba",
                "architectures": ["FalconMambaForCausalLM"], "mixer_rms_eps": opts["mamba"]["bcdt_rms_eps"]}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        return (pure(cfg, "mamba") and opts["mamba"]["bcdt_rms_eps"] is not None and opts["mamba"]["heads"] == 1
                and not opts["mamba"]["bcdt_rms_weight"])
