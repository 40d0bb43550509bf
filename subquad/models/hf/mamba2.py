"""``mamba2`` (Mamba2ForCausalLM): embedding, blocks of rmsnorm -> Mamba-2 mixer (SSD, B and C per group,
the gated norm per group with the config's epsilon, ``time_step_limit``), rmsnorm, head (untied by default)."""

from __future__ import annotations

from subquad.models.config import ModelConfig
from subquad.models.hf.common import config_float, json_float, require
from subquad.models.hf.mamba import BackboneFormat, pure


class Mamba2Format(BackboneFormat):
    model_type = "mamba2"

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_act", "silu")
        require(c, "use_bias", False)
        require(c, "rms_norm", True)
        require(c, "norm_before_gate", False)
        H, E = c["hidden_size"], c.get("expand", 2)
        heads, hd = c.get("num_heads", 128), c.get("head_dim", 64)
        if heads * hd != int(E * H):
            raise ValueError(f"config fields num_heads={heads} x head_dim={hd} must equal expand x hidden_size = "
                             f"{int(E * H)}")
        eps = c.get("layer_norm_epsilon", 1e-5)
        opts = {"d_state": c.get("state_size", 128), "head_dim": hd, "expand": E, "conv_size": c.get("conv_kernel", 4),
                "n_groups": c.get("n_groups", 1), "norm_eps": eps}
        limit = tuple(config_float(v) for v in c.get("time_step_limit", (0.0, float("inf"))))
        if limit != (0.0, float("inf")):
            opts["dt_limit"] = limit
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=c["num_hidden_layers"], n_heads=1,
                           pattern="mamba2", mlp=False, norm_eps=eps, tie_embeddings=c.get("tie_word_embeddings", False),
                           context_length=1 << 20, mixer_options={"mamba2": opts})

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o = opts["mamba2"]
        return {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "state_size": o["d_state"],
                "head_dim": o["head_dim"], "num_heads": o["expand"] * cfg.d_model // o["head_dim"],
                "expand": o["expand"], "n_groups": o["n_groups"], "conv_kernel": o["conv_size"],
                "layer_norm_epsilon": cfg.norm_eps, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
                "time_step_limit": [json_float(v) for v in o["dt_limit"]],
                "tie_word_embeddings": cfg.tie_embeddings, "residual_in_fp32": True}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        return pure(cfg, "mamba2") and opts["mamba2"]["norm_eps"] == cfg.norm_eps
