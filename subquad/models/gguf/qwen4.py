"""llama.cpp's ``qwen4exp`` (Qwen3.8-Flash-Next) against the Hugging Face ``qwen4_exp_text`` checkpoint ``models.hf``
reads (``hf/qwen4_exp.py``), as llama.cpp's converter writes it (``conversion/qwen4exp.py``: Qwen4ExpTextModel, on
Qwen3.5's _LinearAttentionVReorderBase and _Qwen35MRopeMixin; gguf-py's ``tensor_mapping.py``; the loader
``src/models/qwen4exp.cpp``). ``qwen.py``'s ``qwen35moe`` (the Gated DeltaNet's tiled value heads, the zero-centred
norms written as 1 + w, the stacked experts, M-RoPE sections) with what Qwen4-Exp adds:

    hyper-connections  no layer norms and no final norm: ``hc_attn_*`` / ``hc_ffn_*`` per layer (``hc_norm`` ->
                       ``*_norm``, ``input_mix_weight_down`` / ``_up`` -> ``*_down`` / ``*_up``,
                       ``block_inject_weight`` -> ``*_inject``), the final mixer ``output_hc_{norm,down,up}``;
                       ``hyper_connection.count`` / ``.low_rank``
    QSA indexer        ``index_qk_proj`` split by rows into ``indexer.q_proj`` (heads x D) and ``indexer.k_proj``
                       (D); its q/k layernorms (zero-centred) as ``indexer.q_norm`` / ``k_norm``;
                       ``attention.indexer.head_count`` / ``key_length`` / ``top_k`` (the token budget) and
                       ``attention.compress_ratios`` (the block size at each attention layer, 0 elsewhere - 0 at an
                       attention layer: llama.cpp attends densely there)
    PLE                the n-gram table's shards concatenated by rows as the top-level ``per_layer_token_embd``
                       (rows x P / heads); ``ple.key_proj`` / ``value_proj`` / ``norm_{key,query,conv}`` (norms
                       zero-centred) / ``conv1d`` (squeezed to (n d, k)) as ``ple_*``; the int64 hash constants
                       (multipliers, the heads' table sizes and offsets) as uint64 metadata ``ple.*``, with
                       ``ple.layers`` (zero-indexed), ``ngram_size``, ``heads_per_ngram``, ``conv_kernel``,
                       ``eos_token_id``, ``embedding_length_per_layer_input`` (P / heads)

Not in the file: the MTP head (the converter drops ``mtp.*``: ``no_mtp``), the table-size rule's ``seed`` and
``ngram_vocab_size_base`` (the sizes and multipliers themselves are stored). A file loads as ``qwen4_exp_text``
with the Gated DeltaNet's sigmoid output gate (``output_gate_type`` "sigmoid": llama.cpp's ``build_norm_gated``
always gates with sigmoid).

What llama.cpp's loader cannot hold is refused by name on writing: a silu output gate (``output_gate_type``), more
than one PLE layer, a PLE layer whose ``ple_embed_dim`` is not ``hidden_size``, value heads of another width than
the keys' (``linear_value_head_dim``: llama.cpp takes both from ``ssm.state_size``), ``norm_topk_prob``
false. Reading, a file whose attention layers mix compress ratios (QSA at some, dense at others) is refused:
subquad's model has one kind of attention layer.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from subquad.models.gguf.arch import U64
from subquad.models.gguf.qwen import ATTENTION, DELTANET, MOE, TOP, Qwen35MoeArch, _get

HC = {"norm.weight": "hc_norm.weight", "down.weight": "input_mix_weight_down.weight",
      "up.weight": "input_mix_weight_up.weight", "inject.weight": "block_inject_weight.weight"}
PLE = {"ple_key.weight": "ple.key_proj.weight", "ple_value.weight": "ple.value_proj.weight",
       "ple_norm_key.weight": "ple.norm_key.weight", "ple_norm_query.weight": "ple.norm_query.weight",
       "ple_norm_conv.weight": "ple.norm_conv.weight", "ple_conv1d.weight": "ple.conv1d.weight"}
# the indexer's two halves of index_qk_proj (``regroup`` joins them, ``split`` parts them)
INDEXER = {"indexer.q_proj.weight": "self_attn.indexer.index_q_proj.weight",
           "indexer.k_proj.weight": "self_attn.indexer.index_k_proj.weight",
           "indexer.q_norm.weight": "self_attn.indexer.q_layernorm.weight",
           "indexer.k_norm.weight": "self_attn.indexer.k_layernorm.weight"}
TABLE = "per_layer_token_embd"               # the PLE table's stand-in name until ``regroup`` knows its layer
CONSTANTS = {"layer_multipliers": "ple.layer_multipliers", "ngram_heads_offsets": "ple.head_offsets",
             "ngram_heads_vocab_sizes": "ple.head_vocab_sizes"}     # checkpoint buffer -> metadata key
ZERO_CENTRED_PLE = ("ple.norm_key.weight", "ple.norm_query.weight", "ple.norm_conv.weight")


class Qwen4ExpArch(Qwen35MoeArch):
    """``qwen4exp`` (module doc)."""
    arch = "qwen4exp"
    model_type = "qwen4_exp_text"
    prefix = "model."
    hf_layer = "model.layers.{i}."
    top: ClassVar[dict] = {"token_embd.weight": TOP["token_embd.weight"], "output.weight": TOP["output.weight"],
                           "per_layer_token_embd.weight": TABLE,
                           **{f"output_hc_{k}": "model.hyper_connection_mixer." + v for k, v in HC.items()
                              if k != "inject.weight"}}
    layer: ClassVar[dict] = {**{k: v for k, v in ATTENTION.items()
                                if k not in ("attn_norm.weight", "post_attention_norm.weight")}, **DELTANET, **MOE,
                             **INDEXER, **PLE, "ssm_beta.weight": "linear_attn.in_proj_b.weight",
                             "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
                             **{f"hc_attn_{k}": "attn_hyper_connection." + v for k, v in HC.items()},
                             **{f"hc_ffn_{k}": "mlp_hyper_connection." + v for k, v in HC.items()}}

    # ------------------------------------------------------------------ config
    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        c = {**cls._text(meta, tensors), **cls._experts(meta), "model_type": cls.model_type,
             "norm_topk_prob": True, "output_gate_type": "sigmoid", "hc_count": _get(meta, a, "hyper_connection.count"),
             "hc_lowrank": _get(meta, a, "hyper_connection.low_rank")}
        n = c["num_hidden_layers"]
        attention = [i for i, t in enumerate(c["layer_types"]) if t == "full_attention"]
        ratios = list(meta.get(f"{a}.attention.compress_ratios") or [0] * n)
        used = {ratios[i] for i in attention} if len(ratios) >= n else None
        if used is None or len(used) > 1:
            raise ValueError(f"GGUF metadata {a}.attention.compress_ratios={ratios}: subquad's model has one kind of "
                             f"attention layer - the attention layers {attention} must share one ratio (0: dense)")
        ratio = used.pop() if used else 0
        if ratio:
            c.update({"indexer_n_heads": _get(meta, a, "attention.indexer.head_count"),
                      "indexer_head_dim": _get(meta, a, "attention.indexer.key_length"),
                      "indexer_budget": _get(meta, a, "attention.indexer.top_k"), "indexer_compress_ratio": ratio,
                      "indexer_kv_heads": 1})
        c["_qsa"] = bool(ratio)
        layers = list(meta.get(f"{a}.ple.layers") or [])
        if len(layers) > 1:
            raise ValueError(f"GGUF metadata {a}.ple.layers={layers}: llama.cpp's qwen4exp holds one PLE layer")
        if layers:
            c.update(cls._ple(meta, tensors, layers[0], n))
        return c

    @classmethod
    def _ple(cls, meta: dict, tensors: dict, layer: int, n: int) -> dict:
        """The PLE fields, and the hash constants (``_ple``, for ``regroup``) from the metadata."""
        a = cls.arch
        N, per = _get(meta, a, "ple.ngram_size"), _get(meta, a, "ple.heads_per_ngram")
        heads = (N - 1) * per
        const = {k: [int(x) for x in _get(meta, a, m)] for k, m in CONSTANTS.items()}
        if not 0 <= layer < n or N < 2 or len(const["layer_multipliers"]) < N or any(
                len(const[k]) < heads for k in ("ngram_heads_offsets", "ngram_heads_vocab_sizes")):
            raise ValueError(f"GGUF metadata {a}.ple.*: layer {layer} of {n}, ngram_size {N}, {heads} heads: "
                             f"{len(const['layer_multipliers'])} multipliers (>= ngram_size), "
                             f"{len(const['ngram_heads_offsets'])} offsets and "
                             f"{len(const['ngram_heads_vocab_sizes'])} table sizes (>= heads)")
        const = {"layer_multipliers": const["layer_multipliers"][:N],
                 **{k: const[k][:heads] for k in ("ngram_heads_offsets", "ngram_heads_vocab_sizes")}}
        rows, width = tensors[TABLE + ".weight"].shape if TABLE + ".weight" in tensors else (None, None)
        width = meta.get(f"{a}.embedding_length_per_layer_input", width)
        if rows is None or rows < max(o + s for o, s in zip(const["ngram_heads_offsets"],
                                                             const["ngram_heads_vocab_sizes"])):
            raise ValueError(f"GGUF tensor {TABLE}.weight ({rows} rows) must hold the PLE heads' ranges "
                             f"({a}.ple.head_offsets + {a}.ple.head_vocab_sizes)")
        # subquad sizes the table from the first head's size (a prime: the next are the primes after it) and
        # rounds to a multiple: the file's row count is that multiple
        return {"ple_layer_ids": [layer + 1], "ngram_size": N, "heads_per_ngram": per,
                "ple_conv_kernel_size": _get(meta, a, "ple.conv_kernel"), "ple_embed_dim": width * heads,
                "ngram_vocab_size_base": const["ngram_heads_vocab_sizes"][0],
                "make_ngram_vocab_size_divisible_by": rows, "split_ngram_parts": 1,
                "eos_token_id": _get(meta, a, "ple.eos_token_id"), "_ple": const}

    @classmethod
    def meta(cls, c: dict) -> dict:
        """What the converter writes for the Hugging Face config ``c`` (its PLE constants: ``tensor_meta``)."""
        c = cls.text(c)
        m = super().meta(c)
        n = c["num_hidden_layers"]
        m.update({"hyper_connection.count": c["hc_count"], "hyper_connection.low_rank": c["hc_lowrank"],
                  "attention.indexer.head_count": c["indexer_n_heads"],
                  "attention.indexer.key_length": c["indexer_head_dim"],
                  "attention.indexer.top_k": c["indexer_budget"],
                  # the ratio at each attention layer, as the converter writes it from the released config.json
                  # ("full_attention", the name it tests). It reads the config through transformers' AutoConfig
                  # where it can, and transformers renames those layers "indexed_attention": with a transformers
                  # that knows qwen4_exp the converter writes 0 everywhere, and llama.cpp attends densely
                  # (benchmarks/RESULTS.md); QSA's ratio is the file that computes the model
                  "attention.compress_ratios": [c["indexer_compress_ratio"] if t != "linear_attention" else 0
                                                for t in c["layer_types"][:n]]})
        ids = c.get("ple_layer_ids") or []
        if ids:
            heads = (c["ngram_size"] - 1) * c["heads_per_ngram"]
            m.update({"ple.layers": [i - 1 for i in ids], "ple.ngram_size": c["ngram_size"],
                      "ple.heads_per_ngram": c["heads_per_ngram"], "ple.conv_kernel": c["ple_conv_kernel_size"],
                      "ple.eos_token_id": c["eos_token_id"],
                      "embedding_length_per_layer_input": c["ple_embed_dim"] // heads})
        return m

    @classmethod
    def check(cls, c: dict) -> None:
        """Refuse, by field, a model llama.cpp's qwen4exp loader cannot hold (module doc)."""
        a = cls.arch
        gate = c.get("output_gate_type") or c.get("hidden_act")
        if gate != "sigmoid":
            raise ValueError(f"{a}: llama.cpp's qwen4exp gates the Gated DeltaNet's output with sigmoid; this model "
                             f"has output_gate_type={gate!r}")
        if c["linear_value_head_dim"] != c["linear_key_head_dim"]:
            raise ValueError(f"{a}: llama.cpp's qwen4exp takes the value heads' width from the keys'; this model has "
                             f"linear_value_head_dim={c['linear_value_head_dim']}, linear_key_head_dim="
                             f"{c['linear_key_head_dim']}")
        if not c.get("norm_topk_prob", True):
            raise ValueError(f"{a}: llama.cpp's qwen4exp renormalises the top-k expert weights; this model has "
                             f"norm_topk_prob=False")
        ids = c.get("ple_layer_ids") or []
        if len(ids) > 1:
            raise ValueError(f"{a}: llama.cpp's qwen4exp holds one PLE layer; this model has ple_layer_ids={ids}")
        if ids and c["ple_embed_dim"] != c["hidden_size"]:
            raise ValueError(f"{a}: llama.cpp's qwen4exp reads PLE's embedding hidden_size wide; this model has "
                             f"ple_embed_dim={c['ple_embed_dim']}, hidden_size={c['hidden_size']}")

    @classmethod
    def tensor_meta(cls, tensors: dict, c: dict) -> dict:
        """The PLE hash constants the converter reads from the checkpoint (``_read_hash_constants``), as uint64."""
        out = {}
        for name, t in tensors.items():
            buffer = name.rpartition(".")[2]
            if ".ple.ple_embedding." in name and buffer in CONSTANTS:
                out[CONSTANTS[buffer]] = U64(int(x) for x in t.tolist())
        return out

    # ------------------------------------------------------------------ tensors
    @classmethod
    def to_hf(cls, name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        return t - 1 if name.endswith(ZERO_CENTRED_PLE) else super().to_hf(name, t, c)

    @classmethod
    def to_gguf(cls, name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        return t + 1 if name.endswith(ZERO_CENTRED_PLE) else super().to_gguf(name, t, c)

    @classmethod
    def regroup(cls, tensors: dict, c: dict) -> dict:
        """qwen35moe's, then: the indexer's halves joined (dropped where the file's ratios make the layer dense:
        llama.cpp loads them and does not use them), the table and the hash constants in the PLE layer."""
        out = {}
        for name, t in super().regroup(tensors, c).items():
            if name.endswith("indexer.index_q_proj.weight"):
                p = name.removesuffix("index_q_proj.weight")
                k = tensors.get(p + "index_k_proj.weight")
                if k is not None and c.get("_qsa", True):      # half a pair: load's probe of the quantised ones
                    out[p + "index_qk_proj.weight"] = torch.cat([t, k])
            elif name.endswith("indexer.index_k_proj.weight"):
                continue
            elif ".self_attn.indexer." in name and not c.get("_qsa", True):
                continue
            else:
                out[name] = t
        table = out.pop(TABLE, None)
        ids = c.get("ple_layer_ids") or []
        if table is not None and ids:
            p = cls.hf_layer.format(i=ids[0] - 1) + "ple.ple_embedding."
            out[p + "ngram_embedding.weight"] = table
            out.update({p + k: torch.tensor(v, dtype=torch.long) for k, v in c["_ple"].items()})
        return out

    @classmethod
    def split(cls, tensors: dict, c: dict) -> dict:
        """``regroup``'s inverse (the hash constants go to the metadata: ``tensor_meta``)."""
        c = cls.text(c)
        cls.check(c)
        out = {}
        for name, t in super().split(tensors, c).items():
            if name.endswith("indexer.index_qk_proj.weight"):
                p = name.removesuffix("index_qk_proj.weight")
                q = c["indexer_n_heads"] * c["indexer_head_dim"]
                out[p + "index_q_proj.weight"], out[p + "index_k_proj.weight"] = t[:q], t[q:]
            elif ".ple.ple_embedding.ngram_embedding.shard_" in name:
                continue
            elif ".ple.ple_embedding." in name:
                continue
            else:
                out[name] = t
        shards = {int(k.rpartition(".shard_")[2].partition(".")[0]): t for k, t in tensors.items()
                  if ".ple.ple_embedding.ngram_embedding.shard_" in k}
        if shards:
            out[TABLE] = torch.cat([shards[j] for j in sorted(shards)])
        return out
