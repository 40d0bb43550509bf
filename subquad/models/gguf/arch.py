"""llama.cpp's GGUF names and metadata, per architecture, against the Hugging Face checkpoints ``models.hf``
reads - as llama.cpp's converter (``convert_hf_to_gguf.py``, ``conversion/mamba.py``, gguf-py's
``tensor_mapping.py`` in gguf 0.19.0) writes them. One table per architecture:

    top / layer     GGUF name -> Hugging Face name (``layer``: inside ``blk.{i}.``, the checkpoint's ``{i}``)
    to_hf / to_gguf the converter's reshapes, undone / redone: Mamba's ``A_log`` is written as A = -exp(A_log),
                    the (C, 1, k) convolutions squeezed to (C, k); Mamba-2's A and D as (H, 1), its gated
                    norm's weight grouped as (n_groups, d_inner / n_groups)
    config / meta   the GGUF metadata -> a Hugging Face config.json (which ``models.hf``'s format translates
                    and checks), and back

Architectures: ``mamba`` (Mamba, Falcon-Mamba), ``mamba2``, ``lfm2`` (conversion/lfm2.py); ``qwen3next``,
``qwen35``, ``qwen35moe`` in ``qwen.py``; ``lfm2moe``, ``rwkv7``, ``kimi-linear`` in ``more.py``; the Mamba-2
hybrids ``granitehybrid``, ``nemotron_h``, ``nemotron_h_moe``, ``falcon-h1`` and ``jamba`` in ``hybrid.py``;
``minimax-01`` in ``minimax.py`` (whose ``attn_output`` is a lightning layer's out_proj or attention's o_proj: an
architecture may name tensors by the config, ``hf_name_for(g, c)``, which the loader prefers).

``registry.ARCHS`` lists them by ``general.architecture``; an architecture not there is refused by name.
"""

from __future__ import annotations

from typing import ClassVar

import torch

MAMBA_TOP = {"token_embd.weight": "backbone.embeddings.weight", "output_norm.weight": "backbone.norm_f.weight",
             "output.weight": "lm_head.weight"}
MAMBA_LAYER = {"attn_norm.weight": "norm.weight", "ssm_in.weight": "mixer.in_proj.weight",
               "ssm_conv1d.weight": "mixer.conv1d.weight", "ssm_conv1d.bias": "mixer.conv1d.bias",
               "ssm_x.weight": "mixer.x_proj.weight", "ssm_dt.weight": "mixer.dt_proj.weight",
               "ssm_dt.bias": "mixer.dt_proj.bias", "ssm_a": "mixer.A_log", "ssm_d": "mixer.D",
               "ssm_out.weight": "mixer.out_proj.weight"}


# the llama-style names most Hugging Face decoders share: the model's ends, and attention's four projections
LLAMA_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
SELF_ATTN = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
             "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight"}


class U64(list):
    """A metadata array of ints written as uint64 (``writer``; qwen4exp's PLE hash constants reach ~2^45)."""


def _get(meta: dict, arch: str, key: str, default=None):
    v = meta.get(f"{arch}.{key}", default)
    if v is None:
        raise ValueError(f"GGUF metadata has no {arch}.{key} (needed for architecture {arch!r})")
    return v


class MambaArch:
    """``mamba`` (Mamba and Falcon-Mamba: ``ssm.dt_b_c_rms`` true is Falcon-Mamba's norms on dt, B and C)."""
    arch = "mamba"
    top, layer, hf_layer = MAMBA_TOP, MAMBA_LAYER, "backbone.layers.{i}."

    @staticmethod
    def to_hf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if name.endswith("A_log"):
            return torch.log(-t)                                       # A = -exp(A_log)
        if name.endswith("conv1d.weight"):
            return t.unsqueeze(1)                                      # (C, k) -> (C, 1, k)
        return t

    @staticmethod
    def to_gguf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if name.endswith("A_log"):
            return -torch.exp(t)
        if name.endswith("conv1d.weight"):
            return t.squeeze(1)
        return t

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        d, inner = _get(meta, a, "embedding_length"), _get(meta, a, "ssm.inner_size")
        falcon = bool(meta.get(f"{a}.ssm.dt_b_c_rms", False))
        eps = _get(meta, a, "attention.layer_norm_rms_epsilon", 1e-5)
        c = {"model_type": "falcon_mamba" if falcon else "mamba", "hidden_size": d, "expand": inner // d,
             "intermediate_size": inner, "num_hidden_layers": _get(meta, a, "block_count"),
             "state_size": _get(meta, a, "ssm.state_size"), "conv_kernel": _get(meta, a, "ssm.conv_kernel"),
             "time_step_rank": _get(meta, a, "ssm.time_step_rank"), "layer_norm_epsilon": eps,
             "use_bias": False, "hidden_act": "silu",
             "use_conv_bias": "blk.0.ssm_conv1d.bias" in tensors,
             "tie_word_embeddings": "output.weight" not in tensors}
        if falcon:
            c["mixer_rms_eps"] = eps                        # llama.cpp norms dt, B and C with the model's epsilon
        return c

    @classmethod
    def meta(cls, c: dict) -> dict:
        """The metadata llama.cpp's converter writes for the Hugging Face config ``c`` (the values it reads)."""
        inner = c.get("intermediate_size", c.get("expand", 2) * c["hidden_size"])
        return {"context_length": 1 << 20, "embedding_length": c["hidden_size"], "feed_forward_length": 0,
                "attention.head_count": 0, "block_count": c["num_hidden_layers"], "ssm.conv_kernel": c["conv_kernel"],
                "ssm.inner_size": inner, "ssm.state_size": c["state_size"],
                "ssm.time_step_rank": c["time_step_rank"], "attention.layer_norm_rms_epsilon": c["layer_norm_epsilon"],
                "ssm.dt_b_c_rms": c["model_type"] == "falcon_mamba"}


class Mamba2Arch(MambaArch):
    """``mamba2``: A and D as (H, 1), the gated norm's weight as (n_groups, d_inner / n_groups), dt's bias as
    ``ssm_dt.bias`` (no dt_proj matrix, no x_proj)."""
    arch = "mamba2"
    layer: ClassVar[dict] = {**{k: v for k, v in MAMBA_LAYER.items() if k not in ("ssm_x.weight", "ssm_dt.weight")},
                             "ssm_dt.bias": "mixer.dt_bias", "ssm_norm.weight": "mixer.norm.weight"}

    @staticmethod
    def to_hf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if name.endswith(("A_log", "mixer.D", "norm.weight")) and "mixer." in name:
            t = t.reshape(-1)                                          # (H, 1), (G, d_inner / G) -> flat
        return MambaArch.to_hf(name, t, c)

    @staticmethod
    def to_gguf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        t = MambaArch.to_gguf(name, t, c)
        if name.endswith(("A_log", "mixer.D")):
            return t.reshape(-1, 1)
        if name.endswith("mixer.norm.weight"):
            return t.reshape(c.get("n_groups", 1), -1)
        return t

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        d, inner = _get(meta, a, "embedding_length"), _get(meta, a, "ssm.inner_size")
        heads = _get(meta, a, "ssm.time_step_rank")
        return {"model_type": "mamba2", "hidden_size": d, "expand": inner // d, "num_heads": heads,
                "head_dim": inner // heads, "n_groups": _get(meta, a, "ssm.group_count", 1),
                "num_hidden_layers": _get(meta, a, "block_count"), "state_size": _get(meta, a, "ssm.state_size"),
                "conv_kernel": _get(meta, a, "ssm.conv_kernel"),
                "layer_norm_epsilon": _get(meta, a, "attention.layer_norm_rms_epsilon", 1e-5),
                "use_bias": False, "hidden_act": "silu", "rms_norm": True, "norm_before_gate": False,
                "use_conv_bias": "blk.0.ssm_conv1d.bias" in tensors,
                "tie_word_embeddings": "output.weight" not in tensors}

    @classmethod
    def meta(cls, c: dict) -> dict:
        inner = c["num_heads"] * c["head_dim"]
        return {"context_length": 1 << 20, "embedding_length": c["hidden_size"], "feed_forward_length": 0,
                "attention.head_count": 0, "block_count": c["num_hidden_layers"], "ssm.conv_kernel": c["conv_kernel"],
                "ssm.inner_size": inner, "ssm.state_size": c["state_size"], "ssm.time_step_rank": c["num_heads"],
                "ssm.group_count": c["n_groups"], "attention.layer_norm_rms_epsilon": c["layer_norm_epsilon"]}


class Lfm2Arch:
    """``lfm2`` (conversion/lfm2.py): gated short convolutions (``shortconv.*``, the (C, 1, k) kernel squeezed)
    and attention layers - which is which read off ``attention.head_count_kv``, 0 for a convolution layer -,
    SwiGLU MLPs of the width ``feed_forward_length`` holds (the released configs' adjustment applied), the
    final norm as ``token_embd_norm``. No reshapes of q and k: llama.cpp rotates LFM2 in halves (NeoX), as
    transformers does."""
    arch = "lfm2"
    hf_layer = "model.layers.{i}."
    top: ClassVar[dict] = {"token_embd.weight": "model.embed_tokens.weight",
                           "token_embd_norm.weight": "model.embedding_norm.weight", "output.weight": "lm_head.weight"}
    layer: ClassVar[dict] = {
        "attn_norm.weight": "operator_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
        "ffn_gate.weight": "feed_forward.w1.weight", "ffn_up.weight": "feed_forward.w3.weight",
        "ffn_down.weight": "feed_forward.w2.weight", "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.out_proj.weight", "attn_q_norm.weight": "self_attn.q_layernorm.weight",
        "attn_k_norm.weight": "self_attn.k_layernorm.weight", "shortconv.conv.weight": "conv.conv.weight",
        "shortconv.conv.bias": "conv.conv.bias", "shortconv.in_proj.weight": "conv.in_proj.weight",
        "shortconv.out_proj.weight": "conv.out_proj.weight", "shortconv.in_proj.bias": "conv.in_proj.bias",
        "shortconv.out_proj.bias": "conv.out_proj.bias"}

    @staticmethod
    def to_hf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        return t.unsqueeze(1) if name.endswith("conv.conv.weight") else t

    @staticmethod
    def to_gguf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        return t.squeeze(1) if name.endswith("conv.conv.weight") else t

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        n = _get(meta, a, "block_count")
        kv = _get(meta, a, "attention.head_count_kv")
        kv = kv if isinstance(kv, list) else [kv] * n
        if len(kv) != n or len({k for k in kv if k}) > 1:
            raise ValueError(f"GGUF metadata {a}.attention.head_count_kv={kv} must give each of the {n} layers 0 "
                             f"(a convolution) or one common count")
        types = ["conv" if k == 0 else "full_attention" for k in kv]
        conv = next((i for i, t in enumerate(types) if t == "conv"), 0)
        return {"model_type": "lfm2", "hidden_size": _get(meta, a, "embedding_length"), "num_hidden_layers": n,
                "num_attention_heads": _get(meta, a, "attention.head_count"),
                "num_key_value_heads": max(kv) or _get(meta, a, "attention.head_count"), "layer_types": types,
                "intermediate_size": _get(meta, a, "feed_forward_length"), "block_auto_adjust_ff_dim": False,
                "norm_eps": _get(meta, a, "attention.layer_norm_rms_epsilon", 1e-5),
                "conv_L_cache": _get(meta, a, "shortconv.l_cache"),
                "conv_bias": f"blk.{conv}.shortconv.conv.bias" in tensors,
                "tie_word_embeddings": "output.weight" not in tensors,
                "rope_parameters": {"rope_type": "default", "rope_theta": float(_get(meta, a, "rope.freq_base", 1e6))}}

    @classmethod
    def meta(cls, c: dict) -> dict:
        kv = c.get("num_key_value_heads") or c["num_attention_heads"]
        return {"context_length": c.get("max_position_embeddings", 128000), "embedding_length": c["hidden_size"],
                "feed_forward_length": c["intermediate_size"], "attention.head_count": c["num_attention_heads"],
                "attention.head_count_kv": [kv if t == "full_attention" else 0 for t in c["layer_types"]],
                "block_count": c["num_hidden_layers"], "rope.freq_base": float(c["rope_parameters"]["rope_theta"]),
                "attention.layer_norm_rms_epsilon": float(c["norm_eps"]), "shortconv.l_cache": c["conv_L_cache"]}


def hf_name(arch, name: str) -> str:
    """The Hugging Face name of GGUF tensor ``name``; ValueError naming it when the table has none."""
    if name in arch.top:
        return arch.top[name]
    if name.startswith("blk."):
        i, _, rest = name[4:].partition(".")
        if i.isdigit() and rest in arch.layer:
            return arch.hf_layer.format(i=i) + arch.layer[rest]
    raise ValueError(f"GGUF tensor {name!r} is not a tensor of architecture {arch.arch!r} that subquad maps")


def gguf_name(arch, name: str) -> str:
    """``hf_name``'s inverse."""
    for g, h in arch.top.items():
        if h == name:
            return g
    prefix = arch.hf_layer.split("{i}")[0]
    if name.startswith(prefix):
        i, _, rest = name[len(prefix):].partition(".")
        for g, h in arch.layer.items():
            if h == rest:
                return f"blk.{i}.{g}"
    raise ValueError(f"{arch.arch}: no GGUF name for the checkpoint tensor {name!r}")
