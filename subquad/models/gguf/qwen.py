"""llama.cpp's ``qwen3next``, ``qwen35`` and ``qwen35moe`` against the Hugging Face checkpoints ``models.hf`` reads
(``hf/qwen3_next.py``, ``hf/qwen3_5.py``), as llama.cpp's converter writes them (``conversion/qwen.py``:
Qwen3NextModel, _LinearAttentionVReorderBase, Qwen3_5TextModel, Qwen3_5MoeTextModel; gguf-py's
``tensor_mapping.py``; the loaders ``src/models/qwen3next.cpp``, ``qwen35.cpp``, ``qwen35moe.cpp``). The tables
follow ``arch.py``'s (``top`` / ``layer`` GGUF name -> Hugging Face name, ``to_hf`` / ``to_gguf``, ``config`` /
``meta``); two more hooks carry what is not one tensor to one tensor: ``regroup`` (the GGUF side's tensors,
renamed and reshaped, -> the checkpoint's) and ``split`` (its inverse, before ``save_gguf`` names them).

The converter's rewrites, each undone by ``to_hf`` / ``regroup`` and redone by ``to_gguf`` / ``split``:

    norms            every ``*norm.weight`` but the Gated DeltaNet's gated norm (``linear_attn.norm``) is zero-centred
                     in the checkpoint (x (1 + w)) and written as 1 + w (llama.cpp multiplies by w)
    A_log            written as A = -exp(A_log) (``ssm_a``); dt_bias as ``ssm_dt.bias``
    conv1d           (C, 1, k) squeezed to (C, k)
    experts          one (I, d) / (d, I) matrix per expert stacked to (E, I, d) / (E, d, I): ``ffn_{gate,up,down}_exps``
    qwen3next        ``in_proj_qkvz`` (per key head [q (K), k (K), v (r V), z (r V)], r = H / Hk value heads a key
                     head) regrouped by part: ``attn_qkv`` = [q of every head, k ..., v ...] and ``attn_gate`` = z
                     (older converters wrote it as it is, ``ssm_in``: read too); ``in_proj_ba`` written as it is
                     (``ssm_ba``)
    qwen35, qwen35moe  with fewer key heads than value heads (Hk < H) the value heads, grouped by key head in the
                     checkpoint (v_{k,j}: key head k's j-th), are written tiled (v_{0,0}, v_{1,0}, ..., v_{0,1}, ...)
                     wherever they index a dimension: the v rows of ``in_proj_qkv`` and the v channels of conv1d,
                     the rows of ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, A_log and dt_bias, the columns of
                     ``out_proj``
    MTP              the multi-token-prediction layer (``mtp.*``) is written as the layer after the decoder layers,
                     ``blk.{n}`` (n = num_hidden_layers; ``nextn_predict_layers`` 1), its own tensors as
                     ``nextn.eh_proj`` (fc), ``nextn.enorm`` / ``nextn.hnorm`` (pre_fc_norm_embedding / _hidden)
                     and ``nextn.shared_head_norm`` (norm); it loads as ``model.mtp`` (``models.mtp``)

A Qwen3.5 file loads as the multimodal type's language model (``qwen3_5`` / ``qwen3_5_moe``: the types whose MTP
head subquad loads; nothing of the vision tower is in the file), a Qwen3-Next file as ``qwen3_next``.

What llama.cpp's loaders cannot hold is refused by name on writing: a ``qwen3next`` model without experts in
every layer (its loader creates ``ffn_gate_inp`` in each; no dense ``ffn_gate``), or with ``norm_topk_prob``
false (it renormalises the top-k always). llama.cpp also takes the value head width from ``ssm.state_size``
(the key head width): a file with K != V (``ssm.inner_size`` != ``ssm.time_step_rank`` x ``ssm.state_size``)
loads here - the converter writes it so - and not in llama.cpp.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch

from subquad.models.gguf.arch import LLAMA_TOP, SELF_ATTN


def _get(meta: dict, arch: str, key: str, default=None):
    v = meta.get(f"{arch}.{key}", default)
    if v is None:
        raise ValueError(f"GGUF metadata has no {arch}.{key} (needed for architecture {arch!r})")
    return v


TOP = LLAMA_TOP
ATTENTION = {"attn_norm.weight": "input_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             **SELF_ATTN,
             "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
DELTANET = {"attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
            "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_dt.bias": "linear_attn.dt_bias",
            "ssm_a": "linear_attn.A_log", "ssm_norm.weight": "linear_attn.norm.weight",
            "ssm_out.weight": "linear_attn.out_proj.weight"}
# the stacked experts keep no ".weight": ``regroup`` splits them into the checkpoint's one tensor per expert
MOE = {"ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_exps.weight": "mlp.experts.gate_proj",
       "ffn_up_exps.weight": "mlp.experts.up_proj", "ffn_down_exps.weight": "mlp.experts.down_proj",
       "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
       "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
       "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
       "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
DENSE = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
         "ffn_down.weight": "mlp.down_proj.weight"}
# the MTP layer's own tensors, in layer n; ``regroup`` moves "model.layers.{n}.mtp.*" to "mtp.*"
NEXTN = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
         "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight"}
EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _centred(name: str) -> bool:
    """A zero-centred norm the converter writes as 1 + w: every norm but the Gated DeltaNet's gated one (the
    converter tests the GGUF-side name, "*norm.weight": the MTP head's pre-fc norms are ``enorm`` / ``hnorm``)."""
    return (name.endswith(("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"))
            and not name.endswith("linear_attn.norm.weight"))


class Qwen3NextArch:
    """``qwen3next`` (module doc): Gated DeltaNet and gated attention layers, experts with a gated shared expert in
    every layer; ``in_proj_qkvz`` as ``attn_qkv`` + ``attn_gate``, ``in_proj_ba`` as ``ssm_ba``."""
    arch = "qwen3next"
    model_type = "qwen3_next"
    prefix = "model."                     # where the checkpoint's language model is
    hf_layer = "model.layers.{i}."
    top: ClassVar[dict] = TOP
    # ssm_in: the legacy files' in_proj_qkvz as the checkpoint holds it (llama.cpp still reads them; never written)
    layer: ClassVar[dict] = {**ATTENTION, **DELTANET, **MOE, **NEXTN, "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
                             "ssm_in.weight": "linear_attn.in_proj_qkvz.weight"}

    # ------------------------------------------------------------------ config
    @staticmethod
    def text(c: dict) -> dict:
        """The language model's config (the multimodal types nest it in text_config)."""
        return c.get("text_config", c)

    @classmethod
    def _common(cls, meta: dict, tensors: dict) -> dict:
        """The fields all three architectures write alike (Qwen2MoeModel / TextModel / Qwen3NextModel)."""
        a = cls.arch
        n_all = _get(meta, a, "block_count")
        nextn = meta.get(f"{a}.nextn_predict_layers", 0)
        n = n_all - nextn
        if nextn not in (0, 1):
            raise ValueError(f"GGUF metadata {a}.nextn_predict_layers={nextn}: subquad loads an MTP head of one "
                             f"layer (every released checkpoint's)")
        recurrent = meta.get(f"{a}.attention.recurrent_layers")
        if recurrent is None:                 # llama.cpp's default: full attention every interval-th layer
            every = meta.get(f"{a}.full_attention_interval", 4)
            recurrent = [i < n and (i + 1) % every != 0 for i in range(n_all)]
        if len(recurrent) != n_all or any(recurrent[n:]):
            raise ValueError(f"GGUF metadata {a}.attention.recurrent_layers={list(recurrent)} must give each of the "
                             f"{n_all} blocks (the MTP layer: not recurrent) true or false")
        heads = _get(meta, a, "attention.head_count")
        d = _get(meta, a, "embedding_length")
        head_dim = meta.get(f"{a}.attention.key_length", d // heads)
        if meta.get(f"{a}.attention.value_length", head_dim) != head_dim:
            raise ValueError(f"GGUF metadata {a}.attention.value_length={meta[f'{a}.attention.value_length']} "
                             f"differs from {a}.attention.key_length={head_dim}: the checkpoint has one head_dim")
        rot = _get(meta, a, "rope.dimension_count")
        if not 0 < rot <= head_dim or rot % 2:
            raise ValueError(f"GGUF metadata {a}.rope.dimension_count={rot} must be even and in (0, {head_dim}]")
        H, inner = _get(meta, a, "ssm.time_step_rank"), _get(meta, a, "ssm.inner_size")
        Hk = _get(meta, a, "ssm.group_count")
        if inner % H or H % Hk:
            raise ValueError(f"GGUF metadata {a}.ssm.inner_size={inner}, {a}.ssm.time_step_rank={H} and "
                             f"{a}.ssm.group_count={Hk}: the value heads must divide the inner size and the key "
                             f"heads the value heads")
        c = {"hidden_size": d, "num_hidden_layers": n, "intermediate_size": meta.get(f"{a}.feed_forward_length"),
             "num_attention_heads": heads, "num_key_value_heads": _get(meta, a, "attention.head_count_kv"),
             "head_dim": head_dim,
             "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n]],
             "rms_norm_eps": float(_get(meta, a, "attention.layer_norm_rms_epsilon")), "hidden_act": "silu",
             "attention_bias": False, "tie_word_embeddings": "output.weight" not in tensors,
             "rope_parameters": {"rope_type": "default", "rope_theta": float(_get(meta, a, "rope.freq_base")),
                                 "partial_rotary_factor": rot / head_dim},
             "linear_conv_kernel_dim": _get(meta, a, "ssm.conv_kernel"),
             "linear_key_head_dim": _get(meta, a, "ssm.state_size"),
             "linear_value_head_dim": inner // H, "linear_num_key_heads": Hk, "linear_num_value_heads": H,
             "vocab_size": tensors["token_embd.weight"].shape[0] if "token_embd.weight" in tensors else None}
        if nextn:
            c["mtp_num_hidden_layers"] = nextn
        return c

    @classmethod
    def _experts(cls, meta: dict) -> dict:
        a = cls.arch
        return {"num_experts": _get(meta, a, "expert_count"), "num_experts_per_tok": _get(meta, a, "expert_used_count"),
                "moe_intermediate_size": _get(meta, a, "expert_feed_forward_length"),
                "shared_expert_intermediate_size": _get(meta, a, "expert_shared_feed_forward_length")}

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        c = cls._common(meta, tensors)
        if not _get(meta, cls.arch, "expert_count"):
            raise ValueError(f"GGUF metadata {cls.arch}.expert_count=0: llama.cpp's qwen3next has experts in every "
                             f"layer")
        e = cls._experts(meta)
        c["intermediate_size"] = c["intermediate_size"] or e["moe_intermediate_size"]    # unused: every layer MoE
        return {"model_type": cls.model_type, **c, **e, "decoder_sparse_step": 1,
                "norm_topk_prob": True, "mlp_only_layers": []}

    @classmethod
    def meta(cls, c: dict) -> dict:
        """What the converter writes for the Hugging Face config ``c`` (the language model's)."""
        c = cls.text(c)
        n, nextn = c["num_hidden_layers"], c.get("mtp_num_hidden_layers", 0)
        rope = c.get("rope_parameters") or {}
        m = {"block_count": n + nextn, "context_length": c.get("max_position_embeddings", 262144),
             "embedding_length": c["hidden_size"],
             "attention.head_count": c["num_attention_heads"], "attention.head_count_kv": c["num_key_value_heads"],
             "rope.freq_base": float(rope.get("rope_theta", 10000.0)),
             "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
             "attention.key_length": c["head_dim"], "attention.value_length": c["head_dim"],
             "ssm.conv_kernel": c["linear_conv_kernel_dim"], "ssm.state_size": c["linear_key_head_dim"],
             "ssm.group_count": c["linear_num_key_heads"], "ssm.time_step_rank": c["linear_num_value_heads"],
             "ssm.inner_size": c["linear_value_head_dim"] * c["linear_num_value_heads"],
             "attention.recurrent_layers": [t == "linear_attention" for t in c["layer_types"]] + [False] * nextn,
             "full_attention_interval": c.get("full_attention_interval", 4),
             "rope.dimension_count": int(c["head_dim"] * rope.get("partial_rotary_factor", 0.25))}
        if c.get("num_experts"):
            m.update({"expert_count": c["num_experts"], "expert_used_count": c["num_experts_per_tok"],
                      "expert_feed_forward_length": c["moe_intermediate_size"],
                      "expert_shared_feed_forward_length": c["shared_expert_intermediate_size"]})
        if c.get("intermediate_size") is not None:       # TextModel writes it when the config has it
            m["feed_forward_length"] = c["intermediate_size"]
        if nextn:
            m["nextn_predict_layers"] = nextn
        cls.check(c)
        return m

    @classmethod
    def check(cls, c: dict) -> None:
        """Refuse, by field, a model llama.cpp's loader for this architecture cannot hold."""
        if not c.get("num_experts") or c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers"):
            raise ValueError(f"{cls.arch}: llama.cpp's qwen3next has experts in every layer; this model has "
                             f"num_experts={c.get('num_experts')}, decoder_sparse_step={c.get('decoder_sparse_step')}")
        if not c.get("norm_topk_prob", True):
            raise ValueError(f"{cls.arch}: llama.cpp's qwen3next renormalises the top-k expert weights; this model "
                             f"has norm_topk_prob=False")

    # ------------------------------------------------------------------ tensors
    @staticmethod
    def _tiled(c: dict):
        """None, or (key heads, value heads a key head) where the converter tiles the value heads (qwen35)."""
        return None

    @classmethod
    def to_hf(cls, name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        """One tensor as the checkpoint holds it (``t`` returned itself when unchanged)."""
        if name.endswith("A_log"):
            t = torch.log(-t)
        elif name.endswith("conv1d.weight"):
            t = t.unsqueeze(1)
        elif _centred(name):
            t = t - 1
        tiled = cls._tiled(c)
        return t if tiled is None else _untile(name, t, cls.text(c), tiled, inverse=True)

    @classmethod
    def to_gguf(cls, name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        tiled = cls._tiled(c)
        t = t if tiled is None else _untile(name, t, cls.text(c), tiled, inverse=False)
        if name.endswith("A_log"):
            return -torch.exp(t)
        if name.endswith("conv1d.weight"):
            return t.squeeze(1)
        if _centred(name):
            return t + 1
        return t

    @classmethod
    def _qkvz(cls, tensors: dict, c: dict, merge: bool) -> dict:
        """qwen3next: [attn_qkv; attn_gate] (by part) <-> in_proj_qkvz (per key head)."""
        t_ = cls.text(c)
        Hk, H = t_["linear_num_key_heads"], t_["linear_num_value_heads"]
        K, V = t_["linear_key_head_dim"], t_["linear_value_head_dim"]
        rV = H // Hk * V
        out = {}
        for name, t in tensors.items():
            if merge and name.endswith("linear_attn.in_proj_qkv.weight"):
                p = name.removesuffix("in_proj_qkv.weight")
                z = tensors.get(p + "in_proj_z.weight")
                if z is None:                 # half a pair (load's probe of the quantised ones): not kept as is
                    continue
                d = t.shape[-1]
                q, k, v = t.split([Hk * K, Hk * K, H * V])
                parts = [x.reshape(Hk, -1, d) for x in (q, k, v, z)]
                out[p + "in_proj_qkvz.weight"] = torch.cat(parts, 1).reshape(-1, d)
            elif merge and name.endswith("linear_attn.in_proj_z.weight"):
                continue
            elif not merge and name.endswith("linear_attn.in_proj_qkvz.weight"):
                p = name.removesuffix("in_proj_qkvz.weight")
                d = t.shape[-1]
                q, k, v, z = t.reshape(Hk, -1, d).split([K, K, rV, rV], dim=1)
                out[p + "in_proj_qkv.weight"] = torch.cat([x.reshape(-1, d) for x in (q, k, v)])
                out[p + "in_proj_z.weight"] = z.reshape(-1, d)
            else:
                out[name] = t
        return out

    @classmethod
    def regroup(cls, tensors: dict, c: dict) -> dict:
        """The GGUF side's tensors (renamed by the tables, reshaped by ``to_hf``) -> the checkpoint's: the fused
        projections, one tensor per expert, the MTP layer under "mtp."."""
        tensors = cls._qkvz(tensors, c, merge=True) if cls.arch == "qwen3next" else tensors
        n = cls.text(c)["num_hidden_layers"]
        mtp = cls.hf_layer.format(i=n)
        out = {}
        for name, t in tensors.items():
            if name.endswith(("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")):
                p, _, part = name.rpartition(".")
                out.update({f"{p}.{e}.{part}.weight": x for e, x in enumerate(t.unbind(0))})
                continue
            out[name] = t
        return {_mtp_name(k, mtp): v for k, v in out.items()}

    @classmethod
    def split(cls, tensors: dict, c: dict) -> dict:
        """``regroup``'s inverse, on the checkpoint ``save_pretrained`` would write (the text-only type's names)."""
        n = cls.text(c)["num_hidden_layers"]
        mtp = cls.hf_layer.format(i=n)
        tensors = {cls.prefix + k.removeprefix("model.") if k.startswith("model.") else k: v
                   for k, v in tensors.items()}
        tensors = {(mtp + k if k.startswith("mtp.") and not k.startswith("mtp.layers.")
                    else mtp + k.removeprefix("mtp.layers.0.") if k.startswith("mtp.layers.0.") else k): v
                   for k, v in tensors.items()}
        if any(k.startswith("mtp.layers.") for k in tensors):
            raise ValueError(f"{cls.arch}: llama.cpp's nextn layer is one block; this MTP head has more")
        out, stacks = {}, {}
        for name, t in tensors.items():
            m = EXPERT.match(name)
            if m:
                stacks.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = t
            else:
                out[name] = t
        for name, parts in stacks.items():
            out[name] = torch.stack([parts[e] for e in range(len(parts))])
        return cls._qkvz(out, c, merge=False) if cls.arch == "qwen3next" else out


def _mtp_name(name: str, mtp: str) -> str:
    """"{layer n}.mtp.X" -> "mtp.X", "{layer n}.Y" -> "mtp.layers.0.Y" (n: the first layer after the decoder's)."""
    if not name.startswith(mtp):
        return name
    rest = name[len(mtp):]
    return rest if rest.startswith("mtp.") else "mtp.layers.0." + rest


def _untile(name: str, t: torch.Tensor, c: dict, tiled, inverse: bool) -> torch.Tensor:
    """Qwen3.5's value heads, grouped by key head in the checkpoint, tiled in the file (module doc):
    _LinearAttentionVReorderBase._reorder_v_heads and, ``inverse``, its inverse."""
    if "linear_attn." not in name:
        return t
    Hk, r = tiled
    K, V = c["linear_key_head_dim"], c["linear_value_head_dim"]

    def move(x, dim, width):                  # (Hk, r, w) <-> (r, Hk, w) along ``dim``
        shape = list(x.shape)
        a, b = (r, Hk) if inverse else (Hk, r)
        x = x.reshape(shape[:dim] + [a, b, width] + shape[dim + 1:])
        return x.transpose(dim, dim + 1).reshape(shape)

    if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
        qk = 2 * Hk * K
        return torch.cat([t[:qk], move(t[qk:], 0, V)])
    if name.endswith("in_proj_z.weight"):
        return move(t, 0, V)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return move(t, 0, 1)
    if name.endswith("out_proj.weight"):
        return move(t, 1, V)
    return t


class Qwen35Arch(Qwen3NextArch):
    """``qwen35`` (module doc): Qwen3-Next's hybrid with Qwen3.5's projections fused by part (``in_proj_qkv`` as
    ``attn_qkv``, ``in_proj_z`` as ``attn_gate``, ``in_proj_b`` / ``in_proj_a`` as ``ssm_beta`` / ``ssm_alpha``),
    its value heads tiled, a dense SwiGLU MLP per layer; M-RoPE sections (``rope.dimension_sections``, 4 of them:
    for text every axis holds the position, which is plain rotary - the 4th section, rotated by another index,
    must be 0)."""
    arch = "qwen35"
    model_type = "qwen3_5"
    prefix = "model.language_model."
    hf_layer = "model.language_model.layers.{i}."
    top: ClassVar[dict] = {**TOP, "token_embd.weight": "model.language_model.embed_tokens.weight",
                           "output_norm.weight": "model.language_model.norm.weight"}
    layer: ClassVar[dict] = {**ATTENTION, **DELTANET, **DENSE, **NEXTN,
                             "ssm_beta.weight": "linear_attn.in_proj_b.weight",
                             "ssm_alpha.weight": "linear_attn.in_proj_a.weight"}
    DEFAULT_SECTIONS: ClassVar[list] = [11, 11, 10, 0]       # _Qwen35MRopeMixin's, written when the config has none

    @classmethod
    def _tiled(cls, c: dict):
        t = cls.text(c)
        Hk, H = t["linear_num_key_heads"], t["linear_num_value_heads"]
        return None if Hk == H else (Hk, H // Hk)

    @classmethod
    def _text(cls, meta: dict, tensors: dict) -> dict:
        c = cls._common(meta, tensors)
        a = cls.arch
        sections = list(_get(meta, a, "rope.dimension_sections"))
        if len(sections) != 4 or sections[3]:
            raise ValueError(f"GGUF metadata {a}.rope.dimension_sections={sections}: four sections, the 4th 0 "
                             f"(text positions rotate the first three alike)")
        c["rope_parameters"].update({"mrope_section": sections[:3], "mrope_interleaved": True})
        c["attn_output_gate"] = True
        return c

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        t = cls._text(meta, tensors)
        return {"model_type": cls.model_type, "tie_word_embeddings": t["tie_word_embeddings"],
                "text_config": {**t, "model_type": cls.model_type + "_text"}}

    @classmethod
    def meta(cls, c: dict) -> dict:
        c = cls.text(c)
        m = super().meta(c)
        sections = list((c.get("rope_parameters") or {}).get("mrope_section") or cls.DEFAULT_SECTIONS)
        m["rope.dimension_sections"] = (sections + [0] * 4)[:4]
        return m

    @classmethod
    def check(cls, c: dict) -> None:
        pass                                  # subquad's qwen3_5 types hold nothing llama.cpp's qwen35 lacks


class Qwen35MoeArch(Qwen35Arch):
    """``qwen35moe``: ``qwen35`` with experts and a gated shared expert in every layer (Qwen2MoeModel's expert
    metadata)."""
    arch = "qwen35moe"
    model_type = "qwen3_5_moe"
    layer: ClassVar[dict] = {**{k: v for k, v in Qwen35Arch.layer.items() if k not in DENSE}, **MOE}

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        c = super().config(meta, tensors)
        c["text_config"].update(cls._experts(meta))
        return c


QWEN_ARCHS = (Qwen3NextArch, Qwen35Arch, Qwen35MoeArch)
# the Hugging Face model_type a model is written from (``save_gguf``: the type ``save_pretrained`` would write)
QWEN_HF_TYPES = {"qwen3_next": Qwen3NextArch, "qwen3_5_text": Qwen35Arch, "qwen3_5_moe_text": Qwen35MoeArch}
# a model read as a multimodal Qwen3.5 (a folder or a qwen35 file) is written as its text type's architecture, not as
# qwen3next (whose Hugging Face type also holds its structure and comes first in save_pretrained's choice)
QWEN_SOURCE_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5_text": "qwen3_5_text",
                     "qwen3_5_moe_text": "qwen3_5_moe_text", "qwen4_exp": "qwen4_exp_text",
                     "qwen4_exp_text": "qwen4_exp_text"}
