"""GGUF files of LFM2-MoE, RWKV-7 (fla layout) and Kimi-Linear checkpoints written with ggml's own ``gguf`` package,
by llama.cpp's converter rules (``conversion/lfm2.py``: LFM2MoeModel; ``conversion/rwkv.py``: Rwkv7Model;
``conversion/kimi_linear.py``: KimiLinearModel;
``conversion/base.py``'s TextModel metadata and choice of types; gguf-py's tensor names) written out here,
independently of ``subquad.models.gguf``: a Hugging Face folder (config.json, model.safetensors - what the
converter reads) in, a file out. And the reference a quantised file is held to: the
folder with every tensor the file stores quantised replaced by ``gguf.quants.dequantize`` of it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

gguf = __import__("pytest").importorskip("gguf")

ARCH = {"lfm2_moe": "lfm2moe", "rwkv7": "rwkv7", "kimi_linear": "kimi-linear"}
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


# RWKV-7: the name after Rwkv7Model.filter_tensors' and modify_tensors' renames (blocks -> layers, ffn ->
# feed_forward, attn -> attention, feed_forward_norm -> ln2, g_norm -> ln_x; _lora.lora.0.weight -> 1.weight,
# .2.weight -> 2.weight, .2.bias -> 0.weight), in model.layers.{i}. -> GGUF name in blk.{i}. (tensor_mapping.py)
RWKV7_LAYER = {"attention_norm": "attn_norm", "ln2": "attn_norm_2", "attention.ln_x": "time_mix_ln",
               "attention.k_k": "time_mix_k_k", "attention.k_a": "time_mix_k_a", "attention.r_k": "time_mix_r_k",
               "attention.r_proj": "time_mix_receptance", "attention.k_proj": "time_mix_key",
               "attention.v_proj": "time_mix_value", "attention.o_proj": "time_mix_output",
               **{f"attention.{n}{j}": f"time_mix_{n}{j}" for n in "wavg" for j in "012"},
               "feed_forward.x_k": "channel_mix_lerp_k", "feed_forward.key": "channel_mix_key",
               "feed_forward.value": "channel_mix_value"}
RWKV7_TOP = {"model.embeddings": "token_embd", "model.layers.0.pre_norm": "token_embd_norm",
             "model.norm": "output_norm", "lm_head": "output"}
LERPS = ["r", "w", "k", "v", "a", "g"]                    # wkv_has_gate
# Rwkv7Model's LoRAs never transposed (fla's names), F32 always (prepare_tensors' list): the decay's and the lerps
RWKV7_F32 = (".time_mix_w1.weight", ".time_mix_w2.weight", ".time_mix_lerp_fused.weight")


def rwkv7_converted(folder, tensors: dict | None = None) -> dict:
    """{GGUF name: tensor} as Rwkv7Model writes the fla folder's checkpoint (``tensors``: these instead)."""
    sd = load_file(str(folder / "model.safetensors")) if tensors is None else tensors
    out, lerps = {}, {}
    for name, t in sd.items():
        t = t if t.dtype == torch.float64 else t.float()
        name = name.replace("blocks", "layers").replace("ffn", "feed_forward")          # filter_tensors
        name = name.replace("self_attn", "attention").replace("attn", "attention").replace("time_mixer.", "")
        name = name.replace("feed_forward_norm", "ln2").replace("g_norm", "ln_x")
        name = name.replace("_lora.lora.0.weight", "1.weight").replace("_lora.lora.2.weight", "2.weight")
        name = name.replace("_lora.lora.2.bias", "0.weight")
        parts = name.split(".")
        bid = int(parts[2]) if name.startswith("model.layers.") else None
        if bid == 0 and ".attention.v" in name and "_proj" not in name:
            continue                                           # layer 0's dummy v0 / v1 / v2 (none in fla's)
        if bid is not None and ".attention.x_" in name:
            lerps.setdefault(bid, {})[name] = t
            if all(f"model.layers.{bid}.attention.x_{m}" in lerps[bid] for m in LERPS):
                out[f"blk.{bid}.time_mix_lerp_fused.weight"] = torch.stack(
                    [lerps[bid][f"model.layers.{bid}.attention.x_{m}"] for m in LERPS])
            continue
        t = t.squeeze()
        base, suffix = (name[:-len(".weight")], ".weight") if name.endswith(".weight") else \
            (name[:-len(".bias")], ".bias") if name.endswith(".bias") else (name, ".weight")
        if base in RWKV7_TOP:
            g = RWKV7_TOP[base] + suffix
        else:
            g = f"blk.{bid}.{RWKV7_LAYER[base.split('.', 3)[3]]}{suffix}"
        if ".time_mix_r_k." in g:
            t = t.flatten()
        if bid == 0 and ".time_mix_a" in g:
            out[g.replace("time_mix_a", "time_mix_v")] = t
        out[g] = t
    return out


# Kimi-Linear: Hugging Face name in model.layers.{i}. (after TextModel.filter_tensors' e_score_correction_bias ->
# e_score_correction.bias and KimiLinearModel's renames) -> GGUF name in blk.{i}. (tensor_mapping.py)
KIMI_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_conv1d.weight": "ssm_conv1d_q.weight", "self_attn.k_conv1d.weight": "ssm_conv1d_k.weight",
    "self_attn.v_conv1d.weight": "ssm_conv1d_v.weight", "self_attn.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.f_b_proj.weight": "ssm_f_b.weight", "self_attn.g_a_proj.weight": "ssm_g_a.weight",
    "self_attn.g_b_proj.weight": "ssm_g_b.weight", "self_attn.b_proj.weight": "ssm_beta.weight",
    "self_attn.A_log": "ssm_a", "self_attn.dt_proj.bias": "ssm_dt.bias", "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.k_b_proj.weight": "attn_k_b.weight", "self_attn.v_b_proj.weight": "attn_v_b.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction.bias": "exp_probs_b.bias",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}
KIMI_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
KIMI_EXPERTS = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
KIMI_F32 = (".ssm_conv1d_q.weight", ".ssm_conv1d_k.weight", ".ssm_conv1d_v.weight")


def released_kimi_folder(folder):
    """Rewrite a transformers-saved Kimi-Linear folder as the released checkpoints spell it, which is what
    KimiLinearModel reads (``linear_attn_config`` with 1-indexed ``full_attn_layers``, ``first_k_dense_replace``,
    ``moe_router_activation_func``, ``num_key_value_heads`` = the heads; the dense MLPs under ``mlp.``, not
    ``block_sparse_moe.``): the same model, the same weights."""
    c = hparams(folder)
    types = c.pop("layer_types")
    mlp = c.pop("mlp_layer_types")
    dense = mlp.count("dense")
    assert mlp == ["dense"] * dense + ["sparse"] * (len(mlp) - dense)
    c["linear_attn_config"] = {"full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
                               "kda_layers": [i + 1 for i, t in enumerate(types) if t != "full_attention"],
                               "num_heads": c.pop("linear_num_heads"), "head_dim": c.pop("linear_head_dim"),
                               "short_conv_kernel_size": c.pop("linear_conv_kernel_dim")}
    c.update(first_k_dense_replace=dense, moe_router_activation_func="sigmoid",
             num_key_value_heads=c["num_attention_heads"])
    c.pop("head_dim", None)                       # transformers' derived field, not in the released config
    (folder / "config.json").write_text(json.dumps(c, indent=1))
    sd = load_file(str(folder / "model.safetensors"))
    sd = {(k.replace(".block_sparse_moe.", ".mlp.") if int(k.split(".")[2]) < dense else k)
          if k.startswith("model.layers.") else k: v for k, v in sd.items()}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def kimi_converted(folder, tensors: dict | None = None) -> dict:
    """{GGUF name: tensor} as KimiLinearModel writes the (released-style) folder's checkpoint."""
    h = hparams(folder)
    sd = load_file(str(folder / "model.safetensors")) if tensors is None else tensors
    out, experts = {}, {}
    for name, t in sd.items():
        t = t if t.dtype == torch.float64 else t.float()
        if name.endswith("e_score_correction_bias"):                          # TextModel.filter_tensors
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith((".q_conv1d.weight", ".k_conv1d.weight", ".v_conv1d.weight")):
            d_inner, _, d_conv = t.shape                                       # (C, 1, k) -> (1, C, 1, k)
            t = t.reshape(1, d_inner, 1, d_conv)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        if name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        if "block_sparse_moe.experts" in name:
            base, _, rest = name.partition(".block_sparse_moe.experts.")
            e, w, _ = rest.split(".")
            experts.setdefault((base, w), {})[int(e)] = t
            continue
        if name.endswith("kv_b_proj.weight"):                                 # split per head, k_b transposed
            H, v, nope = h["num_key_value_heads"], h["v_head_dim"], h["qk_nope_head_dim"]
            assert t.shape[0] == H * (v + nope)
            k_b, v_b = torch.split(t.view(H, v + nope, t.shape[-1]), [nope, v], dim=1)
            out[_kimi_name(name.replace("kv_b_proj", "k_b_proj"))] = k_b.transpose(1, 2)
            out[_kimi_name(name.replace("kv_b_proj", "v_b_proj"))] = v_b
            continue
        out[_kimi_name(name)] = t
    for (base, w), parts in experts.items():
        assert len(parts) == h["num_experts"]
        out[f"blk.{base.split('.')[2]}.{KIMI_EXPERTS[w]}"] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def _kimi_name(name: str) -> str:
    if name in KIMI_TOP:
        return KIMI_TOP[name]
    i, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{i}.{KIMI_LAYER[rest]}"


def _kimi_metadata(w, h):
    """TextModel.set_gguf_parameters and KimiLinearModel.set_gguf_parameters for a released-style config, as the
    converter reads it: through transformers' AutoConfig (kimi_linear is a transformers type), whose to_dict()
    adds head_dim = qk_rope_head_dim and topk_group (default 1)."""
    lin = h["linear_attn_config"]
    n = h["num_hidden_layers"]
    head_dim = h["qk_rope_head_dim"]                         # KimiLinearConfig.__post_init__
    w.add_block_count(n)
    w.add_context_length(h.get("max_position_embeddings") or h["model_max_length"])
    w.add_embedding_length(h["hidden_size"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_expert_count(h["num_experts"])
    w.add_expert_used_count(h["num_experts_per_token"])
    w.add_expert_group_used_count(h.get("topk_group", 1))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)              # moe_router_activation_func
    w.add_key_length(head_dim)                                               # replaced below
    w.add_value_length(head_dim)
    w.add_vocab_size(h["vocab_size"])
    w.add_head_count_kv([1 if i + 1 in lin["full_attn_layers"] else 0 for i in range(n)])   # MLA as MQA
    w.add_ssm_conv_kernel(lin["short_conv_kernel_size"])
    w.add_kda_head_dim(lin["head_dim"])
    if h.get("q_lora_rank") is not None:
        w.add_q_lora_rank(h["q_lora_rank"])
    w.add_kv_lora_rank(h["kv_lora_rank"])
    w.add_rope_dimension_count(h["qk_rope_head_dim"])
    w.add_key_length(h["kv_lora_rank"] + h["qk_rope_head_dim"])
    w.add_key_length_mla(h["qk_nope_head_dim"] + h["qk_rope_head_dim"])
    w.add_value_length_mla(h["v_head_dim"])
    w.add_expert_feed_forward_length(h["moe_intermediate_size"])
    w.add_expert_shared_count(h["num_shared_experts"])
    w.add_leading_dense_block_count(h["first_k_dense_replace"])
    w.add_expert_weights_scale(h["routed_scaling_factor"])


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
            or not g.endswith(".weight") or g.endswith(RWKV7_F32 + KIMI_F32):
        return TYPES["f32"]
    return TYPES[outtype]


def _rwkv7_metadata(w, h):
    """Rwkv7Model.set_gguf_parameters (the config's ranks, which the fla folders here all give)."""
    w.add_context_length(1048576)
    w.add_embedding_length(h["hidden_size"])
    w.add_block_count(h["num_hidden_layers"])
    w.add_layer_norm_eps(h["norm_eps"])
    w.add_wkv_head_size(h["head_dim"])
    w.add_decay_lora_rank(h["decay_low_rank_dim"])
    w.add_iclr_lora_rank(h["a_low_rank_dim"])
    w.add_value_residual_mix_lora_rank(h["v_low_rank_dim"])
    w.add_gate_lora_rank(h["gate_low_rank_dim"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(0)


WORLD_VOCAB = "rwkv_vocab_v20230424.txt"


def set_vocab_rwkv_world(w, folder, h):
    """TextModel._set_vocab_rwkv_world (conversion/base.py): "<s>" (control), then each line's token as the UTF-8
    of ``repr(bytes)[2:-1]`` (normal), "[PAD{i}]" (unused) up to vocab_size; model "rwkv"; eot 261 ("\n\n"),
    bos = eos = 0; the chat template "rwkv-world" (its fallback where llama.cpp's template file is not beside it).
    gguf-py's SpecialVocab writes the ids and the template."""
    import ast

    tokens, types = [b"<s>"], [gguf.TokenType.CONTROL]
    for line in (folder / WORLD_VOCAB).read_text(encoding="utf-8").splitlines(keepends=True):
        parts = line.split(" ")
        token, n = ast.literal_eval(" ".join(parts[1:-1])), int(parts[-1])
        token = token.encode("utf-8") if isinstance(token, str) else token
        assert isinstance(token, bytes) and len(token) == n
        tokens.append(repr(token)[2:-1].encode("utf-8"))
        types.append(gguf.TokenType.NORMAL)
    for i in range(len(tokens), h.get("vocab_size", 65536)):
        tokens.append(f"[PAD{i}]".encode("utf-8"))
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("rwkv")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_eot_token_id(261)
    w.add_chat_template("rwkv-world")


def convert(folder, path, outtype="f32", override: dict | None = None) -> dict:
    """Write the LFM2-MoE / RWKV-7 folder as llama.cpp's converter does; {GGUF name: the type written}. An RWKV-7
    folder holding RWKV's world vocabulary file gets it as the converter writes it (``set_vocab_rwkv_world``).
    ``override``: metadata keys given another value of the same type (None: left out) - a bad file."""
    h = hparams(folder)
    arch = ARCH[h["model_type"]]
    w = gguf.GGUFWriter(str(path), arch)
    if arch == "rwkv7":
        _rwkv7_metadata(w, h)
        w.add_file_type(FILE_TYPES[outtype])
        if (folder / WORLD_VOCAB).is_file():            # the converter asserts it; the tests' folders may lack it
            set_vocab_rwkv_world(w, folder, h)
        return _write(w, rwkv7_converted(folder), outtype, override)
    if arch == "kimi-linear":
        _kimi_metadata(w, h)
        w.add_file_type(FILE_TYPES[outtype])
        return _write(w, kimi_converted(folder), outtype, override)
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
    return _write(w, converted(folder), outtype, override)


def _write(w, tensors: dict, outtype: str, override: dict | None) -> dict:
    for key, value in (override or {}).items():
        if value is None:
            del w.kv_data[0][key]
        else:
            w.kv_data[0][key].value = value
    types = {}
    for g, t in tensors.items():
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
