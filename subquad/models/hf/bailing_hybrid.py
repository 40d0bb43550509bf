"""``bailing_hybrid`` (BailingHybridForCausalLM, inclusionAI's Ling 3): Kimi Linear's layout with Ling's parts.

Pre-norm blocks of Kimi Delta Attention (``layers/kda.py``) and, at every ``layer_group_size``-th layer
("full_attention" in ``layer_types``), multi-head latent attention (``layers/mla.py``) with DeepSeek's rotary on
its R = ``qk_rope_head_dim`` dims and one sigmoid gate per head (``head_gate``); a SwiGLU MLP in the first
``first_k_dense_replace`` layers and a DeepSeek-V3 mixture of experts elsewhere (sigmoid router with the
score-correction bias, grouped top-k over ``n_group`` groups, ``routed_scaling_factor``, an ungated shared
expert of ``n_shared_experts x moe_intermediate_size``). Ling's KDA has full-rank gates (``f_proj``, ``g_proj``:
``full_gates``) and with ``kda_safe_gate`` the bounded forget gate g = kda_lower_bound * sigmoid(exp(A_log) *
(x W_f + dt_bias)) (``gate_bound``); its heads are ``linear_num_heads`` of ``linear_head_dim`` where the config
holds them (transformers' own saves: it copies the KDA head size there and writes ``head_dim`` as the rotary size),
else ``num_attention_heads`` of ``head_dim`` (the released configs).

The checkpoint's names are the released ones, as transformers writes them: ``word_embeddings``, ``attention``,
``dense`` for the output projections, the KDA convolutions per part (``q_conv1d``, ...), the router's
``expert_bias``. DeepSeek's rotary pairs interleaved dims (2i, 2i + 1) of the R rotating ones; subquad's pairs
(i, i + R/2): ``unpack`` reorders those rows of q_proj (q_b_proj) and kv_a_proj_with_mqa evens-then-odds (the
scores are sums over all dims, so the order inside is free), ``pack`` restores it.
transformers' Ling ties no weights (its ``_tied_weights_keys`` is empty), so ``lm_head.weight`` is always read, with
``tie_word_embeddings`` true too.

Multi-token prediction (``num_nextn_predict_layers`` / ``num_mtp_layers`` 1; transformers skips those layers on
load) loads as ``model.mtp`` (``models.mtp``, the drafter of ``generate(speculative="mtp")``): the layer after the
decoder layers, "model.layers.{num_hidden_layers}.", is one decoder layer - always MLA (whatever ``layer_types``
would say of its index) and always the MoE, its tensors named as any such layer's (``input_layernorm``,
``attention.*``, ``post_attention_layernorm``, ``mlp.*``) - beside the head's own ``enorm`` (the embedding's norm),
``hnorm`` (the model's final-normed hidden state's), ``eh_proj`` (the fc over [enorm(embed); hnorm(h)]) and
``final_layernorm``; the embedding and ``lm_head`` are the model's. That is SGLang's reading of Ling's checkpoints
(``models/bailing_moe_nextn.py``: ``BailingMoEModelNextN`` building ``bailing_moe_v3``'s decoder layer with
``attention_type`` 1 and ``is_nextn``, which makes its MLP the MoE; ``resolve_nextn_layer_id`` /
``rewrite_nextn_weight_name``: the layer index ``num_hidden_layers``, enorm / hnorm / eh_proj / final_layernorm the
head's own). More MTP layers (``model.layers.{num_hidden_layers + 1}`` on) are left out with a warning. A saved
folder writes the head back under those names and says ``num_nextn_predict_layers`` 1; without one, 0.
"""

from __future__ import annotations

import re
import warnings

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (Format, check_layer_types, check_rope_type, deepseek_moe, deepseek_moe_fields,
                                     deepseek_moe_holds, experts, first_set, join_convs, require, split_conv, swiglu,
                                     transformer_config)

ATTENTION = {"mixer.o_proj.weight": "attention.dense.weight"}
ID_DEFAULTS = {"pad_token_id": 156_892, "eos_token_id": 156_895}       # BailingHybridConfig's
LATENT_EPS = 1e-6                       # DeepseekV3RMSNorm's default on the latents (q_a_layernorm, kv_a_layernorm)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _order(R: int) -> torch.Tensor:
    """DeepSeek's interleaved rotary dims in subquad's order: evens, then odds (module doc)."""
    return torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])


class BailingHybridFormat(Format):
    model_type = "bailing_hybrid"
    gates_and_sandwich = True           # matches() takes MLA's head gate and refuses sandwich norms itself
    mtp_mixer = "mla"                   # the MTP layer's attention (module doc), named as the layer's own norms
    mtp_own = {"mtp.fc.weight": "mtp.layers.0.eh_proj.weight", "mtp.norm_embed.weight": "mtp.layers.0.enorm.weight",
               "mtp.norm_hidden.weight": "mtp.layers.0.hnorm.weight",
               "mtp.norm.weight": "mtp.layers.0.final_layernorm.weight"}
    top = {"embed.weight": "model.word_embeddings.weight", "norm.weight": "model.norm.weight",
           "head.weight": "lm_head.weight"}
    layers = {"kda": {**ATTENTION, "mixer.norm.weight": "attention.o_norm.weight",
                      "mixer.conv.weight": "attention.conv1d.weight",                # q, k, v convs (unpack)
                      "mixer.{p}": "attention.{p}"},
              "mla": {**ATTENTION, "mixer.q_a_norm.weight": "attention.q_a_layernorm.weight",
                      "mixer.kv_a_proj.weight": "attention.kv_a_proj_with_mqa.weight",
                      "mixer.kv_a_norm.weight": "attention.kv_a_layernorm.weight",
                      "mixer.{p}": "attention.{p}"},
              "*": {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
                    **swiglu("mlp.", "mlp."), **experts("mlp.", "mlp.", "gate.weight"),
                    "mlp.score_bias": "mlp.gate.expert_bias", **swiglu("mlp.shared.", "mlp.shared_experts.")}}

    @staticmethod
    def mtp_prefix(cfg: ModelConfig) -> tuple[str, str]:
        return f"model.layers.{cfg.n_layers}.", "mtp.layers.0."

    @staticmethod
    def mtp_fields(head) -> dict:
        return {"num_nextn_predict_layers": 1}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_act", "silu")
        require(c, "attention_bias", False)
        n, eps = c["num_hidden_layers"], c.get("rms_norm_eps", 1e-6)
        types = c.get("layer_types")
        if types is None:
            group = c.get("layer_group_size", 6)
            if group < 1:
                raise ValueError(f"config field layer_group_size={group} must be at least 1")
            types = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)]
        check_layer_types(types, n)
        mlp_types = c.get("mlp_layer_types")
        if mlp_types is None:
            k = c.get("first_k_dense_replace", 2)
            mlp_types = ["dense" if i < k else "sparse" for i in range(n)]
        if not isinstance(mlp_types, list) or len(mlp_types) != n or set(mlp_types) - {"dense", "sparse"}:
            raise ValueError(f"config field mlp_layer_types={mlp_types!r} must name 'dense' or 'sparse' per layer")
        rope = c.get("rope_parameters") or {"rope_type": "default", "rope_theta": c.get("rope_theta", 6e6)}
        check_rope_type(rope)
        heads = first_set(c, "linear_num_heads", "num_attention_heads", default=32)      # KDA's (module doc)
        safe = c.get("kda_safe_gate", True)
        bound = float(c.get("kda_lower_bound", -5.0))
        if safe and not bound < 0:
            raise ValueError(f"config field kda_lower_bound={bound} must be negative (a log-decay bound)")
        kda = {"n_heads": heads, "head_dim": first_set(c, "linear_head_dim", "head_dim", default=128),
               "conv_size": c.get("short_conv_kernel_size", 4),
               "full_gates": True, "gate_bound": bound if safe else None, "qk_eps": 1e-6, "norm_eps": eps}
        mla = {"kv_rank": c.get("kv_lora_rank", 512), "rope_dim": c.get("qk_rope_head_dim", 64),
               "nope_dim": c.get("qk_nope_head_dim", 128), "v_head_dim": c.get("v_head_dim", 128),
               "q_rank": c.get("q_lora_rank"), "latent_eps": LATENT_EPS, "rotary": True,
               "rotary_base": float(rope.get("rope_theta", 6e6)), "head_gate": True}
        sparse = [i for i, t in enumerate(mlp_types) if t == "sparse"]
        moe = None
        if sparse:
            moe = deepseek_moe(c, sparse, experts=512, hidden=768, groups=8, topk_groups=4, scale=2.5)
            if moe["groups"] < 1 or moe["experts"] % moe["groups"]:
                raise ValueError(f"config field n_group={moe['groups']} must divide num_local_experts={moe['experts']}")
        pattern = ",".join("mla" if t == "full_attention" else "kda" for t in types)
        cfg = transformer_config(c, pattern, eps, moe=moe, mixer_options={"kda": kda, "mla": mla})
        cfg.tie_embeddings = False          # transformers' Ling ties nothing, whatever tie_word_embeddings says
        cfg.bailing_mtp = first_set(c, "num_nextn_predict_layers", "num_mtp_layers", default=1)
        return cfg

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """The MTP layers not read as the head left out (a warning); the convolutions joined; MLA's rotary rows
        reordered."""
        out, mtp = {}, set()
        for name, t in tensors.items():
            m = _LAYER.match(name)
            if m and int(m[1]) >= cfg.n_layers:
                mtp.add((int(m[1]), name))
                continue
            out[name] = t
        if mtp:
            first = min(i for i, _ in mtp)
            warnings.warn(f"bailing_hybrid: not loaded (the model's head is one MTP layer): the multi-token-"
                          f"prediction layers model.layers.{first}* on ({len(mtp)} tensors)", stacklevel=3)
        out = join_convs(out, "attention")
        return cls._rotary_rows(out, cfg, back=False)

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        out = {}
        for name, t in cls._rotary_rows(tensors, cfg, back=True).items():
            if name.endswith("attention.conv1d.weight"):
                out.update(split_conv(name, t, [t.shape[0] // 3] * 3))
            else:
                out[name] = t
        return out

    @staticmethod
    def _rotary_rows(tensors: dict, cfg: ModelConfig, back: bool) -> dict:
        """MLA's rotating rows evens-then-odds (``back``: the checkpoint's interleaved order again)."""
        a = cfg.mixer_options.get("mla")
        if a is None or not a.get("rotary", True):
            return tensors
        R, N, H = a["rope_dim"], a["nope_dim"], cfg.n_heads
        order = _order(R)
        order = torch.argsort(order) if back else order
        out = dict(tensors)
        for i in (i for i, name in enumerate(cfg.layers) if name == "mla"):
            p = f"model.layers.{i}.attention."
            for q in ("q_proj.weight", "q_b_proj.weight"):
                if p + q in out:
                    w = out[p + q].unflatten(0, (H, N + R))
                    out[p + q] = torch.cat([w[:, :N], w[:, N:][:, order]], 1).flatten(0, 1)
            kv = out.get(p + "kv_a_proj_with_mqa.weight")
            if kv is not None:
                C = kv.shape[0] - R
                out[p + "kv_a_proj_with_mqa.weight"] = torch.cat([kv[:C], kv[C:][order]], 0)
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        k = opts["kda"]
        a = opts.get("mla", {"kv_rank": 512, "rope_dim": 64, "nope_dim": 128, "v_head_dim": 128, "q_rank": None,
                             "rotary_base": 6e6})
        m = cfg.moe
        moe_layers = set(cfg.moe_layers)
        ids = {key: None for key, d in ID_DEFAULTS.items() if d >= cfg.vocab_size}
        out = {**ids, "model_type": "bailing_hybrid", "architectures": ["BailingHybridForCausalLM"],
               "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden,
               "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
               "num_key_value_heads": cfg.n_heads, "head_dim": k["head_dim"],
               "layer_types": ["full_attention" if n == "mla" else "linear_attention" for n in cfg.layers],
               "mlp_layer_types": ["sparse" if i in moe_layers else "dense" for i in range(cfg.n_layers)],
               "short_conv_kernel_size": k["conv_size"], "kda_safe_gate": k["gate_bound"] is not None,
               "kda_lower_bound": -5.0 if k["gate_bound"] is None else k["gate_bound"],
               "kv_lora_rank": a["kv_rank"], "q_lora_rank": a["q_rank"], "qk_rope_head_dim": a["rope_dim"],
               "qk_nope_head_dim": a["nope_dim"], "v_head_dim": a["v_head_dim"], "rms_norm_eps": cfg.norm_eps,
               "rope_parameters": {"rope_type": "default", "rope_theta": a["rotary_base"]},
               "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": cfg.tie_embeddings,
               "num_nextn_predict_layers": 0}
        if m is not None:
            out.update(deepseek_moe_fields(m, cfg))
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if not (set(cfg.layers) <= {"kda", "mla"} and "kda" in cfg.layers):
            return False
        k, a = opts["kda"], opts.get("mla")
        return (cfg.mlp and cfg.pos_emb == "none" and not cfg.post_norm and cfg.scaled_residual is None
                and not cfg.sandwich_norm and not cfg.tie_embeddings and k["full_gates"] and k["qk_eps"] == 1e-6
                and k["norm_eps"] == cfg.norm_eps
                and k["n_heads"] == cfg.n_heads
                and (a is None or (a["rotary"] and a["head_gate"] and a["latent_eps"] == LATENT_EPS))
                and deepseek_moe_holds(cfg.moe, cfg))

