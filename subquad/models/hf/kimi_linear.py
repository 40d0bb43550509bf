"""``kimi_linear`` (KimiLinearForCausalLM).

Pre-norm blocks of Kimi Delta Attention (``layers/kda.py``) and, at the ``full_attention`` layers,
multi-head latent attention without positions (``layers/mla.py``); a SwiGLU MLP in the first
``first_k_dense_replace`` layers ("dense" in ``mlp_layer_types``) and a DeepSeek-V3 mixture of experts
elsewhere: sigmoid router with the score-correction bias, grouped top-k, ``routed_scaling_factor``, an
ungated shared expert of ``num_shared_experts x moe_intermediate_size``.

The checkpoint writes the KDA convolutions per part (``q_conv1d``, ...), ``A_log`` as (1, 1, H, 1), the
experts as w1 (gate), w3 (up), w2 (down) and its MLPs under ``block_sparse_moe`` (or ``mlp``): ``unpack``
and ``pack`` translate. Config fields may sit in ``linear_attn_config`` (the released checkpoints) or at
the top level (transformers' own config); both are read, and transformers' aliases of the MoE fields.
"""

from __future__ import annotations

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (Format, W132, check_layer_types, deepseek_moe, deepseek_moe_fields,
                                     deepseek_moe_holds, experts, first_set, join_convs, require, split_conv, swiglu,
                                     transformer_config)

_LATENT_EPS = 1e-6                                   # KimiLinearRMSNorm's default, used by the latent norms


class KimiLinearFormat(Format):
    model_type = "kimi_linear"
    conv_bias_key = "linear_conv_bias"
    layers = {"kda": {"mixer.norm.weight": "self_attn.o_norm.weight",
                      "mixer.conv.weight": "self_attn.conv1d.weight",                # q, k, v convs (unpack)
                      "mixer.{p}": "self_attn.{p}"},
              "mla": {"mixer.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                      "mixer.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
                      "mixer.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                      "mixer.{p}": "self_attn.{p}"},
              "*": {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
                    **swiglu("mlp.", "mlp."), **experts("mlp.", "mlp.", "gate.weight", W132),
                    "mlp.score_bias": "mlp.gate.e_score_correction_bias",
                    **swiglu("mlp.shared.", "mlp.shared_experts.")}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_act", "silu")
        require(c, "attention_bias", False)
        n, eps = c["num_hidden_layers"], c.get("rms_norm_eps", 1e-5)
        lin = c.get("linear_attn_config") or {}
        types = c.get("layer_types")
        if types is None and "full_attn_layers" in lin:
            full = {i - 1 for i in lin["full_attn_layers"]}                     # 1-indexed there
            types = ["full_attention" if i in full else "linear_attention" for i in range(n)]
        if types is None:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        check_layer_types(types, n)
        mlp_types = c.get("mlp_layer_types")
        if mlp_types is None:
            k = c.get("first_k_dense_replace", 1)
            mlp_types = ["dense" if i < k else "sparse" for i in range(n)]
        if len(mlp_types) != n or set(mlp_types) - {"dense", "sparse"}:
            raise ValueError(f"config field mlp_layer_types={mlp_types!r} must name 'dense' or 'sparse' per layer")
        kda = {"n_heads": first_set(lin, "num_heads", default=first_set(c, "linear_num_heads", default=32)),
               "head_dim": first_set(lin, "head_dim", default=first_set(c, "linear_head_dim", default=128)),
               "conv_size": first_set(lin, "short_conv_kernel_size",
                                      default=first_set(c, "linear_conv_kernel_dim", default=4)),
               "qk_eps": 1e-6, "norm_eps": eps}
        kda["gate_rank"] = kda["head_dim"]
        mla = {"kv_rank": c.get("kv_lora_rank", 512), "rope_dim": c.get("qk_rope_head_dim", 64),
               "nope_dim": c.get("qk_nope_head_dim", 128), "v_head_dim": c.get("v_head_dim") or 128,
               "q_rank": c.get("q_lora_rank"), "latent_eps": _LATENT_EPS, "rotary": False}
        sparse = [i for i, t in enumerate(mlp_types) if t == "sparse"]
        moe = None
        if sparse:
            moe = deepseek_moe(c, sparse, experts=256, hidden=1024, groups=1, topk_groups=1, scale=2.446)
        pattern = ",".join("mla" if t == "full_attention" else "kda" for t in types)
        return transformer_config(c, pattern, eps, moe=moe, mixer_options={"kda": kda, "mla": mla})

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        out = {name.replace(".block_sparse_moe.", ".mlp."): t.reshape(-1) if name.endswith("self_attn.A_log") else t
               for name, t in tensors.items()}
        return join_convs(out, "self_attn")

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        out = {}
        for name, t in tensors.items():
            name = name.replace(".mlp.", ".block_sparse_moe.")                 # as transformers writes them
            if name.endswith("self_attn.conv1d.weight"):
                out.update(split_conv(name, t, [t.shape[0] // 3] * 3))
            elif name.endswith("self_attn.A_log"):
                out[name] = t.view(1, 1, -1, 1)
            else:
                out[name] = t
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        k = opts["kda"]
        a = opts.get("mla", {"kv_rank": 512, "rope_dim": 64, "nope_dim": 128, "v_head_dim": 128, "q_rank": None})
        m = cfg.moe
        moe_layers = set(cfg.moe_layers)
        out = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.n_layers,
               "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
               "layer_types": ["full_attention" if n == "mla" else "linear_attention" for n in cfg.layers],
               "mlp_layer_types": ["sparse" if i in moe_layers else "dense" for i in range(cfg.n_layers)],
               "linear_num_heads": k["n_heads"], "linear_head_dim": k["head_dim"], "linear_conv_kernel_dim": k["conv_size"],
               "kv_lora_rank": a["kv_rank"], "q_lora_rank": a["q_rank"], "qk_rope_head_dim": a["rope_dim"],
               "qk_nope_head_dim": a["nope_dim"], "v_head_dim": a["v_head_dim"], "rms_norm_eps": cfg.norm_eps,
               "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
               "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
        if m is not None:
            out.update(deepseek_moe_fields(m, cfg))
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if not (set(cfg.layers) <= {"kda", "mla"} and "kda" in cfg.layers):
            return False
        k, a = opts["kda"], opts.get("mla")
        return (cfg.mlp and cfg.pos_emb == "none" and not cfg.post_norm and cfg.scaled_residual is None
                and k["qk_eps"] == 1e-6
                and k["norm_eps"] == cfg.norm_eps and k["gate_rank"] == k["head_dim"] and not k["full_gates"]
                and k["gate_bound"] is None
                and (a is None or (not a["rotary"] and not a["head_gate"] and a["latent_eps"] == _LATENT_EPS))
                and deepseek_moe_holds(cfg.moe, cfg))
