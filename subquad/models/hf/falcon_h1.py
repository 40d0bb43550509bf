"""``falcon_h1`` (FalconH1ForCausalLM, TII's Falcon-H1): every layer runs Mamba-2 and softmax attention (GQA,
full rotary, a head_dim of its own) side by side on one normed input and sums them (``lm.ParallelBlock``:
``ModelConfig.parallel = {"mamba2": "softmax"}``), then a SwiGLU MLP. The Mamba-2 layers are ``mamba_d_ssm``
wide (not necessarily expand x hidden_size: ``Mamba2(d_inner=...)``) and without the gated norm unless
``mamba_rms_norm`` (``gated_norm``).

Falcon-H1's muP multipliers are linear maps on the weights' inputs or outputs, so they are folded into the
weights on loading - exact, and the model is a plain subquad model afterwards:

    embedding_multiplier m      h = m embed(x)                     -> embed x m
    attention_in_multiplier     attn(a x)                          -> q_proj, k_proj, v_proj x a
    key_multiplier k            keys k_proj(x) k                   -> k_proj x k
    attention_out_multiplier    o_proj(.) o                        -> o_proj x o
    ssm_in_multiplier s         in_proj(s x)                       -> in_proj x s
    ssm_multipliers [z, x, B, C, dt]   in_proj's output, per part  -> in_proj's rows of each part x its multiplier
    ssm_out_multiplier          out_proj(.) o                      -> out_proj x o
    mlp_multipliers [g, d]      down(up(x) silu(g gate(x))) d      -> gate_proj x g, down_proj x d
    lm_head_multiplier l        logits = l head(norm(h))           -> head x l; with tied embeddings the final
                                                                      norm x l / m, which also undoes m on the head

``save_pretrained`` writes the folded weights with multipliers of 1: the same function. Training a loaded
model trains the folded weights - the same model, not Falcon-H1's muP parametrisation of it.
"""

from __future__ import annotations

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import TOP, Format, check_rope_type, config_float, json_float, require, swiglu

SCALARS = ("embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier", "attention_out_multiplier",
           "key_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")


def _flag(c: dict, key: str, default: bool) -> bool:
    v = dict.get(c, key, default)
    if not isinstance(v, bool):
        raise ValueError(f"config field {key} must be a bool, got {v!r}")
    return v


def _numbers(c: dict, key: str, n: int) -> list:
    v = dict.get(c, key, None)
    v = [1.0] * n if v is None else v
    if not isinstance(v, list) or len(v) != n or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v):
        raise ValueError(f"config field {key} must be a list of {n} numbers, got {v!r}")
    return [float(x) for x in v]


class FalconH1Format(Format):
    model_type = "falcon_h1"
    conv_bias_key = "mamba_conv_bias"
    any_mamba2 = True
    any_block = True
    top = {**TOP, "norm.weight": "model.final_layernorm.weight"}
    layers = {"mamba2": {"mixer.conv.{p}": "mamba.conv1d.{p}", "mixer.{p}": "mamba.{p}"},
              "*": {"beside.{p}": "self_attn.{p}", "norm1.weight": "input_layernorm.weight",
                    "norm2.weight": "pre_ff_layernorm.weight", **swiglu("mlp.", "feed_forward.")}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_act", "silu")
        for key in ("attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias"):
            require(c, key, False)
        H, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-5)
        d_inner = c.get("mamba_d_ssm") or c.get("mamba_expand", 2) * H
        heads = c.get("mamba_n_heads", 128)
        hd = c.get("mamba_d_head", "auto")
        hd = d_inner // heads if hd == "auto" else hd
        if heads * hd != d_inner:
            raise ValueError(f"config fields mamba_n_heads={heads} x mamba_d_head={hd} must equal the Mamba width "
                             f"mamba_d_ssm (or mamba_expand x hidden_size) = {d_inner}")
        gated = _flag(c, "mamba_rms_norm", False)
        if gated and _flag(c, "mamba_norm_before_gate", True):
            raise ValueError("config field mamba_norm_before_gate=true with mamba_rms_norm=true is not supported "
                             "(subquad's gated norm is rmsnorm(y * silu(z)): mamba_norm_before_gate=false)")
        m2 = {"d_state": c.get("mamba_d_state", 256), "head_dim": hd, "expand": c.get("mamba_expand", 2),
              "d_inner": d_inner, "conv_size": c.get("mamba_d_conv", 4), "n_groups": c.get("mamba_n_groups", 1),
              "norm_eps": eps, "gated_norm": gated}
        limit = tuple(config_float(v) for v in (c.get("time_step_limit") or (0.0, float("inf"))))
        if limit != (0.0, float("inf")):
            m2["dt_limit"] = limit
        rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 10000.0)}
        check_rope_type(rope)
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"config field rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']} "
                             "is not supported (Falcon-H1 rotates every dim)")
        soft = {"rotary_base": float(rope.get("rope_theta", 10000.0)),
                "head_dim": c.get("head_dim") or H // c["num_attention_heads"]}
        cfg = ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=c["num_hidden_layers"],
                          n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads"), pattern="mamba2",
                          parallel={"mamba2": "softmax"}, mlp=True, mlp_size=c["intermediate_size"], norm_eps=eps,
                          tie_embeddings=c.get("tie_word_embeddings", False), context_length=1 << 20,
                          mixer_options={"mamba2": m2, "softmax": soft})
        # the multipliers, folded into the weights by unpack (module doc); one ModelConfig per load carries them
        mult = {k: float(c.get(k, 1.0)) for k in SCALARS}
        if cfg.tie_embeddings and mult["embedding_multiplier"] == 0:
            raise ValueError("config field embedding_multiplier=0 with tied embeddings cannot be folded")
        mult["ssm"], mult["mlp"] = _numbers(c, "ssm_multipliers", 5), _numbers(c, "mlp_multipliers", 2)
        cfg.falcon_multipliers = mult
        return cfg

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """The multipliers folded into the weights (module doc)."""
        mult = getattr(cfg, "falcon_multipliers", None)
        if mult is None:
            raise ValueError("falcon_h1: unpack needs the config's multipliers (FalconH1Format.config)")
        o = cfg.mixer_options["mamba2"]
        I, GN = o["d_inner"], o["n_groups"] * o["d_state"]
        rows = [(I, mult["ssm"][0]), (I, mult["ssm"][1]), (GN, mult["ssm"][2]), (GN, mult["ssm"][3]),
                (o["d_inner"] // o["head_dim"], mult["ssm"][4])]          # in_proj's z, x, B, C, dt
        a_in, m, lm = mult["attention_in_multiplier"], mult["embedding_multiplier"], mult["lm_head_multiplier"]
        scale = {"model.embed_tokens.weight": m, "lm_head.weight": lm}
        if cfg.tie_embeddings:
            scale["model.final_layernorm.weight"] = lm / m
        by_suffix = {"self_attn.q_proj.weight": a_in, "self_attn.k_proj.weight": a_in * mult["key_multiplier"],
                     "self_attn.v_proj.weight": a_in, "self_attn.o_proj.weight": mult["attention_out_multiplier"],
                     "mamba.out_proj.weight": mult["ssm_out_multiplier"], "feed_forward.gate_proj.weight": mult["mlp"][0],
                     "feed_forward.down_proj.weight": mult["mlp"][1]}
        in_proj = torch.cat([torch.full((n,), x, dtype=torch.float64) for n, x in rows]) * mult["ssm_in_multiplier"]
        out = {}
        for name, t in tensors.items():
            if name.endswith("mamba.in_proj.weight"):                # (rows, 1): each row its part's; a wrong
                f = in_proj.unsqueeze(1) if len(t) == len(in_proj) else 1.0   # shape is named by the loader
            else:
                f = scale[name] if name in scale else next((v for k, v in by_suffix.items() if name.endswith(k)), 1.0)
            out[name] = t if bool((torch.as_tensor(f) == 1).all()) else (t.double() * f).to(dtype or t.dtype)
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o, a = opts["mamba2"], opts["softmax"]
        return {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
                "head_dim": a["head_dim"], "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
                "mamba_d_ssm": o["d_inner"], "mamba_n_heads": o["d_inner"] // o["head_dim"],
                "mamba_d_head": o["head_dim"], "mamba_n_groups": o["n_groups"], "mamba_d_state": o["d_state"],
                "mamba_d_conv": o["conv_size"], "mamba_expand": o["expand"], "mamba_conv_bias": True,
                "mamba_proj_bias": False, "mamba_rms_norm": o["gated_norm"], "mamba_norm_before_gate": False,
                "time_step_limit": [json_float(v) for v in o["dt_limit"]], "projectors_bias": False,
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
                "rope_parameters": {"rope_type": "default", "rope_theta": a["rotary_base"]},
                **{k: 1.0 for k in SCALARS}, "ssm_multipliers": [1.0] * 5, "mlp_multipliers": [1.0, 1.0]}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        o, a = opts.get("mamba2"), opts.get("softmax")
        return (set(cfg.layers) == {"mamba2"} and cfg.parallel == {"mamba2": "softmax"} and a is not None
                and a["rotary"] and a["rotary_fraction"] == 1.0 and a["qk_norm"] is None and not a["output_gate"]
                and a["window"] is None and (not o["gated_norm"] or o["norm_eps"] == cfg.norm_eps)
                and cfg.mlp and cfg.moe is None and cfg.pos_emb == "none")
