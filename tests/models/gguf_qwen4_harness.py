"""GGUF files of Qwen4-Exp checkpoints (``qwen4exp``) written with ggml's own ``gguf`` package by llama.cpp's converter
rules (``conversion/qwen4exp.py``: Qwen4ExpTextModel's metadata and ``modify_tensors``, on Qwen3.5's rules, which
``gguf_qwen_harness.py`` writes out; gguf-py's ``tensor_mapping.py`` for QWEN4EXP) written out here, independently
of ``subquad.models.gguf``: a Hugging Face folder in, a file out. And the reference a quantised file is held to: the
folder with every tensor the file stores quantised (or F16) replaced by ``gguf.quants.dequantize`` of it."""

from __future__ import annotations

import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.models import gguf_qwen_harness as qwen
from tests.models.gguf_harness import gguf

# tensor_mapping.py's QWEN4EXP block mappings (inside model.layers.{i}. -> inside blk.{i}.) and top-level ones
HC = {"hc_norm": "norm", "input_mix_weight_down": "down", "input_mix_weight_up": "up", "block_inject_weight": "inject"}
LAYER = {**{f"attn_hyper_connection.{k}.weight": f"hc_attn_{v}.weight" for k, v in HC.items()},
         **{f"mlp_hyper_connection.{k}.weight": f"hc_ffn_{v}.weight" for k, v in HC.items()},
         "self_attn.indexer.q_layernorm.weight": "indexer.q_norm.weight",
         "self_attn.indexer.k_layernorm.weight": "indexer.k_norm.weight",
         "ple.key_proj.weight": "ple_key.weight", "ple.value_proj.weight": "ple_value.weight",
         "ple.norm_key.weight": "ple_norm_key.weight", "ple.norm_query.weight": "ple_norm_query.weight",
         "ple.norm_conv.weight": "ple_norm_conv.weight", "ple.conv1d.weight": "ple_conv1d.weight"}
TOP = {f"model.hyper_connection_mixer.{k}.weight": f"output_hc_{v}.weight" for k, v in HC.items() if v != "inject"}
CONSTANTS = {"layer_multipliers": "ple.layer_multipliers", "ngram_heads_offsets": "ple.head_offsets",
             "ngram_heads_vocab_sizes": "ple.head_vocab_sizes"}


def converted(folder, tensors: dict | None = None) -> dict:
    """{GGUF name: tensor} as the converter writes the folder's checkpoint (``tensors``: these instead)."""
    h = qwen.hparams(folder)
    sd = load_file(str(folder / "model.safetensors")) if tensors is None else tensors
    own, rest, shards = {}, {}, {}
    for name, t in sd.items():
        if name.startswith("mtp."):                              # Qwen4ExpTextModel.no_mtp: filter_tensors drops it
            continue
        if ".ple_embedding." in name and name.rpartition(".")[2] in CONSTANTS:
            continue                                             # -> metadata (_read_hash_constants)
        if ".ngram_embedding.shard_" in name:                    # _place_ple_shard: by index, rows concatenated
            shards[int(name.rpartition(".shard_")[2].partition(".")[0])] = t
            continue
        t = t if t.dtype == torch.float64 else t.float()
        if name in TOP:
            own[TOP[name]] = t + 1 if name.endswith("hc_norm.weight") else t   # Qwen3NextModel: *norm.weight + 1
            continue
        i, _, tail = name.removeprefix("model.layers.").partition(".")
        if tail == "self_attn.indexer.index_qk_proj.weight":    # split by rows, as minimax-m3 does
            n_q = h["indexer_n_heads"] * h["indexer_head_dim"]
            own[f"blk.{i}.indexer.q_proj.weight"], own[f"blk.{i}.indexer.k_proj.weight"] = t[:n_q], t[n_q:]
        elif tail.endswith(("ple.norm_key.weight", "ple.norm_query.weight", "ple.norm_conv.weight",
                            "indexer.q_layernorm.weight", "indexer.k_layernorm.weight")):
            own[f"blk.{i}.{LAYER[tail]}"] = t + 1                # Gemma-style zero-centred gammas, once
        elif tail == "ple.conv1d.weight":
            own[f"blk.{i}.{LAYER[tail]}"] = t.squeeze()
        elif tail in LAYER:
            own[f"blk.{i}.{LAYER[tail]}"] = t + 1 if tail.endswith("norm.weight") else t
        else:
            rest[name] = t
    if shards:
        own["per_layer_token_embd.weight"] = torch.cat([shards[j].float() if shards[j].dtype != torch.float64
                                                        else shards[j] for j in sorted(shards)])
    return {**qwen.converted(folder, rest), **own}


def _metadata(folder):
    """Qwen4ExpTextModel.set_gguf_parameters after Qwen3.5's: a ``more`` for gguf_qwen_harness.convert."""
    sd = load_file(str(folder / "model.safetensors"))

    def more(w, h):
        a = w.arch
        w.add_uint32(f"{a}.hyper_connection.count", h["hc_count"])
        w.add_uint32(f"{a}.hyper_connection.low_rank", h["hc_lowrank"])
        w.add_uint32(f"{a}.attention.indexer.head_count", h["indexer_n_heads"])
        w.add_uint32(f"{a}.attention.indexer.key_length", h["indexer_head_dim"])
        w.add_uint32(f"{a}.attention.indexer.top_k", h["indexer_budget"])
        w.add_array(f"{a}.attention.compress_ratios", [h["indexer_compress_ratio"] if t == "full_attention" else 0
                                                       for t in h["layer_types"]])
        layers = [i - 1 for i in h.get("ple_layer_ids") or []]
        if not layers:
            return
        w.add_array(f"{a}.ple.layers", layers)
        w.add_uint32(f"{a}.ple.ngram_size", h["ngram_size"])
        w.add_uint32(f"{a}.ple.heads_per_ngram", h["heads_per_ngram"])
        w.add_uint32(f"{a}.ple.conv_kernel", h["ple_conv_kernel_size"])
        eos = h["eos_token_id"]
        w.add_uint32(f"{a}.ple.eos_token_id", int(eos[-1] if isinstance(eos, list) else eos))
        row = next(t.shape[-1] for k, t in sd.items() if ".ngram_embedding.shard_" in k)
        w.add_uint32(f"{a}.embedding_length_per_layer_input", row)
        for buffer, key in CONSTANTS.items():      # int64 in the checkpoint, uint64 in the file (_add_u64_array)
            values = next(t for k, t in sd.items() if k.endswith("ple_embedding." + buffer))
            w.add_key_value(f"{a}.{key}", [int(x) for x in values.tolist()], gguf.GGUFValueType.ARRAY,
                            gguf.GGUFValueType.UINT64)
    return more


def convert(folder, path, outtype="f32", override: dict | None = None) -> dict:
    """Write the Qwen4-Exp folder as llama.cpp's converter does; {GGUF name: the type written} (``override``:
    gguf_qwen_harness.convert's)."""
    return qwen.convert(folder, path, outtype, override, tensors=converted(folder), more=_metadata(folder))


def dequantized_folder(folder, gguf_path, out):
    """``folder`` with every float value the file stores quantised (or F16) replaced by ``gguf.quants.dequantize``
    of it; where each value went is found by converting a checkpoint of indices (exact in float64). The int64 hash
    constants are kept as they are."""
    sd = load_file(str(folder / "model.safetensors"))
    floats = {k: t for k, t in sd.items() if t.is_floating_point()}
    flat, index, base = [], {}, 0
    for name, t in floats.items():
        flat.append(t.detach().double().reshape(-1))
        index[name] = torch.arange(base, base + t.numel(), dtype=torch.float64).reshape(t.shape)
        base += t.numel()
    values = torch.cat(flat)
    where = converted(folder, {**sd, **index})
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        values[where[t.name].reshape(-1).long()] = torch.from_numpy(np.ascontiguousarray(w)).double().reshape(-1)
    new, base = dict(sd), 0
    for name, t in floats.items():
        new[name] = values[base:base + t.numel()].reshape(t.shape).to(t.dtype)
        base += t.numel()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "config.json", out / "config.json")
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
