"""``recurrent_gemma`` (RecurrentGemmaForCausalLM; Griffin, De et al. 2024): Griffin's recurrent blocks (the RG-LRU,
``layers.griffin``) and local multi-query attention (``swa``: a window, partial rotary, a bias on o_proj) in the
order of ``block_types`` repeated over the layers; pre-norm blocks with zero-centred RMS norms (x * (1 + w)),
GeGLU MLPs with biases (gelu-tanh, width intermediate_size / 2), embeddings times sqrt(hidden_size) rounded to
bfloat16 (transformers keeps that factor as a bfloat16 buffer), tied embeddings and logits soft-capped:
cap * tanh(logits / cap).

Its attention window counts the query itself: ``attention_window_size`` keys, subquad's ``window`` + 1.
``unpack`` adds the zero-centred norms' 1; ``pack`` takes it off.
"""

from __future__ import annotations

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import Format, config_float, gdn_rope, require

BLOCKS = {"recurrent": "rglru", "attention": "swa"}


def embed_scale(d_model: int) -> float:
    """sqrt(d_model) as transformers' RecurrentGemma applies it: rounded to bfloat16."""
    return float(torch.tensor(d_model ** 0.5, dtype=torch.bfloat16))


class RecurrentGemmaFormat(Format):
    model_type = "recurrent_gemma"
    top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.final_norm.weight",
           "head.weight": "lm_head.weight"}
    layers = {"rglru": {"mixer.conv.{p}": "temporal_block.conv_1d.{p}",
                        "mixer.out_proj.{p}": "temporal_block.linear_out.{p}",
                        "mixer.linear_{p}": "temporal_block.linear_{p}",
                        "mixer.{p}": "temporal_block.rg_lru.{p}"},      # the gates' weights, recurrent_param
              "swa": {"mixer.{p}": "temporal_block.{p}"},
              "*": {"norm1.weight": "temporal_pre_norm.weight", "norm2.weight": "channel_pre_norm.weight",
                    "mlp.w_gate.{p}": "mlp_block.gate_proj.{p}", "mlp.w_up.{p}": "mlp_block.up_proj.{p}",
                    "mlp.w_down.{p}": "mlp_block.down_proj.{p}"}}
    _ZERO_CENTRED = ("temporal_pre_norm.weight", "channel_pre_norm.weight", "model.final_norm.weight")

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_activation", "gelu_pytorch_tanh")
        require(c, "attention_bias", False)
        D, heads, n = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
        hd = c.get("head_dim")
        if hd is not None and hd != D // heads:
            raise ValueError(f"config field head_dim={hd} is not supported (RecurrentGemma's attention uses "
                             f"hidden_size / num_attention_heads = {D // heads})")
        types = list(c.get("block_types", ("recurrent", "recurrent", "attention")))
        if not types or set(types) - set(BLOCKS):
            raise ValueError(f"config field block_types={types!r} must name 'recurrent' or 'attention' blocks")
        window = c.get("attention_window_size", 2048)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"config field attention_window_size={window!r} must be a positive int")
        cap = c.get("logits_soft_cap", 30.0)
        if cap is None or config_float(cap) <= 0:
            raise ValueError(f"config field logits_soft_cap={cap!r} must be a positive number")
        pattern = ",".join(BLOCKS[t] for t in (types * n)[:n])
        swa = {**gdn_rope(c, 0.5), "window": window - 1, "o_bias": True}
        rglru = {"lru_width": c.get("lru_width") or D, "conv_size": c.get("conv1d_width", 4)}
        return ModelConfig(vocab_size=c["vocab_size"], d_model=D, n_layers=n, n_heads=heads,
                           n_kv_heads=c.get("num_key_value_heads"), pattern=pattern, mlp=True,
                           mlp_size=c["intermediate_size"] // 2, mlp_kind="geglu", mlp_bias=True,
                           norm_eps=c.get("rms_norm_eps", 1e-6), tie_embeddings=c.get("tie_word_embeddings", True),
                           context_length=1 << 20, embed_scale=embed_scale(D), logit_soft_cap=config_float(cap),
                           mixer_options={"rglru": rglru, "swa": swa})

    @classmethod
    def plain(cls, cfg: ModelConfig, opts: dict) -> bool:
        return True                                   # its options are its own: ``matches`` checks them

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        return {n: (t.float() + 1).to(dtype or t.dtype) if n.endswith(cls._ZERO_CENTRED) else t
                for n, t in tensors.items()}

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        return {n: (t.float() - 1).to(t.dtype) if n.endswith(cls._ZERO_CENTRED) else t for n, t in tensors.items()}

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        r = opts["rglru"]
        a = opts.get("swa", {"window": 2047, "rotary_base": 10000.0, "rotary_fraction": 0.5})
        return {"model_type": "recurrent_gemma", "architectures": ["RecurrentGemmaForCausalLM"],
                "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": 2 * cfg.mlp_hidden,
                "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
                "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "head_dim": cfg.d_model // cfg.n_heads,
                "lru_width": r["lru_width"], "conv1d_width": r["conv_size"], "attention_window_size": a["window"] + 1,
                "block_types": ["recurrent" if name == "rglru" else "attention" for name in cfg.layers],
                "logits_soft_cap": cfg.logit_soft_cap, "rms_norm_eps": cfg.norm_eps,
                "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                "tie_word_embeddings": cfg.tie_embeddings,
                "rope_parameters": {"rope_type": "default", "rope_theta": a["rotary_base"],
                                    "partial_rotary_factor": a["rotary_fraction"]}}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if not (set(cfg.layers) <= set(BLOCKS.values()) and "rglru" in cfg.layers):
            return False
        a = opts.get("swa")
        attn_ok = a is None or (a["o_bias"] and a["rotary"] and a["window"] is not None and a["qk_norm"] is None
                                and not a["output_gate"] and a["head_dim"] * cfg.n_heads == cfg.d_model)
        return (attn_ok and cfg.mlp and cfg.moe is None and cfg.mlp_kind == "geglu" and cfg.mlp_bias
                and cfg.embed_scale == embed_scale(cfg.d_model) and cfg.logit_soft_cap is not None
                and cfg.pos_emb == "none" and not cfg.post_norm and cfg.scaled_residual is None and not cfg.norm_bias)
