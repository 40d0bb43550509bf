"""GGUF files of tiny random Hugging Face models, written with ggml's own ``gguf`` package (GGUFWriter and
``gguf.quants``) by llama.cpp's converter rules (``conversion/mamba.py``, ``convert_hf_to_gguf.py``'s choice of
types) written out here, independently of ``subquad.models.gguf``; and the reference those files are held to:
the same weights dequantised by ``gguf.quants.dequantize``, saved as a Hugging Face folder."""

from __future__ import annotations

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")   # the `gguf` extra installs it (make test requires it)

# Hugging Face name (inside backbone.layers.{i}.) -> GGUF name (inside blk.{i}.): conversion/mamba.py with
# gguf-py's tensor_mapping.py
LAYER = {"norm.weight": "attn_norm.weight", "mixer.in_proj.weight": "ssm_in.weight",
         "mixer.conv1d.weight": "ssm_conv1d.weight", "mixer.conv1d.bias": "ssm_conv1d.bias",
         "mixer.x_proj.weight": "ssm_x.weight", "mixer.dt_proj.weight": "ssm_dt.weight",
         "mixer.dt_proj.bias": "ssm_dt.bias", "mixer.dt_bias": "ssm_dt.bias", "mixer.A_log": "ssm_a",
         "mixer.D": "ssm_d", "mixer.norm.weight": "ssm_norm.weight", "mixer.out_proj.weight": "ssm_out.weight"}
TOP = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
# LFM2 (conversion/lfm2.py): Hugging Face name -> GGUF name
LFM2_LAYER = {"operator_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
              "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
              "feed_forward.w2.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.out_proj.weight": "attn_output.weight",
              "self_attn.q_layernorm.weight": "attn_q_norm.weight",
              "self_attn.k_layernorm.weight": "attn_k_norm.weight", "conv.conv.weight": "shortconv.conv.weight",
              "conv.conv.bias": "shortconv.conv.bias", "conv.in_proj.weight": "shortconv.in_proj.weight",
              "conv.out_proj.weight": "shortconv.out_proj.weight", "conv.in_proj.bias": "shortconv.in_proj.bias",
              "conv.out_proj.bias": "shortconv.out_proj.bias"}
LFM2_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.embedding_norm.weight": "token_embd_norm.weight",
            "lm_head.weight": "output.weight"}
TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
         "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def gguf_name(name: str) -> str:
    if name in TOP or name in LFM2_TOP:
        return TOP.get(name) or LFM2_TOP[name]
    if name.startswith("model.layers."):
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        return f"blk.{i}.{LFM2_LAYER[rest]}"
    i, rest = name.removeprefix("backbone.layers.").split(".", 1)
    return f"blk.{i}.{LAYER[rest]}"


def _lfm2_metadata(w, c):
    """What conversion/lfm2.py (and TextModel's defaults) write for an LFM2 config."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t != "conv" else 0 for t in c.layer_types])
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    w.add_layer_norm_rms_eps(c.norm_eps)
    ff = c.intermediate_size                                     # LFM2Model._add_feed_forward_length
    if c.block_auto_adjust_ff_dim:
        ff = int(2 * ff / 3)
        if c.block_ffn_dim_multiplier is not None:
            ff = int(c.block_ffn_dim_multiplier * ff)
        ff = c.block_multiple_of * ((ff + c.block_multiple_of - 1) // c.block_multiple_of)
    w.add_feed_forward_length(ff)


def convert(hf, path, outtype="f32", tokenizer=None):
    """Write Hugging Face Mamba / Mamba-2 / LFM2 model ``hf`` as a GGUF file the way llama.cpp's converter does (its
    metadata, names, reshapes; 1-D tensors, norms, convolutions, A and D in F32, the rest ``outtype``, F16 where
    a row is not a multiple of the block), and return {GGUF name: the type written}."""
    c = hf.config
    mamba2 = c.model_type == "mamba2"
    arch = {"mamba2": "mamba2", "lfm2": "lfm2"}.get(c.model_type, "mamba")
    w = gguf.GGUFWriter(str(path), arch)
    if arch == "lfm2":
        _lfm2_metadata(w, c)
        return _tensors(w, hf, outtype, tokenizer)
    inner = c.num_heads * c.head_dim if mamba2 else c.intermediate_size
    w.add_context_length(2 ** 20)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(c.num_hidden_layers)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(c.state_size)
    w.add_ssm_time_step_rank(c.num_heads if mamba2 else c.time_step_rank)
    w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    if mamba2:
        w.add_ssm_group_count(c.n_groups)
    else:
        w.add_ssm_dt_b_c_rms(c.model_type == "falcon_mamba")
    return _tensors(w, hf, outtype, tokenizer)


def _tensors(w, hf, outtype, tokenizer):
    c = hf.config
    mamba2 = c.model_type == "mamba2"
    if tokenizer is not None:
        import json
        m = json.loads(tokenizer.to_str())["model"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")           # the converter's name for a GPT-2-style ByteLevel pre-tokenizer
        w.add_token_list(sorted(m["vocab"], key=m["vocab"].get))
        w.add_token_merges([" ".join(p) if isinstance(p, list) else p for p in m["merges"]])
        w.add_eos_token_id(1)
    out = {}
    sd = hf.state_dict()
    embed = sd.get("backbone.embeddings.weight", sd.get("model.embed_tokens.weight"))
    for name, t in sd.items():
        if name == "lm_head.weight" and torch.equal(t, embed):
            continue                                                   # tied: the converter leaves it out
        g = gguf_name(name)
        t = t.detach().float()
        if name.endswith("A_log"):
            t = -torch.exp(t)
        if name.endswith(("conv1d.weight", "conv.conv.weight")):
            t = t.squeeze(1)
        if mamba2 and name.endswith(("A_log", ".D")):
            t = t.reshape(-1, 1)
        if mamba2 and name.endswith("mixer.norm.weight"):
            t = t.reshape(c.n_groups, -1)
        out[g] = t
    return write_tensors(w, out, lambda g, a: gguf.GGMLQuantizationType.F32 if a.ndim <= 1 or g.endswith(
        "_norm.weight") or "conv1d" in g or "shortconv.conv" in g or not g.endswith(".weight") else TYPES[outtype])


def write_tensors(w, tensors: dict, kind_of) -> dict:
    """Quantise each of ``tensors`` (GGUF name -> float tensor) to ``kind_of(name, array)`` with gguf.quants - F16
    where a row does not fill the type's blocks, the converter's fallback -, add it to the GGUFWriter ``w`` and
    write the file. Returns {name: type written}."""
    types = {}
    for g, t in tensors.items():
        a = t.numpy()
        kind = kind_of(g, a)
        try:
            data = gguf.quants.quantize(a, kind)
        except gguf.QuantError:
            kind = gguf.GGMLQuantizationType.F16
            data = gguf.quants.quantize(a, kind)
        w.add_tensor(g, data, raw_dtype=kind)
        types[g] = kind.name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def dequantized_folder(hf, gguf_path, folder):
    """``hf`` with every tensor the GGUF file stores quantised or in F16 replaced by ``gguf.quants.dequantize`` of
    it (the reader is gguf's GGUFReader), saved to ``folder``: the reference of a quantised file's logits."""
    r = gguf.GGUFReader(str(gguf_path))
    stored = {t.name: t for t in r.tensors}
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    for name, old in sd.items():
        g = gguf_name(name)
        if g not in stored or stored[g].tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        t = stored[g]
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        sd[name] = torch.from_numpy(np.ascontiguousarray(w)).reshape(old.shape).to(old.dtype)
    if "output.weight" not in stored and "lm_head.weight" in sd:      # tied: the head is the embedding
        sd["lm_head.weight"] = sd.get("backbone.embeddings.weight", sd.get("model.embed_tokens.weight"))
    hf = type(hf)(hf.config)
    hf.load_state_dict(sd)
    hf.save_pretrained(folder)
    return folder


def assert_same_file(ours, theirs, quantised: bool, theirs_vocab_size: bool = False):
    """Two GGUF files (gguf's reader) hold the same tensors (names, shapes, types; F32 values to float32
    rounding, the quantised ones byte for byte) and the same architecture metadata keys and values (of the same
    types) but the context length, which subquad does not keep, and ours' ``vocab_size`` (save_gguf without a
    tokenizer writes it; ``theirs_vocab_size``: theirs may hold one too - Rwkv7Model's count of RWKV's
    vocabulary)."""
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(ta) == set(tb)
    for g, t in ta.items():
        u = tb[g]
        assert (t.tensor_type, list(t.shape)) == (u.tensor_type, list(u.shape)), g
        x, y = np.asarray(t.data), np.asarray(u.data)
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            assert np.allclose(x, y, rtol=0, atol=2e-6), g
        else:
            assert quantised and np.array_equal(x, y), g
    arch = a.fields["general.architecture"].contents()
    vocab = {f"{arch}.vocab_size"}
    keys = {k for k in a.fields if k.startswith(arch + ".")} - vocab
    assert keys == {k for k in b.fields if k.startswith(arch + ".")} - (vocab if theirs_vocab_size else set())
    for k in keys - {f"{arch}.context_length"}:
        va, vb = a.fields[k].contents(), b.fields[k].contents()
        assert va == vb or np.allclose(va, vb, rtol=1e-7), (k, va, vb)
        assert a.fields[k].types == b.fields[k].types, k
