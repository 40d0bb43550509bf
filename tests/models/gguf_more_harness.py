"""GGUF files of LFM2-MoE checkpoints written with ggml's own ``gguf`` package, by llama.cpp's converter rules
(``conversion/lfm2.py``: LFM2MoeModel; ``conversion/base.py``'s TextModel metadata and choice of types; gguf-py's
tensor names) written out here, independently of ``subquad.models.gguf``: a Hugging Face folder (config.json,
model.safetensors - what the converter reads) in, a file out. And the reference a quantised file is held to: the
folder with every tensor the file stores quantised replaced by ``gguf.quants.dequantize`` of it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

gguf = __import__("pytest").importorskip("gguf")

ARCH = {"lfm2_moe": "lfm2moe"}
# Hugging Face name (in model.layers.{i}., after filter_tensors' expert_bias -> expert_bias.bias) -> GGUF name
# (in blk.{i}.): gguf-py's tensor_mapping.py for LFM2MOE
LFM2MOE_LAYER = {
    "operator_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.out_proj.weight": "attn_output.weight", "self_attn.q_layernorm.weight": "attn_q_norm.weight",
    "self_attn.k_layernorm.weight": "attn_k_norm.weight", "conv.conv.weight": "shortconv.conv.weight",
    "conv.in_proj.weight": "shortconv.in_proj.weight", "conv.out_proj.weight": "shortconv.out_proj.weight",
    "feed_forward.gate.weight": "ffn_gate_inp.weight", "feed_forward.expert_bias.bias": "exp_probs_b.bias",
    # LFM2MoeModel.modify_tensors' merged names, "layers.{bid}.feed_forward.experts.{w}.weight" (mixtral's)
    "feed_forward.experts.w1.weight": "ffn_gate_exps.weight", "feed_forward.experts.w3.weight": "ffn_up_exps.weight",
    "feed_forward.experts.w2.weight": "ffn_down_exps.weight"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.embedding_norm.weight": "token_embd_norm.weight"}
TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
         "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}


def hparams(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def converted(folder, tensors: dict | None = None) -> dict:
    """{GGUF name: tensor} as the converter writes the folder's checkpoint (``tensors``: these instead of the
    folder's, the same names and shapes)."""
    h = hparams(folder)
    sd = load_file(str(folder / "model.safetensors")) if tensors is None else tensors
    out, experts = {}, {}
    for name, t in sd.items():
        if name == "lm_head.weight":
            raise ValueError("lm_head.weight: gguf-py's LFM2MOE tensor list has no OUTPUT (the converter cannot map "
                             "an untied head)")
        if name.endswith(".expert_bias"):             # LFM2MoeModel.filter_tensors
            name += ".bias"
        t = t if t.dtype == torch.float64 else t.float()          # float64: dequantized_folder's indices
        if "conv.conv" in name:                                  # LFM2MoeModel.modify_tensors
            t = t.squeeze(1)
        if ".experts." in name:                                  # merged per layer, experts in order, dim 0
            base, _, rest = name.partition(".experts.")
            e, _, w = rest.partition(".")
            experts.setdefault(f"{base}.experts.{w}", {})[int(e)] = t
            continue
        out[_gguf_name(name)] = t
    for name, parts in experts.items():
        assert len(parts) == h["num_experts"], name
        out[_gguf_name(name)] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def _gguf_name(name: str) -> str:
    if name in TOP:
        return TOP[name]
    i, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{i}.{LFM2MOE_LAYER[rest]}"


def _kind(g: str, t, outtype: str):
    """ModelBase.prepare_tensors' choice: F32 for 1-D tensors, norms, routers, convolutions, anything not a
    ``.weight``; ``outtype`` for the rest (F16 where a row is not a multiple of the block)."""
    if t.dim() <= 1 or g.endswith("_norm.weight") or ".ffn_gate_inp" in g or ".shortconv.conv." in g \
            or not g.endswith(".weight"):
        return TYPES["f32"]
    return TYPES[outtype]


def convert(folder, path, outtype="f32", override: dict | None = None) -> dict:
    """Write the LFM2-MoE folder as llama.cpp's converter does; {GGUF name: the type written}. ``override``:
    metadata keys given another value of the same type (None: left out) - a bad file."""
    h = hparams(folder)
    arch = ARCH[h["model_type"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(h["num_hidden_layers"])                       # TextModel.set_gguf_parameters
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv([h["num_key_value_heads"] if t == "full_attention" else 0 for t in h["layer_types"]])
    w.add_rope_freq_base(h["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(h["norm_eps"])
    w.add_expert_count(h["num_experts"])
    w.add_expert_used_count(h["num_experts_per_tok"])
    w.add_file_type(FILE_TYPES[outtype])
    w.add_expert_feed_forward_length(h["moe_intermediate_size"])    # LFM2MoeModel.set_gguf_parameters
    w.add_leading_dense_block_count(h["num_dense_layers"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(h["vocab_size"])
    w.add_shortconv_l_cache(h["conv_L_cache"])
    for key, value in (override or {}).items():
        if value is None:
            del w.kv_data[0][key]
        else:
            w.kv_data[0][key].value = value
    types = {}
    for g, t in converted(folder).items():
        kind = _kind(g, t, outtype)
        try:
            data = gguf.quants.quantize(t.numpy(), kind)
        except gguf.QuantError:
            kind = TYPES["f16"]
            data = gguf.quants.quantize(t.numpy(), kind)
        w.add_tensor(g, data, raw_dtype=kind)
        types[g] = kind.name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def dequantized_folder(folder, gguf_path, out, convert_fn=converted):
    """``folder`` with every checkpoint value the file stores quantised (or F16) replaced by
    ``gguf.quants.dequantize`` of the stored value (read by gguf's GGUFReader), written to ``out``. Where each
    value went is found by converting a checkpoint of indices (exact in float64) with ``convert_fn``."""
    sd = load_file(str(folder / "model.safetensors"))
    flat, index, base = [], {}, 0
    for name, t in sd.items():
        flat.append(t.detach().double().reshape(-1))
        index[name] = torch.arange(base, base + t.numel(), dtype=torch.float64).reshape(t.shape)
        base += t.numel()
    values = torch.cat(flat)
    where = convert_fn(folder, index)
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        values[where[t.name].reshape(-1).long()] = torch.from_numpy(np.ascontiguousarray(w)).double().reshape(-1)
    new, base = {}, 0
    for name, t in sd.items():
        new[name] = values[base:base + t.numel()].reshape(t.shape).to(t.dtype)
        base += t.numel()
    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
