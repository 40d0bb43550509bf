"""``qwen4_exp_text`` (Qwen4ExpForCausalLM) and ``qwen4_exp`` (Qwen4ExpForConditionalGeneration: the language
model under ``model.language_model.``, its config in ``text_config``; the vision tower and an MTP head named in a
warning and left out).

Qwen3.5-MoE's layers (Gated DeltaNet with ``in_proj_qkv`` / ``z`` / ``b`` / ``a``, gated attention with per-head
zero-centred q/k norms and partial rotary, a softmax-routed MoE with a sigmoid-gated shared expert in every layer)
in a stream of n = ``hc_count`` copies of the hidden state (h (B, T, n d)); no block norms and no final norm.
Layer i (``models.hyper`` has the equations; ``layers.qsa`` the indexer's):

    h = h + PLE(h, tokens)                        at the layers of ``ple_layer_ids`` (one-indexed)
    x, g = HC_attn(h)    (B, T, d), (B, T, n)     rmsnorm per stream, a rank-``hc_lowrank`` sigmoid mix, 2 sigmoid(.)
    h = h + g_i * mixer(x)                        Gated DeltaNet ("linear_attention"), or attention
    x, g = HC_mlp(h);  h = h + g_i * moe(x)
    logits = lm_head(HC_final(h))                 ``hyper_connection_mixer``: the mix alone, (B, T, d)

Output gates: attention's ``q_proj`` writes per head [q_h (K), gate_h (K)] and o_h = softmax(.) V * sigmoid(gate_h)
(B, T, H, K) before ``o_proj``; the Gated DeltaNet's output is rmsnorm(o) w * act(z), z = ``in_proj_z`` x, act
``output_gate_type`` ("silu", the default: ``hidden_act``; or "sigmoid", what llama.cpp's qwen4exp computes).

The attention layers ("indexed_attention"; "full_attention" in released configs) are QSA (``layers.qsa``): with
the ``indexer_*`` fields each query attends to the tail of its incomplete block plus the ``indexer_budget /
indexer_compress_ratio`` blocks of ``indexer_compress_ratio`` tokens whose pooled, normed, rotated key scores
highest (sum over ``indexer_n_heads`` of relu(q . k) / sqrt(D)); without them subquad loads plain gated attention
(transformers cannot build that model; nothing to compare with). Ties among block scores (relu's zeros) go to the
earlier block - transformers leaves them to ``torch.topk``; the math, token by token in float64, is the reference.

PLE: hashed n-gram embeddings (orders 2 .. ``ngram_size``, ``heads_per_ngram`` prime-sized tables each from
``ngram_vocab_size_base``, odd multipliers from ``seed``) gate a value into every stream against the normed stream,
plus a depthwise conv (``ple_conv_kernel_size``, dilation ``ngram_size``); an eos token ends an n-gram's context.
The checkpoint splits each table into ``split_ngram_parts`` shards (``ngram_embedding.shard_{j}.weight``, along
rows): ``unpack`` concatenates them, ``pack`` splits again (``torch.chunk``, as transformers' reverse op).

Zero-centred norms (x (1 + w)): the q/k norms, the indexer's, every ``hc_norm``, PLE's three; ``unpack`` adds 1.
Refused by name: ``hidden_act`` other than silu, ``output_gate_type`` other than silu / sigmoid, ``attention_bias``,
``attn_output_gate``
False, ``hc_count`` < 2,
partial ``indexer_*`` fields or ``indexer_kv_heads`` != 1, a budget not a multiple of the ratio, layer types
other than these, PLE without ``eos_token_id``.
"""

from __future__ import annotations

import re

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (experts, gdn_config, gdn_matches, gdn_options, gdn_rope, require, swiglu,
                                      transformer_config)
from subquad.models.hf.qwen3_5 import Qwen3_5MoeTextFormat, _Multimodal

HC = {"norm": "hc_norm", "down": "input_mix_weight_down", "up": "input_mix_weight_up", "inject": "block_inject_weight"}
QSA_FIELDS = {"indexer_n_heads": "index_heads", "indexer_head_dim": "index_head_dim", "indexer_budget": "index_budget",
              "indexer_compress_ratio": "index_block"}
PLE_FIELDS = {"ngram_size": "ngram", "heads_per_ngram": "heads_per_ngram", "ple_conv_kernel_size": "conv_size",
              "ngram_vocab_size_base": "vocab_base", "make_ngram_vocab_size_divisible_by": "vocab_multiple",
              "seed": "seed", "split_ngram_parts": "parts"}
PLE_DEFAULTS = {"ngram_size": 3, "heads_per_ngram": 8, "ple_conv_kernel_size": 4, "ngram_vocab_size_base": 20_000_000,
                "make_ngram_vocab_size_divisible_by": 128, "seed": 1234, "split_ngram_parts": 512}
SHARD = re.compile(r"(.*ngram_embedding)\.shard_(\d+)\.weight\Z")


def hc(ours: str, theirs: str) -> dict:
    return {f"{ours}{a}.weight": f"{theirs}{b}.weight" for a, b in HC.items()}


class Qwen4ExpTextFormat(Qwen3_5MoeTextFormat):
    """Qwen3.5-MoE's format (its prefix, text_config, q/k/v and expert unpacking, zero-centred norms) with the
    hyper-connection, PLE and QSA names and fields."""
    model_type = "qwen4_exp_text"
    architecture = "Qwen4ExpForCausalLM"
    hyper_connections = True
    sigmoid_gdn_gate = True
    attention = {"mixer.index_qk_proj.weight": "self_attn.indexer.index_qk_proj.weight",
                 "mixer.index_q_norm.weight": "self_attn.indexer.q_layernorm.weight",
                 "mixer.index_k_norm.weight": "self_attn.indexer.k_layernorm.weight", "mixer.{p}": "self_attn.{p}"}
    layers = {"qsa": attention, "softmax": attention,
              "gated_deltanet": {"mixer.conv.weight": "linear_attn.conv1d.weight",
                                 "mixer.o_proj.weight": "linear_attn.out_proj.weight",
                                 "mixer.g_proj.weight": "linear_attn.in_proj_z.weight",
                                 "mixer.b_proj.weight": "linear_attn.in_proj_b.weight",
                                 "mixer.a_proj.weight": "linear_attn.in_proj_a.weight",
                                 "mixer.{p}": "linear_attn.{p}"},   # q, k, v: in_proj_qkv (unpack)
              "*": {**hc("norm1.", "attn_hyper_connection."), **hc("norm2.", "mlp_hyper_connection."),
                    "ple.table.weight": "ple.ple_embedding.ngram_embedding.weight",
                    "ple.multipliers": "ple.ple_embedding.layer_multipliers",
                    "ple.head_sizes": "ple.ple_embedding.ngram_heads_vocab_sizes",
                    "ple.head_offsets": "ple.ple_embedding.ngram_heads_offsets", "ple.{p}": "ple.{p}",
                    **experts("mlp.", "mlp.", "gate.weight"), **swiglu("mlp.shared.", "mlp.shared_expert."),
                    "mlp.shared_gate.weight": "mlp.shared_expert_gate.weight"}}
    _ZERO_CENTRED = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "indexer.q_layernorm.weight",
                     "indexer.k_layernorm.weight", "hc_norm.weight", "ple.norm_key.weight", "ple.norm_query.weight",
                     "ple.norm_conv.weight")

    @classmethod
    def _set_prefix(cls):
        cls.top = {"embed.weight": cls.prefix + "embed_tokens.weight", "head.weight": "lm_head.weight",
                   **hc("norm.", cls.prefix + "hyper_connection_mixer.")}
        cls.layer = cls.prefix + "layers.{i}."

    @classmethod
    def config(cls, c: dict) -> ModelConfig:
        t = cls.text_config(c)
        require(t, "hidden_act", "silu")
        require(t, "attention_bias", False)
        require(t, "attn_output_gate", True)          # Qwen3.5's configs write it; transformers' attention is gated
        gate = t.get("output_gate_type") or "silu"
        if gate not in ("silu", "sigmoid"):
            raise ValueError(f"config field output_gate_type={t['output_gate_type']!r} is not supported (the Gated "
                             "DeltaNet's output gate is silu or sigmoid)")
        n, eps, d = t["num_hidden_layers"], t.get("rms_norm_eps", 1e-6), t["hidden_size"]
        streams = t.get("hc_count", 4)
        if streams < 2:
            raise ValueError(f"config field hc_count={streams} must be > 1 (Qwen4-Exp's hyper-connections)")
        types = t.get("layer_types")
        if types is None:
            every = t.get("full_attention_interval", 4)
            types = ["indexed_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        if len(types) != n or set(types) - {"linear_attention", "indexed_attention", "full_attention"}:
            raise ValueError(f"config field layer_types={types!r} must name 'linear_attention' or "
                             f"'indexed_attention' for each of the {n} layers")
        qsa = {k: t.get(k) for k in (*QSA_FIELDS, "indexer_kv_heads")}
        if any(v is not None for v in qsa.values()):
            missing = [k for k, v in qsa.items() if v is None]
            if missing:
                raise ValueError(f"config fields {', '.join(missing)} are missing (the QSA indexer needs all of "
                                 f"{', '.join(qsa)})")
            if qsa["indexer_kv_heads"] != 1:
                raise ValueError(f"config field indexer_kv_heads={qsa['indexer_kv_heads']} is not supported "
                                 "(Qwen4-Exp's indexer has one key head)")
            if any(v < 1 for v in qsa.values()) or qsa["indexer_budget"] % qsa["indexer_compress_ratio"]:
                raise ValueError(f"config field indexer_budget={qsa['indexer_budget']} must be a positive multiple "
                                 f"of indexer_compress_ratio={qsa['indexer_compress_ratio']}")
        attention = "qsa" if qsa["indexer_n_heads"] is not None else "softmax"
        soft = {**gdn_rope(t, 1.0), "head_dim": t.get("head_dim") or d // t["num_attention_heads"],
                "qk_norm": "head", "qk_norm_eps": eps, "output_gate": True}
        if attention == "qsa":
            soft.update({ours: qsa[theirs] for theirs, ours in QSA_FIELDS.items()})
        if t.get("num_experts", 512) < 1:
            raise ValueError(f"config field num_experts={t['num_experts']} must be > 0 (every layer is a MoE)")
        moe = {"experts": t.get("num_experts", 512), "top_k": t.get("num_experts_per_tok", 10),
               "renormalize": t.get("norm_topk_prob", True), "aux_loss_coef": t.get("router_aux_loss_coef", 0.001),
               "hidden": t.get("moe_intermediate_size", 512), "shared": t.get("shared_expert_intermediate_size", 512)}
        pattern = ",".join("gated_deltanet" if x == "linear_attention" else attention for x in types)
        hyper = {"streams": streams, "rank": t.get("hc_lowrank", 320), "ple": cls._ple(t, n)}
        options = {"gated_deltanet": {**gdn_options(t, eps, False), "output_gate": gate}, attention: soft}
        options = {k: v for k, v in options.items() if k in pattern.split(",")}
        return transformer_config({**t, "intermediate_size": moe["hidden"],
                                   "tie_word_embeddings": c.get("tie_word_embeddings", False)},
                                  pattern, eps, moe=moe, mixer_options=options, hyper=hyper)

    @staticmethod
    def _ple(t: dict, n: int) -> dict | None:
        ids = t.get("ple_layer_ids") or []
        if not ids:
            return None
        if any(not 1 <= i <= n for i in ids):
            raise ValueError(f"config field ple_layer_ids={ids!r} must hold one-indexed layer ids in [1, {n}]")
        eos = t.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if not isinstance(eos, int) or isinstance(eos, bool):
            raise ValueError(f"config field eos_token_id={t.get('eos_token_id')!r} must be set when ple_layer_ids is "
                             "(PLE's n-grams stop at eos)")
        p = {ours: t.get(theirs, PLE_DEFAULTS[theirs]) for theirs, ours in PLE_FIELDS.items()}
        heads = (p["ngram"] - 1) * p["heads_per_ngram"]
        dim = t.get("ple_embed_dim") or t["hidden_size"]
        if heads < 1 or dim % heads:
            raise ValueError(f"config field ple_embed_dim={dim} must divide by (ngram_size - 1) x heads_per_ngram "
                             f"= {heads}")
        return {**p, "layers": [i - 1 for i in ids], "dim": dim, "eos": eos}

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """PLE tables' shards -> one table; then Qwen3.5's (q, k, v, experts, zero-centred norms + 1)."""
        shards, rest = {}, {}
        for name, t in tensors.items():
            m = SHARD.match(name)
            if m:
                shards.setdefault(m.group(1), {})[int(m.group(2))] = t
            else:
                rest[name] = t
        out = super().unpack(rest, cfg, dtype)
        for p, parts in shards.items():
            if sorted(parts) != list(range(len(parts))):
                raise ValueError(f"{p}.shard_*.weight: the shards must be numbered 0 .. {len(parts) - 1}, "
                                 f"got {sorted(parts)}")
            out[p + ".weight"] = torch.cat([parts[j] for j in range(len(parts))], 0)
        return out

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        parts = (cfg.hyper["ple"] or {}).get("parts", 1)
        out = {}
        for name, t in super().pack(tensors, cfg).items():
            if name.endswith("ngram_embedding.weight"):
                p = name.removesuffix(".weight")
                out.update({f"{p}.shard_{j}.weight": x.contiguous() for j, x in enumerate(t.chunk(parts, 0))})
            else:
                out[name] = t
        return out

    @classmethod
    def to_config(cls, cfg: ModelConfig, opts: dict) -> dict:
        a, hy, m = opts["qsa"], cfg.hyper, cfg.moe
        out = {"model_type": "qwen4_exp_text", "architectures": [cls.architecture], "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
               "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "head_dim": a["head_dim"],
               "layer_types": ["indexed_attention" if x == "qsa" else "linear_attention" for x in cfg.layers],
               "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_bias": False,
               "tie_word_embeddings": cfg.tie_embeddings,
               "rope_parameters": {"rope_type": "default", "rope_theta": a["rotary_base"],
                                   "partial_rotary_factor": a["rotary_fraction"]},
               **gdn_config(opts["gated_deltanet"]), "output_gate_type": opts["gated_deltanet"]["output_gate"],
               "num_experts": m["experts"], "num_experts_per_tok": m["top_k"],
               "moe_intermediate_size": m["hidden"] or cfg.mlp_hidden, "norm_topk_prob": m["renormalize"],
               "shared_expert_intermediate_size": m["shared"], "router_aux_loss_coef": m["aux_loss_coef"],
               "hc_count": hy["streams"], "hc_lowrank": hy["rank"], "indexer_kv_heads": 1,
               **{theirs: a[ours] for theirs, ours in QSA_FIELDS.items()}}
        p = hy["ple"]
        if p is not None:
            out.update({theirs: p[ours] for theirs, ours in PLE_FIELDS.items()})
            out.update({"ple_layer_ids": [i + 1 for i in p["layers"]], "ple_embed_dim": p["dim"],
                        "eos_token_id": p["eos"]})
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        """A model with hyper-connections, Gated DeltaNet and QSA layers (both), MoE with a gated shared expert
        everywhere; plain gated attention is read but not written (transformers builds no such model)."""
        if cfg.hyper is None or set(cfg.layers) != {"gated_deltanet", "qsa"}:
            return False
        a, m = opts["qsa"], cfg.moe
        p = cfg.hyper["ple"]
        return (a["output_gate"] and a["qk_norm"] == "head" and a["qk_norm_eps"] == cfg.norm_eps and a["rotary"]
                and a["scale"] is None and m is not None and m["router"] == "softmax" and m["layers"] is None
                and m["every"] == 1 and m["scale"] == 1.0 and m["shared"] > 0 and m["shared_gate"] and cfg.mlp
                and (p is None or not cfg.eos_token_ids or cfg.eos_token_ids[0] == p["eos"])
                and gdn_matches(opts["gated_deltanet"], cfg.norm_eps, False))


class Qwen4ExpFormat(_Multimodal, Qwen4ExpTextFormat):
    model_type = "qwen4_exp"
