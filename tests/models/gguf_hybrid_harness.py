"""GGUF files of tiny random Hugging Face Mamba-2 hybrids, written with ggml's own ``gguf`` package by llama.cpp's
converter rules (``conversion/granite.py``'s GraniteHybridModel, ``conversion/mamba.py``'s Mamba2Model,
``convert_hf_to_gguf``'s choice of types in ``conversion/base.py``) written out here, independently of
``subquad.models.gguf``; and the reference a quantised file is held to (``dequantized_folder``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.models.gguf_harness import TYPES, gguf, write_tensors

MAMBA = {"norm.weight": "ssm_norm.weight", "in_proj.weight": "ssm_in.weight", "conv1d.weight": "ssm_conv1d.weight",
         "conv1d.bias": "ssm_conv1d.bias", "dt_bias": "ssm_dt.bias", "A_log": "ssm_a", "D": "ssm_d",
         "out_proj.weight": "ssm_out.weight"}
# granitehybrid (Granite 4 and Bamba): checkpoint name inside model.layers.{i}. -> GGUF name inside blk.{i}.
GRANITE = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
           "pre_ff_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
           "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
           "self_attn.o_proj.weight": "attn_output.weight", "feed_forward.gate_proj.weight": "ffn_gate.weight",
           "feed_forward.up_proj.weight": "ffn_up.weight", "feed_forward.down_proj.weight": "ffn_down.weight",
           "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
           "block_sparse_moe.output_linear.weight": "ffn_down_exps.weight",
           **{f"mamba.{k}": v for k, v in MAMBA.items()}}
GRANITE_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "model.final_layernorm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
NEMOTRON = {"norm.weight": "attn_norm.weight", "mixer.q_proj.weight": "attn_q.weight",
            "mixer.k_proj.weight": "attn_k.weight", "mixer.v_proj.weight": "attn_v.weight",
            "mixer.o_proj.weight": "attn_output.weight", "mixer.up_proj.weight": "ffn_up.weight",
            "mixer.down_proj.weight": "ffn_down.weight", **{f"mixer.{k}": v for k, v in MAMBA.items()}}
NEMOTRON.update({"mixer.gate.weight": "ffn_gate_inp.weight",            # nemotron_h_moe's "E" layers
                 "mixer.gate.e_score_correction_bias": "exp_probs_b.bias",
                 "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
                 "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
                 "mixer.fc1_latent_proj.weight": "ffn_latent_down.weight",
                 "mixer.fc2_latent_proj.weight": "ffn_latent_up.weight"})
NEMOTRON_TOP = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
F32_ALWAYS = ("ffn_gate_inp.weight", "ssm_conv1d.weight")        # base.py: FFN_GATE_INP, SSM_CONV1D


def _permute(w, n_head):
    """LlamaModel.permute: rotate-half -> llama.cpp's adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def checkpoint(folder) -> dict:
    """The tensors of a saved folder, by their checkpoint names (what the converter reads)."""
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def granite_tensors(c, sd) -> dict:
    """{GGUF name: float32 tensor} as GraniteHybridModel.modify_tensors yields them (with Mamba2Model's reshapes)
    from config ``c`` and checkpoint ``sd``."""
    bamba = c.model_type == "bamba"
    experts = not bamba and c.num_local_experts > 0
    n_groups = c.mamba_n_groups
    tied = c.tie_word_embeddings
    out = {}
    for name, t in sd.items():
        t = t.detach().float()
        if name in GRANITE_TOP:
            if name == "lm_head.weight" and tied:
                continue
            out[GRANITE_TOP[name]] = t
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        p = f"blk.{i}."
        if rest.endswith("input_linear.weight"):               # GraniteMoeModel: gate, up = split(ffn, dim=-2)
            gate, up = t.chunk(2, dim=-2)
            kind = "exps" if rest.startswith("block_sparse_moe") else ("shexp" if experts else None)
            out[p + (f"ffn_gate_{kind}.weight" if kind else "ffn_gate.weight")] = gate
            out[p + (f"ffn_up_{kind}.weight" if kind else "ffn_up.weight")] = up
            continue
        if rest == "shared_mlp.output_linear.weight":
            out[p + ("ffn_down_shexp.weight" if experts else "ffn_down.weight")] = t
            continue
        g = GRANITE[rest]
        if rest == "self_attn.q_proj.weight":
            t = _permute(t, c.num_attention_heads)
        elif rest == "self_attn.k_proj.weight":
            t = _permute(t, c.num_key_value_heads)
        elif rest == "mamba.conv1d.weight":
            t = t.squeeze()
        elif rest in ("mamba.A_log", "mamba.D"):
            t = t.reshape(-1, 1)
        elif rest == "mamba.norm.weight":
            t = t.reshape(n_groups, -1)
        if rest == "mamba.A_log":
            t = -torch.exp(t)
        out[p + g] = t
    return out


def granite_metadata(w, c):
    """GraniteHybridModel.set_gguf_parameters (GraniteMoeModel -> GraniteModel -> LlamaModel -> TextModel, then
    the hybrid's own keys, overwriting head_count_kv and, without rotary, context_length)."""
    bamba = c.model_type == "bamba"
    n = c.num_hidden_layers
    if bamba:
        attn = set(c.attn_layer_indices)
    else:
        # the converter's get_attn_layers takes "attention" (the released configs' name); transformers 5 saves
        # "full_attention", which this converter does not recognise (it would write every layer as Mamba-2)
        attn = {i for i, t in enumerate(c.layer_types) if t in ("attention", "full_attention")}
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if not bamba:
        w.add_expert_count(c.num_local_experts)
        if c.num_local_experts:
            w.add_expert_used_count(c.num_experts_per_tok)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    for value, add in ((getattr(c, "attention_multiplier", None), w.add_attention_scale),
                       (getattr(c, "embedding_multiplier", None), w.add_embedding_scale),
                       (getattr(c, "residual_multiplier", None), w.add_residual_scale),
                       (getattr(c, "logits_scaling", None), w.add_logit_scale)):
        if value:
            add(value)
    if getattr(c, "shared_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_group_count(c.mamba_n_groups)
    w.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    w.add_ssm_time_step_rank(c.mamba_n_heads)
    w.add_head_count_kv([c.num_key_value_heads if i in attn else 0 for i in range(n)])
    w.add_rope_scaling_finetuned(bamba)
    if not bamba:
        w.add_context_length(2 ** 20)


def _kind(g: str, a: np.ndarray, outtype: str):
    """conversion/base.py: 1-D tensors, norms, the router, convolutions and non-.weight tensors in F32."""
    if a.ndim <= 1 or g.endswith("_norm.weight") or g.endswith(F32_ALWAYS) or not g.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    return TYPES[outtype]


def nemotron_tensors(c, sd) -> dict:
    """NemotronHModel.modify_tensors: attention layers as Granite's (q, k permuted), Mamba-2 layers as
    Mamba2Model's, MLP layers and the rest by gguf-py's names; with MoE each layer's experts stacked (E, ...)."""
    n_groups = c.n_groups
    out, experts = {}, {}
    for name, t in sd.items():
        t = t.detach().float()
        if name in NEMOTRON_TOP:
            out[NEMOTRON_TOP[name]] = t
            continue
        i, rest = name.removeprefix("backbone.layers.").split(".", 1)
        if rest.startswith("mixer.experts."):
            _, _, e, proj = rest.split(".", 3)
            experts.setdefault((i, proj), {})[int(e)] = t
            continue
        if rest == "mixer.q_proj.weight":
            t = _permute(t, c.num_attention_heads)
        elif rest == "mixer.k_proj.weight":
            t = _permute(t, c.num_key_value_heads)
        elif rest == "mixer.conv1d.weight":
            t = t.squeeze()
        elif rest in ("mixer.A_log", "mixer.D"):
            t = t.reshape(-1, 1)
        elif rest == "mixer.norm.weight":
            t = t.reshape(n_groups, -1)
        if rest == "mixer.A_log":
            t = -torch.exp(t)
        out[f"blk.{i}.{NEMOTRON[rest]}"] = t
    for (i, proj), parts in experts.items():             # up_proj.weight -> ffn_up_exps.weight
        out[f"blk.{i}.ffn_{proj.split('_')[0]}_exps.weight"] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def nemotron_metadata(w, c):
    """NemotronHModel.set_gguf_parameters for a released-form config (``hybrid_override_pattern`` a string, no MoE
    fields): GraniteHybridModel's keys, then key / value length and feed_forward_length per layer. (transformers
    5 saves ``layers_block_type`` with "mlp" and the MoE defaults, num_experts_per_tok among them, which this
    converter reads as a Nemotron-H MoE: it cannot convert such a folder as saved.)"""
    pattern = c.hybrid_override_pattern
    n = len(pattern)
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)   # GraniteModel popped head_dim
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.ssm_state_size)
    w.add_ssm_group_count(c.n_groups)
    w.add_ssm_inner_size(c.mamba_num_heads * c.mamba_head_dim)
    w.add_ssm_time_step_rank(c.mamba_num_heads)
    w.add_head_count_kv([c.num_key_value_heads if ch == "*" else 0 for ch in pattern])
    w.add_rope_scaling_finetuned(False)
    w.add_context_length(2 ** 20)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if "E" not in pattern:
        w.add_feed_forward_length([c.intermediate_size if ch == "-" else 0 for ch in pattern])
        return
    # is_moe (the config has num_experts_per_tok): TextModel's expert keys, then NemotronHModel's
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_feed_forward_length([c.moe_intermediate_size if ch == "E" else 0 for ch in pattern])
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.moe_latent_size is not None:
        w.add_moe_latent_size(c.moe_latent_size)


FALCON = {"input_layernorm.weight": "attn_norm.weight", "pre_ff_layernorm.weight": "ffn_norm",   # FFN_PRE_NORM
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "feed_forward.gate_proj.weight": "ffn_gate.weight", "feed_forward.up_proj.weight": "ffn_up.weight",
          "feed_forward.down_proj.weight": "ffn_down.weight", **{f"mamba.{k}": v for k, v in MAMBA.items()}}


def falcon_tensors(c, sd) -> dict:
    """FalconH1Model.modify_tensors: Mamba2Model's reshapes, then the muP multipliers folded into the weights
    (each tensor times its multiplier; in_proj's z, x, B, C, dt rows times ssm_multipliers)."""
    out = {}
    inner, GN = c.mamba_d_ssm, c.mamba_n_groups * c.mamba_d_state
    mlp, ssm = c.mlp_multipliers, c.ssm_multipliers
    for name, t in sd.items():
        t = t.detach().float().clone()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = t * c.embedding_multiplier
            continue
        if name == "lm_head.weight":
            if not c.tie_word_embeddings:
                out["output.weight"] = t * c.lm_head_multiplier
            continue
        if name == "model.final_layernorm.weight":
            out["output_norm.weight"] = t
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        if rest == "mamba.conv1d.weight":
            t = t.squeeze()
        elif rest in ("mamba.A_log", "mamba.D"):
            t = t.reshape(-1, 1)
        if rest == "mamba.A_log":
            t = -torch.exp(t)
        if "down_proj" in rest:
            t = t * mlp[1]
        elif "gate_proj" in rest:
            t = t * mlp[0]
        elif "k_proj" in rest:
            t = t * c.key_multiplier * c.attention_in_multiplier
        elif "q_proj" in rest or "v_proj" in rest:
            t = t * c.attention_in_multiplier
        elif "o_proj" in rest:
            t = t * c.attention_out_multiplier
        elif "out_proj" in rest:
            t = t * c.ssm_out_multiplier
        elif "in_proj" in rest:
            t = t * c.ssm_in_multiplier
            t[:inner] *= ssm[0]
            t[inner:2 * inner] *= ssm[1]
            t[2 * inner:2 * inner + GN] *= ssm[2]
            t[2 * inner + GN:2 * inner + 2 * GN] *= ssm[3]
            t[2 * inner + 2 * GN:] *= ssm[4]
        elif "mamba.norm" in rest:
            t = t.reshape(c.mamba_n_groups, inner // c.mamba_n_groups)
        out[f"blk.{i}.{FALCON[rest]}"] = t
    return out


def falcon_metadata(w, c):
    """Mamba2Model.set_gguf_parameters, then FalconH1Model's overrides."""
    w.add_context_length(2 ** 20)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(c.num_hidden_layers)
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_inner_size(c.mamba_d_ssm)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_time_step_rank(c.mamba_d_ssm // c.mamba_d_head)
    w.add_ssm_group_count(c.mamba_n_groups)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])


JAMBA = {"input_layernorm.weight": "attn_norm.weight", "pre_ff_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "feed_forward.gate_proj.weight": "ffn_gate.weight", "feed_forward.up_proj.weight": "ffn_up.weight",
         "feed_forward.down_proj.weight": "ffn_down.weight", "feed_forward.router.weight": "ffn_gate_inp.weight",
         "mamba.in_proj.weight": "ssm_in.weight", "mamba.conv1d.weight": "ssm_conv1d.weight",
         "mamba.conv1d.bias": "ssm_conv1d.bias", "mamba.x_proj.weight": "ssm_x.weight",
         "mamba.dt_proj.weight": "ssm_dt.weight", "mamba.dt_proj.bias": "ssm_dt.bias", "mamba.A_log": "ssm_a",
         "mamba.D": "ssm_d", "mamba.out_proj.weight": "ssm_out.weight",
         "mamba.dt_layernorm.weight": "ssm_dt_norm.weight", "mamba.b_layernorm.weight": "ssm_b_norm.weight",
         "mamba.c_layernorm.weight": "ssm_c_norm.weight"}
JAMBA_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.final_layernorm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def jamba_tensors(c, sd) -> dict:
    """JambaModel.modify_tensors: each MoE layer's experts stacked per projection (E, ...), the convolution
    squeezed, A = -exp(A_log); no permute."""
    out, experts = {}, {}
    for name, t in sd.items():
        t = t.detach().float()
        if name in JAMBA_TOP:
            out[JAMBA_TOP[name]] = t
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        if rest.startswith("feed_forward.experts."):
            _, _, e, proj = rest.split(".", 3)
            experts.setdefault((i, proj), {})[int(e)] = t
            continue
        if rest == "mamba.conv1d.weight":
            t = t.squeeze()
        if rest == "mamba.A_log":
            t = -torch.exp(t)
        out[f"blk.{i}.{JAMBA[rest]}"] = t
    for (i, proj), parts in experts.items():             # gate_proj.weight -> ffn_gate_exps.weight
        out[f"blk.{i}.ffn_{proj.split('_')[0]}_exps.weight"] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def jamba_metadata(w, c):
    """JambaModel.set_gguf_parameters (no TextModel keys, no vocab_size)."""
    n, off, per = c.num_hidden_layers, c.attn_layer_offset, c.attn_layer_period
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([0] * off + [c.num_key_value_heads if (i - off) % per == 0 else 0 for i in range(off, n)])
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_time_step_rank(c.mamba_dt_rank)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)


ARCH = {"granitemoehybrid": ("granitehybrid", granite_metadata, lambda c, sd: granite_tensors(c, sd)),
        "bamba": ("granitehybrid", granite_metadata, lambda c, sd: granite_tensors(c, sd)),
        "nemotron_h": ("nemotron_h", nemotron_metadata, lambda c, sd: nemotron_tensors(c, sd)),
        "falcon_h1": ("falcon-h1", falcon_metadata, lambda c, sd: falcon_tensors(c, sd)),
        "jamba": ("jamba", jamba_metadata, lambda c, sd: jamba_tensors(c, sd))}


def arch_name(c) -> str:
    """The GGUF architecture the converter writes for config ``c`` (nemotron_h with "E" layers: nemotron_h_moe)."""
    if c.model_type == "nemotron_h" and "E" in c.hybrid_override_pattern:
        return "nemotron_h_moe"
    return ARCH[c.model_type][0]


def convert(hf, folder, path, outtype="f32", after=None, drop=()) -> dict:
    """Write the model ``hf`` saved in ``folder`` (granitemoehybrid, bamba, nemotron_h or falcon_h1) as llama.cpp's
    converter does; {GGUF name: type written}. ``after(writer)``: a metadata change made after the converter's
    (the refusal tests' wrong fields); ``drop``: GGUF tensors left out (their missing ones)."""
    import logging

    c = hf.config
    _, metadata, tensors = ARCH[c.model_type]
    w = gguf.GGUFWriter(str(path), arch_name(c))
    level = logging.getLogger("gguf.gguf_writer").level
    logging.getLogger("gguf.gguf_writer").setLevel(logging.ERROR)   # the converter's expected duplicate keys
    try:
        metadata(w, c)
        if after is not None:
            after(w)
    finally:
        logging.getLogger("gguf.gguf_writer").setLevel(level)
    out = {g: t for g, t in tensors(c, checkpoint(folder)).items() if g not in drop}
    return write_tensors(w, out, lambda g, a: _kind(g, a, outtype))


def dequantized_folder(hf, src, gguf_path, folder):
    """The checkpoint in ``src`` with each tensor the file stores quantised or in F16 replaced by gguf's
    dequantisation of it (the converter's reshapes undone), saved to ``folder``: the reference of a quantised
    file's logits."""
    import shutil

    from safetensors.torch import save_file

    r = gguf.GGUFReader(str(gguf_path))
    stored = {t.name: t for t in r.tensors}
    c = hf.config
    written = ARCH[c.model_type][2](c, checkpoint(src))
    deq = {}
    for g, t in stored.items():
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            deq[g] = torch.from_numpy(np.ascontiguousarray(a)).reshape(written[g].shape)
    sd = checkpoint(src)
    if c.model_type == "falcon_h1":
        return _falcon_folder(c, r, written, deq, Path(src), Path(folder))
    if c.model_type == "jamba":
        inverse = {v: k for k, v in JAMBA.items()}
        for g, t in deq.items():
            if g in ("token_embd.weight", "output.weight"):
                sd[{v: k for k, v in JAMBA_TOP.items()}[g]] = t
                continue
            _, i, rest = g.split(".", 2)
            if rest.endswith("_exps.weight"):              # ffn_gate_exps.weight -> experts.{e}.gate_proj.weight
                proj = rest.removeprefix("ffn_").split("_")[0] + "_proj.weight"
                for e, part in enumerate(t.unbind(0)):
                    sd[f"model.layers.{i}.feed_forward.experts.{e}.{proj}"] = part.contiguous()
            else:
                sd[f"model.layers.{i}.{inverse[rest]}"] = t.reshape(sd[f"model.layers.{i}.{inverse[rest]}"].shape)
        names = ()
    elif c.model_type == "nemotron_h":                              # one GGUF tensor per checkpoint tensor
        for name in sd:
            top = name in NEMOTRON_TOP
            i, rest = ("", name) if top else name.removeprefix("backbone.layers.").split(".", 1)
            if rest.startswith("mixer.experts."):                  # a slice of the stacked experts
                _, _, e, proj = rest.split(".", 3)
                g = f"blk.{i}.ffn_{proj.split('_')[0]}_exps.weight"
                if g in deq:
                    sd[name] = deq[g][int(e)].contiguous()
                continue
            g = NEMOTRON_TOP[name] if top else f"blk.{i}.{NEMOTRON[rest]}"
            if g in deq:
                t = deq[g]
                if rest == "mixer.q_proj.weight":
                    t = _unpermute(t, c.num_attention_heads)
                elif rest == "mixer.k_proj.weight":
                    t = _unpermute(t, c.num_key_value_heads)
                sd[name] = t.reshape(sd[name].shape).to(sd[name].dtype)
        names = ()
    else:
        names = list(sd)
    for name in names:
        if name in GRANITE_TOP:
            g = GRANITE_TOP[name] if not (name == "lm_head.weight" and c.tie_word_embeddings) else "token_embd.weight"
            if g in deq:
                sd[name] = deq[g].to(sd[name].dtype)
            continue
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        p = f"blk.{i}."
        if rest.endswith("input_linear.weight"):
            gs = [g for g in deq if g.startswith(p) and (("exps" in g) == rest.startswith("block_sparse_moe"))
                  and g.split(".")[-2].startswith(("ffn_gate", "ffn_up")) and "inp" not in g]
            gate = next((g for g in gs if ".ffn_gate" in g), None)
            up = next((g for g in gs if ".ffn_up" in g), None)
            if gate and up:
                sd[name] = torch.cat([deq[gate], deq[up]], dim=-2)
            continue
        g = GRANITE.get(rest)
        if rest == "shared_mlp.output_linear.weight":
            g = next(x.removeprefix(p) for x in written if x.startswith(p + "ffn_down") and "exps" not in x)
        if p + g not in deq:
            continue
        t = deq[p + g]
        if rest == "self_attn.q_proj.weight":
            t = _unpermute(t, c.num_attention_heads)
        elif rest == "self_attn.k_proj.weight":
            t = _unpermute(t, c.num_key_value_heads)
        sd[name] = t.reshape(sd[name].shape).to(sd[name].dtype)
    Path(folder).mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(src) / "config.json", Path(folder) / "config.json")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(Path(folder) / "model.safetensors"))
    return folder


def _unpermute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _falcon_folder(c, r, written, deq, src, folder):
    """Falcon-H1's reference: the file's tensors (the multipliers already folded in; dequantised where stored
    quantised) as a checkpoint whose config has multipliers of 1."""
    import json

    from safetensors.torch import save_file

    inverse = {v: k for k, v in FALCON.items()}
    sd = {}
    for g, t in written.items():
        t = deq.get(g, t)
        if g in ("token_embd.weight", "output.weight", "output_norm.weight"):
            name = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                    "output_norm.weight": "model.final_layernorm.weight"}[g]
        else:
            _, i, rest = g.split(".", 2)
            name = f"model.layers.{i}.{inverse[rest]}"
            if rest == "ssm_conv1d.weight":
                t = t.unsqueeze(1)
            elif rest == "ssm_a":
                t = torch.log(-t).reshape(-1)
            elif rest in ("ssm_d", "ssm_norm.weight"):
                t = t.reshape(-1)
        sd[name] = t.contiguous()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update({k: 1.0 for k in ("embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier",
                                 "attention_out_multiplier", "key_multiplier", "ssm_in_multiplier",
                                 "ssm_out_multiplier")}, ssm_multipliers=[1.0] * 5, mlp_multipliers=[1.0] * 2)
    if c.tie_word_embeddings:                       # llama.cpp's reading: the head is the file's embedding
        cfg["tie_word_embeddings"] = True
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(folder / "model.safetensors"))
    return folder
