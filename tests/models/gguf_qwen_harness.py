"""GGUF files of Qwen3-Next and Qwen3.5 checkpoints written with ggml's own ``gguf`` package, by llama.cpp's
converter rules (``conversion/qwen.py``: Qwen3NextModel, _LinearAttentionVReorderBase, _QwenMtpMixin,
_Qwen35MRopeMixin; ``conversion/base.py``'s TextModel metadata and choice of types; gguf-py's tensor names)
written out here, independently of ``subquad.models.gguf``: a Hugging Face folder (config.json,
model.safetensors - what the converter reads) in, a file out. And the reference a quantised file is held to:
the folder with every tensor the file stores quantised replaced by ``gguf.quants.dequantize`` of it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.models.gguf_harness import TYPES, gguf, write_tensors  # noqa: E402  (gguf: the extra, or a skip)

ARCH = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_text": "qwen35", "qwen3_5_moe": "qwen35moe",
        "qwen3_5_moe_text": "qwen35moe", "qwen4_exp_text": "qwen4exp"}
# Hugging Face name (in model.layers.{i}., after the converter's renames) -> GGUF name (in blk.{i}.): gguf-py's
# tensor_mapping.py for these architectures
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
         "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.in_proj_qkvz.weight": "ssm_in.weight",
         "linear_attn.in_proj_b.weight": "ssm_beta.weight",
         "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
         "linear_attn.dt_proj.bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a",
         "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
         "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight", "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
         "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
         "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
         "eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
         "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
MTP_OWN = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "shared_head.norm"}
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}


def hparams(folder) -> dict:
    """config.json with text_config moved to the top (ModelBase.load_hparams / TextModel.__init__)."""
    c = json.loads((folder / "config.json").read_text())
    return {**c, **c.get("text_config", {})}


def _reorder_v(t, dim, hk, r, width):
    """_LinearAttentionVReorderBase._reorder_v_heads: (Hk, r, w) -> (r, Hk, w) along ``dim``."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [hk, r, width] + shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(shape)


def converted(folder, tensors: dict | None = None, legacy: bool = False) -> dict:
    """{GGUF name: tensor} as the converter writes the folder's checkpoint (``tensors``: these instead of the
    folder's, the same names and shapes; ``legacy``: Qwen3-Next's in_proj_qkvz as it is, ``ssm_in``, as the
    converter wrote it before splitting it into attn_qkv and attn_gate)."""
    h = hparams(folder)
    kind = ARCH[h["model_type"]]
    n = h["num_hidden_layers"]
    hk, hv = h["linear_num_key_heads"], h["linear_num_value_heads"]
    K, V = h["linear_key_head_dim"], h["linear_value_head_dim"]
    sd = load_file(str(folder / "model.safetensors")) if tensors is None else tensors
    staged = {}
    for name, t in sd.items():
        if "visual." in name or (name == "lm_head.weight" and h.get("tie_word_embeddings")):
            continue                                   # filter_tensors: the vision tower; a tied head is not saved
        name = name.replace("language_model.", "")
        if name.startswith("mtp."):                  # _QwenMtpMixin.filter_tensors
            parts = name.split(".", 3)
            if parts[1] == "layers":
                name = f"model.layers.{n + int(parts[2])}.{parts[3]}"
            else:
                name = f"model.layers.{n}.{MTP_OWN[parts[1]]}.{parts[2]}"
        t = t if t.dtype == torch.float64 else t.float()          # float64: dequantized_folder's indices
        if kind == "qwen3next" and ".mlp.gate_proj." in name:
            raise ValueError(f"{name}: qwen3next's tensor map has no dense MLP (the converter cannot map it)")
        if kind != "qwen3next" and hk != hv and "linear_attn." in name:   # the V reorder (qwen35, qwen35moe)
            r = hv // hk
            if ".in_proj_qkv." in name:
                t = torch.cat([t[:2 * hk * K], _reorder_v(t[2 * hk * K:], 0, hk, r, V)])
            elif ".in_proj_z." in name:
                t = _reorder_v(t, 0, hk, r, V)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                t = _reorder_v(t, 0, hk, r, 1)
            elif ".A_log" in name or ".dt_bias" in name:
                t = _reorder_v(t.unsqueeze(-1), 0, hk, r, 1).squeeze(-1)
            elif ".conv1d" in name:
                t = t.squeeze()
                t = torch.cat([t[:2 * hk * K], _reorder_v(t[2 * hk * K:], 0, hk, r, V)])
            elif ".out_proj." in name:
                t = _reorder_v(t, 1, hk, r, V)
        if name.endswith(".A_log"):                  # Qwen3NextModel.modify_tensors
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name and not legacy:   # per key head [q, k, v, z] -> [q...; k...; v...], z
            d = h["hidden_size"]
            split = [K, K, hv // hk * V, hv // hk * V]
            x = t.permute(1, 0).contiguous().view(-1, hk, sum(split))
            q, k, v, z = torch.split(x, split, dim=-1)
            q, k, v, z = (p.contiguous().view(d, -1) for p in (q, k, v, z))
            p = name.removesuffix("in_proj_qkvz.weight")
            staged[p + "in_proj_qkv.weight"] = torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous()
            staged[p + "in_proj_z.weight"] = z.permute(1, 0).contiguous()
            continue
        staged[name] = t
    out, experts = {}, {}
    for name, t in staged.items():                   # Qwen2MoeModel: the experts stacked, (E, rows, cols)
        if ".mlp.experts." in name:
            base, _, rest = name.partition(".mlp.experts.")
            e, _, w = rest.partition(".")
            experts.setdefault(f"{base}.mlp.experts.{w}", {})[int(e)] = t
            continue
        out[_gguf_name(name)] = t
    for name, parts in experts.items():
        out[_gguf_name(name)] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def _gguf_name(name: str) -> str:
    if name in TOP:
        return TOP[name]
    i, rest = name.removeprefix("model.layers.").split(".", 1)
    return f"blk.{i}.{LAYER[rest]}"


def _kind(g: str, t: np.ndarray, outtype: str):
    """ModelBase.prepare_tensors' choice: F32 for 1-D tensors, norms, routers, convolutions, anything not a
    ``.weight``; ``outtype`` for the rest (F16 where a row is not a multiple of the block)."""
    if t.ndim <= 1 or g.endswith("_norm.weight") or ".ffn_gate_inp" in g or ".ssm_conv1d." in g \
            or not g.endswith(".weight"):
        return TYPES["f32"]
    return TYPES[outtype]


def convert(folder, path, outtype="f32", override: dict | None = None, legacy: bool = False,
            tensors: dict | None = None, more=None) -> dict:
    """Write the Qwen3-Next / Qwen3.5 folder as llama.cpp's converter does; {GGUF name: the type written}.
    ``override``: metadata keys given another value of the same type (None: left out) - a bad file;
    ``legacy``: ``converted``'s; ``tensors`` (GGUF name -> tensor) instead of ``converted``'s and ``more(writer,
    hparams)`` writing a subclass's metadata after these (gguf_qwen4_harness.py)."""
    h = hparams(folder)
    arch = ARCH[h["model_type"]]
    sd = load_file(str(folder / "model.safetensors"))
    n, n_mtp = h["num_hidden_layers"], len({k.split(".")[2] for k in sd if k.startswith("mtp.layers.")})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n + n_mtp)                                   # TextModel.set_gguf_parameters
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    if h.get("intermediate_size") is not None:
        w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h["num_key_value_heads"])
    rope = dict(h["rope_parameters"])
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    if h.get("num_experts"):
        w.add_expert_count(h["num_experts"])
        w.add_expert_used_count(h["num_experts_per_tok"])
    w.add_key_length(h["head_dim"])
    w.add_value_length(h["head_dim"])
    w.add_file_type(FILE_TYPES[outtype])
    if h.get("moe_intermediate_size") is not None and h.get("num_experts"):     # Qwen2MoeModel
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(h["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(h["linear_conv_kernel_dim"])              # Qwen3NextModel
    w.add_ssm_state_size(h["linear_key_head_dim"])
    w.add_ssm_group_count(h["linear_num_key_heads"])
    w.add_ssm_time_step_rank(h["linear_num_value_heads"])
    w.add_ssm_inner_size(h["linear_value_head_dim"] * h["linear_num_value_heads"])
    w.add_array(f"{arch}.attention.recurrent_layers",
                [t == "linear_attention" for t in h["layer_types"]] + [False] * n_mtp)
    w.add_full_attention_interval(h.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(h["head_dim"] * rope.get("partial_rotary_factor", 0.25)))
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    if arch != "qwen3next" and "mrope_section" not in rope:          # _Qwen35MRopeMixin's default
        w.add_rope_dimension_sections([11, 11, 10, 0])
    if more is not None:
        more(w, h)
    for key, value in (override or {}).items():
        if value is None:
            del w.kv_data[0][key]
        else:
            w.kv_data[0][key].value = value
    tensors = converted(folder, legacy=legacy) if tensors is None else tensors
    return write_tensors(w, tensors, lambda g, a: _kind(g, a, outtype))


def dequantized_folder(folder, gguf_path, out):
    """``folder`` with every checkpoint value the file stores quantised (or F16) replaced by
    ``gguf.quants.dequantize`` of the stored value (read by gguf's GGUFReader), written to ``out``. Where each
    value went is found by converting a checkpoint of indices (exact in float64)."""
    sd = load_file(str(folder / "model.safetensors"))
    flat, index, base = [], {}, 0
    for name, t in sd.items():
        flat.append(t.detach().double().reshape(-1))
        index[name] = torch.arange(base, base + t.numel(), dtype=torch.float64).reshape(t.shape)
        base += t.numel()
    values = torch.cat(flat)
    stored = gguf.GGUFReader(str(gguf_path)).tensors
    where = converted(folder, index, legacy=any(t.name.endswith(".ssm_in.weight") for t in stored))
    for t in stored:
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        values[where[t.name].reshape(-1).long()] = torch.from_numpy(np.ascontiguousarray(w)).double().reshape(-1)
    new, base = {}, 0
    for name, t in sd.items():
        new[name] = values[base:base + t.numel()].reshape(t.shape).to(t.dtype)
        base += t.numel()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "config.json", out / "config.json")
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
