"""GGUF files of MiniMax checkpoints written with ggml's own ``gguf`` package by llama.cpp's converter rules
(``conversion/minimax.py``: MiniMaxText01Model; ``conversion/base.py``'s TextModel metadata and choice of types;
gguf-py's tensor names) written out here, independently of ``subquad.models.gguf``: a transformers-saved MiniMax
folder in, a file out - read as the converter reads the released checkpoint's spelling (``released_config``),
which the converter needs (it takes ``layernorm_*_alpha`` / ``_beta`` and ``rotary_dim``, and maps no lightning
buffers). And the reference a quantised file is held to: ``gguf_more_harness.dequantized_folder`` with
``converted``."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from tests.models.gguf_harness import TYPES, write_tensors

gguf = __import__("pytest").importorskip("gguf")

ARCH = "minimax-01"
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}
# the lightning layers' buffers transformers saves; the released checkpoint has none (the converter maps none)
BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
# Hugging Face name in model.layers.{i}. -> GGUF name in blk.{i}. (gguf-py's tensor_mapping.py for MINIMAX01)
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.out_proj.weight": "attn_output.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
         "self_attn.output_gate.weight": "attn_gate.weight", "self_attn.norm.weight": "attn_norm_2.weight",
         "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
# MiniMaxText01Model.modify_tensors' merged "layers.{bid}.feed_forward.experts.{w}.weight" (mixtral's)
EXPERTS = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}


def released_config(c: dict) -> dict:
    """transformers' MiniMax config.json -> the released MiniMax-Text-01's spelling of the same model:
    ``attn_type_list`` (0 lightning, 1 softmax), ``layernorm_{full_attention,linear_attention,mlp}_{alpha,beta}``,
    ``postnorm`` true (transformers' residual is from the normed stream), ``rotary_dim`` = ``head_dim`` (transformers
    rotates whole heads), ``rope_theta`` at the top, the remote-code architecture name."""
    c = dict(c)
    hd = c.pop("head_dim", None) or c["hidden_size"] // c["num_attention_heads"]
    types = c.pop("layer_types")
    out = {k: v for k, v in c.items() if not k.endswith(("_alpha_factor", "_beta_factor"))
           and k not in ("rope_parameters", "architectures", "model_type")}
    out.update(architectures=["MiniMaxText01ForCausalLM"], model_type="minimax_text_01", head_dim=hd,
               rotary_dim=hd, postnorm=True, rope_theta=c["rope_parameters"]["rope_theta"],
               attn_type_list=[1 if t == "full_attention" else 0 for t in types])
    for ours, theirs in (("full_attn", "full_attention"), ("linear_attn", "linear_attention"), ("mlp", "mlp")):
        out[f"layernorm_{theirs}_alpha"] = c.get(f"{ours}_alpha_factor", 1)
        out[f"layernorm_{theirs}_beta"] = c.get(f"{ours}_beta_factor", 1)
    return out


def released_folder(folder, out):
    """The transformers folder as the released checkpoint spells it (``released_config``, no lightning buffers,
    ``model.safetensors.index.json``: the converter's check for zero-embedding added tokens reads it), with the
    folder's tokenizer files: what llama.cpp's own converter reads."""
    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(released_config(hparams(folder)), indent=1))
    sd = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.endswith(BUFFERS)}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in sd}}))
    return out


def hparams(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def converted(folder, tensors: dict | None = None) -> dict:
    """{GGUF name: tensor} as the converter writes the folder's checkpoint (``tensors``: these instead of the
    folder's, the same names and shapes)."""
    h = hparams(folder)
    sd = load_file(str(folder / "model.safetensors")) if tensors is None else tensors
    out, experts = {}, {}
    for name, t in sd.items():
        if name.endswith(BUFFERS):
            continue
        t = t if t.dtype == torch.float64 else t.float()          # float64: dequantized_folder's indices
        if "block_sparse_moe.experts." in name:                   # merged per layer, experts in order, dim 0
            _, _, bid, _, _, e, w, _ = name.split(".")
            experts.setdefault((bid, w), {})[int(e)] = t
            continue
        if name in TOP:
            out[TOP[name]] = t
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            out[f"blk.{i}.{LAYER[rest]}"] = t
    for (bid, w), parts in experts.items():
        assert sorted(parts) == list(range(h["num_local_experts"]))
        out[f"blk.{bid}.{EXPERTS[w]}"] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def _kind(g: str, a, outtype: str):
    """ModelBase.prepare_tensors' choice: F32 for 1-D tensors, norms, routers, anything not a ``.weight``."""
    if a.ndim <= 1 or g.endswith("_norm.weight") or ".ffn_gate_inp" in g or not g.endswith(".weight"):
        return TYPES["f32"]
    return TYPES[outtype]


def convert(folder, path, outtype="f32", override: dict | None = None) -> dict:
    """Write the transformers MiniMax folder as llama.cpp's converter writes its released spelling; {GGUF name:
    the type written}. ``override``: metadata keys given another value (None: left out) - a bad file."""
    h = released_config(hparams(folder))
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_block_count(h["num_hidden_layers"])                      # TextModel.set_gguf_parameters
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h["num_key_value_heads"])
    w.add_rope_freq_base(h["rope_theta"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_expert_count(h["num_local_experts"])
    w.add_expert_used_count(h["num_experts_per_tok"])
    w.add_key_length(h["head_dim"])
    w.add_value_length(h["head_dim"])
    w.add_file_type(FILE_TYPES[outtype])
    assert h["layernorm_full_attention_alpha"] == h["layernorm_linear_attention_alpha"] == h["layernorm_mlp_alpha"]
    assert h["layernorm_full_attention_beta"] == h["layernorm_linear_attention_beta"] == h["layernorm_mlp_beta"] == 1
    w.add_residual_scale(h["layernorm_full_attention_alpha"])      # MiniMaxText01Model.set_gguf_parameters
    w.add_rope_dimension_count(h["rotary_dim"])
    for key, value in (override or {}).items():
        if value is None:
            del w.kv_data[0][key]
        elif key in w.kv_data[0]:
            w.kv_data[0][key].value = value
        else:                                                       # a key the converter does not write
            w.add_array(key, value) if isinstance(value, list) else w.add_uint32(key, value)
    return write_tensors(w, converted(folder), lambda g, a: _kind(g, a, outtype))
