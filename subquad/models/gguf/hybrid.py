"""llama.cpp's GGUF layout of the SSM hybrids, as its converter writes them (``conversion/granite.py``,
``nemotron.py``, ``falcon_h1.py``, ``jamba.py``, ``mamba.py``'s Mamba2Model for the Mamba-2 layers, gguf-py's
``tensor_mapping.py``), against the Hugging Face checkpoints ``models.hf`` reads:

    GraniteHybridArch   granitehybrid    Granite 4 hybrids (granitemoehybrid) and Bamba
    NemotronHArch       nemotron_h       Nemotron-H, dense ("M", "*", "-" layers)
    NemotronHMoeArch    nemotron_h_moe   Nemotron-H with experts ("M", "*", "E" layers)
    FalconH1Arch        falcon-h1        Falcon-H1 (Mamba-2 beside attention in every layer)
    JambaArch           jamba            Jamba (Mamba-1 with dt/B/C norms, attention, experts)

Same protocol as ``arch.py``'s classes (``top`` / ``layer`` / ``to_hf`` / ``to_gguf`` / ``config`` / ``meta``), plus
optional hooks the loader and writer look for:

    on_blocks(h, c)            for a tensor whose ``to_hf`` is a permutation of rows and / or a scale factor,
                               (row order or None, factor): the loader applies them to a quantised matrix's
                               blocks (rows and scales) and keeps it quantised, exactly; None: reshaped otherwise
    gguf_tensors(tensors, c)   the checkpoint's tensors -> {GGUF name: tensor as the converter writes it}
                               (where one checkpoint tensor is written as two, experts are stacked, or names
                               depend on the config)
    for_config(c)              the class that writes Hugging Face config ``c`` (nemotron_h: with experts or not)
    writes_vocab_size          False where the converter writes no ``{arch}.vocab_size`` (Jamba)

A table's Hugging Face name holding ``{e}`` is one checkpoint tensor per expert: the loader splits the stacked
GGUF tensor (E, ...) into them. Which layer is attention and which SSM is read off the per-layer
``attention.head_count_kv`` array (0: an SSM layer), as llama.cpp reads it.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from subquad.models.gguf.arch import LLAMA_TOP, SELF_ATTN, MambaArch, Mamba2Arch, _get

_GATE, _UP = ".gate_half", ".up_half"        # the halves of Granite's fused input_linear (its format's unpack)


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The converter's ``LlamaModel.permute`` of q / k rows: per head, [first half; second half] of the head's
    dims -> interleaved (d0, d_h/2, d1, d_h/2 + 1, ...), so that llama.cpp's adjacent-pair rotary ("NORM")
    equals transformers' rotate-half."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """``permute``'s inverse."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permutation(rows: int, heads: int, inverse: bool = True) -> torch.Tensor:
    """The row order ``unpermute`` (or ``permute``) applies, as indices: for quantised blocks."""
    idx = torch.arange(rows)
    return unpermute(idx, heads) if inverse else permute(idx, heads)


def stack_experts(arch, tensors: dict, c: dict) -> dict:
    """Checkpoint -> GGUF tensors for a checkpoint of one tensor per expert (``...experts.{e}...``): those
    stacked (E, ...) under the table's ``{e}`` name (JambaModel / NemotronHModel.modify_tensors), the rest
    renamed and ``to_gguf``'d one by one."""
    import re

    from subquad.models.gguf.arch import gguf_name

    out, stacks = {}, {}
    for h, t in tensors.items():
        m = re.fullmatch(r"(.+\.experts\.)(\d+)(\..+)", h)
        if m:
            stacks.setdefault(m[1] + "{e}" + m[3], {})[int(m[2])] = t.float()
            continue
        out[gguf_name(arch, h)] = arch.to_gguf(h, t.float(), c)
    for h, parts in stacks.items():
        if sorted(parts) != list(range(len(parts))):
            raise ValueError(f"{arch.arch}: the experts of {h} are {sorted(parts)}, not 0..{len(parts) - 1}")
        out[gguf_name(arch, h)] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def _head_count_kv(meta: dict, a: str, n: int) -> list:
    kv = _get(meta, a, "attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * n
    if len(kv) != n or len({k for k in kv if k}) > 1:
        raise ValueError(f"GGUF metadata {a}.attention.head_count_kv={kv} must give each of the {n} layers 0 "
                         f"(an SSM layer) or one common count")
    return kv


class GraniteHybridArch:
    """``granitehybrid`` - Hugging Face ``granitemoehybrid`` (IBM Granite 4) and ``bamba`` (GraniteHybridModel in
    conversion/granite.py). Loaded as ``granitemoehybrid`` (a Bamba is its dense, rotary case).

    Layers: ``attention.head_count_kv[i]`` 0 is a Mamba-2 layer (``Mamba2Arch``'s tensors and reshapes), else
    attention. MLPs: with experts (``expert_count`` > 0) ``ffn_{gate,up,down}_exps`` (E, I, d) / (E, d, I) - the
    fused input_linear split into gate and up - ``ffn_gate_inp`` the router, ``ffn_*_shexp`` the shared expert
    (``expert_shared_feed_forward_length`` wide); without, ``ffn_{gate,up,down}`` (the shared MLP, or Bamba's).

    q and k: ``permute`` (the converter's, for llama.cpp's NORM rotary; done also for attention without
    positions, where it leaves q k^T as it is) - undone here. Rotary is on only where ``rope.scaling.finetuned``
    is true, which the converter writes for Bamba alone among hybrids: read as transformers' Bamba, rotary on
    the first half of each head's dims (transformers hardcodes ``partial_rotary_factor`` 0.5; the converter
    writes ``rope.dimension_count`` = head_dim, or the older configs' ``attn_rotary_emb``).

    Multipliers (``embedding_scale`` m, ``residual_scale`` r, ``attention_scale`` a, ``logit_scale`` s; llama.cpp
    applies them at run time, 0 / absent meaning none and a = 1 / sqrt(head_dim)) are folded into the weights
    here, as subquad's Hugging Face format folds them, and the config given the loader has multipliers of 1:
    embedding x m, head / s (tied: output_norm / (m s)), q x a sqrt(head_dim), each branch's output projection
    (ssm_out, attn_output, ffn_down*) x r. Both the permutation and the factors act on whole rows, so a
    quantised matrix keeps its blocks (``on_blocks``). ``save_gguf`` writes a model's weights with multipliers
    of 1 (attention_scale 1 / sqrt(head_dim)), as the converter writes the config ``save_pretrained`` writes."""
    arch = "granitehybrid"
    hf_layer = "model.layers.{i}."
    top: ClassVar[dict] = LLAMA_TOP
    layer: ClassVar[dict] = {
        **{k: v.replace("mixer.", "mamba.") for k, v in Mamba2Arch.layer.items() if k != "attn_norm.weight"},
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        **SELF_ATTN,
        "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
        "ffn_gate_exps.weight": "block_sparse_moe.input_linear.weight" + _GATE,
        "ffn_up_exps.weight": "block_sparse_moe.input_linear.weight" + _UP,
        "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
        "ffn_gate_shexp.weight": "shared_mlp.input_linear.weight" + _GATE,
        "ffn_up_shexp.weight": "shared_mlp.input_linear.weight" + _UP,
        "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
        # no experts: the shared MLP written as a dense one (GraniteMoeModel.modify_tensors) - the same tensors
        "ffn_gate.weight": "shared_mlp.input_linear.weight" + _GATE,
        "ffn_up.weight": "shared_mlp.input_linear.weight" + _UP, "ffn_down.weight": "shared_mlp.output_linear.weight"}
    # Bamba's checkpoint names (written as the same GGUF tensors)
    BAMBA: ClassVar[dict] = {"pre_ff_layernorm.weight": "ffn_norm.weight",
                             "feed_forward.gate_proj.weight": "ffn_gate.weight",
                             "feed_forward.up_proj.weight": "ffn_up.weight",
                             "feed_forward.down_proj.weight": "ffn_down.weight"}

    @staticmethod
    def _scales(c: dict) -> dict:
        return c.get("_gguf_scales", {})

    @classmethod
    def on_blocks(cls, h: str, c: dict):
        """(row order, factor) that ``to_hf`` applies to ``h`` (module doc); None where it reshapes otherwise."""
        if ".mamba." in h and not h.endswith(("in_proj.weight", "out_proj.weight")):
            return None
        rows = None
        sc = cls._scales(c)
        hd = c["hidden_size"] // c["num_attention_heads"]
        if h.endswith("q_proj.weight"):
            rows = permutation(c["num_attention_heads"] * hd, c["num_attention_heads"])
        elif h.endswith("k_proj.weight"):
            rows = permutation(c["num_key_value_heads"] * hd, c["num_key_value_heads"])
        return rows, cls._factor(h, sc)

    @staticmethod
    def _factor(h: str, sc: dict) -> float:
        if not sc:
            return 1.0
        if h == "model.embed_tokens.weight":
            return sc["m"]
        if h == "lm_head.weight":
            return 1 / sc["s"]
        if h == "model.norm.weight" and sc["tied"]:
            return 1 / (sc["m"] * sc["s"])
        if h.endswith(("mamba.out_proj.weight", "self_attn.o_proj.weight", "output_linear.weight")):
            return sc["r"]
        if h.endswith("q_proj.weight"):
            return sc["q"]
        return 1.0

    @classmethod
    def to_hf(cls, name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if cls.on_blocks(name, c) is None:
            return Mamba2Arch.to_hf(name.replace(".mamba.", ".mixer."), t, c)
        rows, f = cls.on_blocks(name, c)
        if rows is not None:
            t = t[rows] if t.device.type != "meta" else t.clone()
        if f != 1.0:
            t = (t.double() * f).to(t.dtype)
        return t

    @classmethod
    def to_gguf(cls, name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if ".mamba." in name:
            return Mamba2Arch.to_gguf(name.replace(".mamba.", ".mixer."), t, {**c, "n_groups": c["mamba_n_groups"]})
        if name.endswith("q_proj.weight"):
            return permute(t, c["num_attention_heads"])
        if name.endswith("k_proj.weight"):
            return permute(t, c["num_key_value_heads"])
        return t

    @classmethod
    def gguf_tensors(cls, tensors: dict, c: dict) -> dict:
        """Checkpoint -> GGUF tensors: input_linear split into gate and up (GraniteMoeModel.modify_tensors), the
        shared MLP written as ``ffn_*_shexp`` beside experts and as ``ffn_*`` without; Bamba's names."""
        experts = c.get("model_type") != "bamba" and c.get("num_local_experts", 0) > 0
        dense = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
        inverse = {v: k for k, v in cls.layer.items()
                   if not (k.endswith("_shexp.weight") and not experts or k in dense and experts)}
        out = {}
        for h, t in tensors.items():
            t = t.float()
            if h == "lm_head.weight" and c.get("tie_word_embeddings"):
                continue
            g = {**{v: k for k, v in cls.top.items()}, "model.final_layernorm.weight": "output_norm.weight"}.get(h)
            if g is not None:
                out[g] = t
                continue
            i, _, rest = h.removeprefix(cls.hf_layer.split("{i}")[0]).partition(".")
            parts = {rest: t}
            if rest.endswith("input_linear.weight"):
                parts = dict(zip((rest + _GATE, rest + _UP), t.chunk(2, dim=-2)))
            for r, p in parts.items():
                if r in cls.BAMBA:
                    g = cls.BAMBA[r]
                elif r in inverse:
                    g = inverse[r]
                else:
                    raise ValueError(f"{cls.arch}: no GGUF name for the checkpoint tensor {h!r}")
                out[f"blk.{i}.{g}"] = cls.to_gguf(h, p, c)
        return out

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        n, d = _get(meta, a, "block_count"), _get(meta, a, "embedding_length")
        heads = _get(meta, a, "attention.head_count")
        kv = _head_count_kv(meta, a, n)
        hd = d // heads
        inner, ssm_heads = _get(meta, a, "ssm.inner_size"), _get(meta, a, "ssm.time_step_rank")
        if inner % ssm_heads or inner % d:
            raise ValueError(f"GGUF metadata {a}.ssm.inner_size={inner} must be a multiple of "
                             f"{a}.ssm.time_step_rank={ssm_heads} and of embedding_length={d}")
        rope = bool(meta.get(f"{a}.rope.scaling.finetuned", True))     # llama.cpp's default: true
        if rope and 0 in kv:
            rot = meta.get(f"{a}.rope.dimension_count", hd)
            if rot not in (hd, hd // 2):
                raise ValueError(f"GGUF metadata {a}.rope.dimension_count={rot}: a hybrid with rotary is Bamba, "
                                 f"which rotates half of each head's {hd} dims (converter: {hd} or {hd // 2})")
        experts = meta.get(f"{a}.expert_count", 0)
        ff = _get(meta, a, "feed_forward_length")
        ssm = next((i for i, k in enumerate(kv) if k == 0), None)
        c = {"model_type": "granitemoehybrid", "hidden_size": d, "num_hidden_layers": n,
             "num_attention_heads": heads, "num_key_value_heads": max(kv) or heads,
             "layer_types": ["mamba" if k == 0 else "attention" for k in kv],
             "rms_norm_eps": float(_get(meta, a, "attention.layer_norm_rms_epsilon")), "hidden_act": "silu",
             "attention_bias": False, "mamba_proj_bias": False,
             "mamba_n_heads": ssm_heads, "mamba_d_head": inner // ssm_heads, "mamba_expand": inner // d,
             "mamba_n_groups": _get(meta, a, "ssm.group_count"), "mamba_d_state": _get(meta, a, "ssm.state_size"),
             "mamba_d_conv": _get(meta, a, "ssm.conv_kernel"),
             "mamba_conv_bias": ssm is None or f"blk.{ssm}.ssm_conv1d.bias" in tensors,
             "num_local_experts": experts, "intermediate_size": ff,
             # without experts the dense MLP is the shared one; llama.cpp sizes it by feed_forward_length, which
             # the converter writes from intermediate_size: equal in the released dense configs
             "shared_intermediate_size": meta.get(f"{a}.expert_shared_feed_forward_length", 0 if experts else ff),
             # folded into the weights by to_hf (class doc): the loader's format sees multipliers of 1
             "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
             "attention_multiplier": hd ** -0.5,
             "position_embedding_type": "rope" if rope else "nope",
             "rope_parameters": {"rope_type": "default", "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0)),
                                 "partial_rotary_factor": 0.5 if rope and 0 in kv else 1.0},
             "tie_word_embeddings": "output.weight" not in tensors}
        if experts:
            c["num_experts_per_tok"] = _get(meta, a, "expert_used_count")
        if experts and not c["shared_intermediate_size"]:
            raise ValueError(f"GGUF metadata {a}.expert_shared_feed_forward_length is missing or 0: subquad's "
                             f"granitemoehybrid needs the shared expert beside the experts")
        m = float(meta.get(f"{a}.embedding_scale") or 1.0)
        s = float(meta.get(f"{a}.logit_scale") or 1.0)
        att = float(meta.get(f"{a}.attention.scale") or hd ** -0.5)
        c["_gguf_scales"] = {"m": m, "s": s, "r": float(meta.get(f"{a}.residual_scale") or 1.0),
                             "q": att * math.sqrt(hd), "tied": c["tie_word_embeddings"]}
        if all(v == 1.0 for k, v in c["_gguf_scales"].items() if k != "tied"):
            c["_gguf_scales"] = {}
        return c

    @classmethod
    def meta(cls, c: dict) -> dict:
        """GraniteHybridModel.set_gguf_parameters (via GraniteMoeModel, GraniteModel, LlamaModel, TextModel) for the
        config ``save_pretrained`` writes (granitemoehybrid or bamba)."""
        n, d, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
        bamba = c["model_type"] == "bamba"
        attn = (set(c["attn_layer_indices"]) if bamba else
                {i for i, t in enumerate(c["layer_types"]) if t in ("attention", "full_attention")})
        kv = c.get("num_key_value_heads") or heads
        experts = 0 if bamba else c.get("num_local_experts", 0)
        if not bamba and c.get("position_embedding_type") == "rope" and len(attn) < n:
            raise ValueError("position_embedding_type='rope' in a granitemoehybrid with Mamba-2 layers: llama.cpp's "
                             "converter writes rotary only for Bamba (rope.scaling.finetuned false here), so the "
                             "file would lose it; subquad does not write it. A hybrid trained with Bamba's "
                             "rotary (on half of each head's dims - subquad train --mixer-option "
                             "softmax.rotary_fraction=0.5 - with dense MLPs) is written as Bamba's, one trained "
                             "without rotary (--mixer-option softmax.rotary=false) as Granite 4's")
        ctx = c.get("max_position_embeddings", 262144 if bamba else 2048)   # transformers' config defaults
        out = {"block_count": n, "context_length": ctx, "embedding_length": d,
               "feed_forward_length": c["intermediate_size"], "attention.head_count": heads,
               "attention.head_count_kv": [kv if i in attn else 0 for i in range(n)],
               "rope.freq_base": float(c["rope_parameters"]["rope_theta"]),
               "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"])}
        if not bamba:
            out["expert_count"] = experts
            if experts:
                out["expert_used_count"] = c["num_experts_per_tok"]
        out["rope.dimension_count"] = d // heads
        if not bamba:
            for key, field in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                               ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
                if c.get(field):
                    out[key] = float(c[field])
            if c.get("shared_intermediate_size"):
                out["expert_shared_feed_forward_length"] = c["shared_intermediate_size"]
        inner = c["mamba_expand"] * d
        out.update({"ssm.conv_kernel": c["mamba_d_conv"], "ssm.state_size": c["mamba_d_state"],
                    "ssm.group_count": c["mamba_n_groups"], "ssm.inner_size": inner,
                    "ssm.time_step_rank": c["mamba_n_heads"]})
        rope = bamba or c.get("position_embedding_type") == "rope" or not any(i not in attn for i in range(n))
        out["rope.scaling.finetuned"] = rope
        if not rope:
            out["context_length"] = 1 << 20
        return out


class NemotronHArch:
    """``nemotron_h`` - Hugging Face ``nemotron_h`` (NVIDIA Nemotron-H; NemotronHModel in conversion/nemotron.py,
    a GraniteHybridModel). One GGUF block per checkpoint layer, its kind read as llama.cpp reads it: attention
    where ``attention.head_count_kv[i]`` > 0, an MLP ("-": ungated squared ReLU, ``ffn_up`` / ``ffn_down``) where
    ``feed_forward_length[i]`` > 0, else Mamba-2 (``Mamba2Arch``'s tensors and reshapes); every block's norm is
    ``attn_norm``. The pattern string "M-M*-..." is rebuilt from the two arrays. Attention without positions,
    heads of ``attention.key_length``; q and k ``permute``d as Granite's (undone here, by whole rows:
    ``on_blocks``). The Mamba-2 width is ``ssm.inner_size`` = ``ssm.time_step_rank`` heads x their head dim.

    Not in the file: transformers clamps dt to [``time_step_min``, inf); llama.cpp does not clamp. Read with
    transformers' default, 0.001 (the released configs'). The MoE form is ``nemotron_h_moe``
    (``NemotronHMoeArch``); ``for_config`` picks it for a config with "E" layers. transformers' Nemotron-H reads
    ``lm_head`` even when tied: a file without ``output.weight`` is refused by name."""
    MLP = "-"                                # the pattern's letter for a layer with feed_forward_length > 0

    @classmethod
    def for_config(cls, c: dict):
        """The GGUF architecture of Hugging Face config ``c``: nemotron_h_moe with "E" layers."""
        return NemotronHMoeArch if "E" in c["hybrid_override_pattern"] else NemotronHArch
    arch = "nemotron_h"
    hf_layer = "backbone.layers.{i}."
    top: ClassVar[dict] = {"token_embd.weight": "backbone.embeddings.weight",
                           "output_norm.weight": "backbone.norm_f.weight", "output.weight": "lm_head.weight"}
    layer: ClassVar[dict] = {**{k: v for k, v in Mamba2Arch.layer.items()},
                             "attn_q.weight": "mixer.q_proj.weight", "attn_k.weight": "mixer.k_proj.weight",
                             "attn_v.weight": "mixer.v_proj.weight", "attn_output.weight": "mixer.o_proj.weight",
                             "ffn_up.weight": "mixer.up_proj.weight", "ffn_down.weight": "mixer.down_proj.weight"}

    @staticmethod
    def on_blocks(h: str, c: dict):
        if h.endswith(("mixer.A_log", "mixer.D", "mixer.norm.weight", "conv1d.weight")):
            return None
        if h.endswith("q_proj.weight"):
            return permutation(c["num_attention_heads"] * c["head_dim"], c["num_attention_heads"]), 1.0
        if h.endswith("k_proj.weight"):
            return permutation(c["num_key_value_heads"] * c["head_dim"], c["num_key_value_heads"]), 1.0
        return None, 1.0

    @classmethod
    def to_hf(cls, name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        how = cls.on_blocks(name, c)
        if how is None:
            return Mamba2Arch.to_hf(name, t, c)
        if how[0] is not None:
            return t[how[0]] if t.device.type != "meta" else t.clone()
        return t

    @staticmethod
    def to_gguf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if name.endswith("q_proj.weight"):
            return permute(t, c["num_attention_heads"])
        if name.endswith("k_proj.weight"):
            return permute(t, c["num_key_value_heads"])
        return Mamba2Arch.to_gguf(name, t, c)

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        n, d = _get(meta, a, "block_count"), _get(meta, a, "embedding_length")
        kv = _head_count_kv(meta, a, n)
        ff = _get(meta, a, "feed_forward_length")
        ff = ff if isinstance(ff, list) else [ff] * n
        if len(ff) != n or len({f for f in ff if f}) > 1:
            raise ValueError(f"GGUF metadata {a}.feed_forward_length={ff} must give each of the {n} layers 0 or "
                             f"one common MLP width")
        if any(k and f for k, f in zip(kv, ff)):
            raise ValueError(f"GGUF metadata {a}.attention.head_count_kv={kv} and feed_forward_length={ff}: a layer "
                             f"is attention or an MLP, not both")
        if meta.get(f"{a}.expert_count") and cls.MLP == "-":
            raise ValueError(f"GGUF metadata {a}.expert_count={meta[f'{a}.expert_count']}: a dense nemotron_h has no "
                             f"experts (nemotron_h_moe files hold Nemotron-H's MoE)")
        if "output.weight" not in tensors:
            raise ValueError(f"GGUF file of architecture {a!r} has no output.weight: transformers' Nemotron-H "
                             f"reads lm_head whatever tie_word_embeddings says, and subquad's nemotron_h with it")
        heads = _get(meta, a, "attention.head_count")
        inner, ssm_heads = _get(meta, a, "ssm.inner_size"), _get(meta, a, "ssm.time_step_rank")
        pattern = "".join("*" if k else cls.MLP if f else "M" for k, f in zip(kv, ff))
        ssm = pattern.find("M")
        eps = meta.get(f"{a}.attention.layer_norm_epsilon", meta.get(f"{a}.attention.layer_norm_rms_epsilon"))
        if eps is None:
            raise ValueError(f"GGUF metadata has no {a}.attention.layer_norm_epsilon (needed for architecture {a!r})")
        return {**cls._moe(meta, ff), "model_type": "nemotron_h", "hidden_size": d, "num_hidden_layers": n,
                "hybrid_override_pattern": pattern, "num_attention_heads": heads,
                "num_key_value_heads": max(kv) or heads,
                "head_dim": meta.get(f"{a}.attention.key_length", d // heads),
                "intermediate_size": (max(ff) or None) if cls.MLP == "-" else None, "layer_norm_epsilon": float(eps),
                "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_bias": False, "mlp_bias": False,
                "attention_bias": False, "mamba_num_heads": ssm_heads, "mamba_head_dim": inner // ssm_heads,
                "ssm_state_size": _get(meta, a, "ssm.state_size"), "n_groups": _get(meta, a, "ssm.group_count"),
                "conv_kernel": _get(meta, a, "ssm.conv_kernel"),
                "use_conv_bias": ssm < 0 or f"blk.{ssm}.ssm_conv1d.bias" in tensors,
                "time_step_min": 0.001, "tie_word_embeddings": False}

    @staticmethod
    def _moe(meta: dict, ff: list) -> dict:
        return {}

    @classmethod
    def meta(cls, c: dict) -> dict:
        """NemotronHModel.set_gguf_parameters (GraniteHybridModel's, then key / value length and the per-layer
        feed_forward_length) for the config ``save_pretrained`` writes."""
        pattern = c["hybrid_override_pattern"]
        if "M" not in pattern:
            raise ValueError(f"nemotron_h without Mamba layers (hybrid_override_pattern={pattern!r}): the converter "
                             f"writes such a model as a Granite (granite / granitemoe), not nemotron_h")
        n, d, heads = len(pattern), c["hidden_size"], c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        return {"block_count": n, "context_length": 1 << 20, "embedding_length": d,
                "feed_forward_length": [c["intermediate_size"] if ch == "-" else 0 for ch in pattern],
                "attention.head_count": heads, "attention.head_count_kv": [kv if ch == "*" else 0 for ch in pattern],
                "attention.layer_norm_epsilon": float(c["layer_norm_epsilon"]),
                "rope.dimension_count": d // heads,
                "ssm.conv_kernel": c["conv_kernel"], "ssm.state_size": c["ssm_state_size"],
                "ssm.group_count": c["n_groups"], "ssm.inner_size": c["mamba_num_heads"] * c["mamba_head_dim"],
                "ssm.time_step_rank": c["mamba_num_heads"], "rope.scaling.finetuned": False,
                "attention.key_length": c["head_dim"], "attention.value_length": c["head_dim"]}


class FalconH1Arch:
    """``falcon-h1`` - Hugging Face ``falcon_h1`` (TII Falcon-H1; conversion/falcon_h1.py, a Mamba2Model). Every
    layer holds Mamba-2 (``Mamba2Arch``'s tensors and reshapes; ``ssm_norm`` only where the checkpoint has the
    gated norm, ``mamba_rms_norm``) and attention side by side (GQA, heads of ``attention.key_length``, rotary in
    halves as transformers - no permute), then a SwiGLU MLP after a norm the converter names ``blk.{i}.ffn_norm``
    (gguf-py's FFN_PRE_NORM, without ".weight"; llama.cpp loads it so). The Mamba-2 width is ``ssm.inner_size``
    (``mamba_d_ssm``), ``ssm.time_step_rank`` heads.

    Falcon-H1's muP multipliers are folded into the weights by the converter (modify_tensors): embed x
    embedding_multiplier, output x lm_head_multiplier, q / v x attention_in_multiplier, k x attention_in x
    key_multiplier, attn_output x attention_out_multiplier, ssm_in x ssm_in_multiplier with its z, x, B, C and dt
    rows x ssm_multipliers[0..4], ssm_out x ssm_out_multiplier, ffn_gate x mlp_multipliers[0], ffn_down x
    mlp_multipliers[1]. The file keeps none of them, so it is read with multipliers of 1 (the weights are
    already the folded ones) and written from subquad's folded weights as they are. A file without
    ``output.weight`` (tied) uses the folded embedding as the head, as llama.cpp does - transformers' tied
    Falcon-H1 would use it times lm_head_multiplier / embedding_multiplier, which the file does not record."""
    arch = "falcon-h1"
    hf_layer = "model.layers.{i}."
    top: ClassVar[dict] = {"token_embd.weight": "model.embed_tokens.weight",
                           "output_norm.weight": "model.final_layernorm.weight", "output.weight": "lm_head.weight"}
    layer: ClassVar[dict] = {
        **{k: v.replace("mixer.", "mamba.") for k, v in Mamba2Arch.layer.items() if k != "attn_norm.weight"},
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm": "pre_ff_layernorm.weight",
        **SELF_ATTN,
        "ffn_gate.weight": "feed_forward.gate_proj.weight", "ffn_up.weight": "feed_forward.up_proj.weight",
        "ffn_down.weight": "feed_forward.down_proj.weight"}

    @staticmethod
    def to_hf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if ".mamba." in name:
            return Mamba2Arch.to_hf(name.replace(".mamba.", ".mixer."), t, c)
        return t

    @staticmethod
    def to_gguf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if ".mamba." in name:
            return Mamba2Arch.to_gguf(name.replace(".mamba.", ".mixer."), t, {**c, "n_groups": c["mamba_n_groups"]})
        return t

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        n, d = _get(meta, a, "block_count"), _get(meta, a, "embedding_length")
        heads = _get(meta, a, "attention.head_count")
        kv = _get(meta, a, "attention.head_count_kv", heads)
        if isinstance(kv, list):
            raise ValueError(f"GGUF metadata {a}.attention.head_count_kv={kv}: Falcon-H1 has attention in every "
                             f"layer, one count")
        inner, ssm_heads = _get(meta, a, "ssm.inner_size"), _get(meta, a, "ssm.time_step_rank")
        if inner % ssm_heads:
            raise ValueError(f"GGUF metadata {a}.ssm.inner_size={inner} is not a multiple of "
                             f"{a}.ssm.time_step_rank={ssm_heads}")
        return {"model_type": "falcon_h1", "hidden_size": d, "num_hidden_layers": n, "num_attention_heads": heads,
                "num_key_value_heads": kv, "head_dim": meta.get(f"{a}.attention.key_length", d // heads),
                "intermediate_size": _get(meta, a, "feed_forward_length"), "hidden_act": "silu",
                "rms_norm_eps": float(_get(meta, a, "attention.layer_norm_rms_epsilon")),
                "mamba_d_ssm": inner, "mamba_n_heads": ssm_heads, "mamba_d_head": inner // ssm_heads,
                "mamba_n_groups": _get(meta, a, "ssm.group_count"), "mamba_d_state": _get(meta, a, "ssm.state_size"),
                "mamba_d_conv": _get(meta, a, "ssm.conv_kernel"),
                "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in tensors, "mamba_proj_bias": False,
                "mamba_rms_norm": "blk.0.ssm_norm.weight" in tensors, "mamba_norm_before_gate": False,
                "projectors_bias": False, "attention_bias": False, "mlp_bias": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": float(_get(meta, a, "rope.freq_base"))},
                "tie_word_embeddings": "output.weight" not in tensors}      # multipliers: 1 (class doc)

    @classmethod
    def meta(cls, c: dict) -> dict:
        """Mamba2Model.set_gguf_parameters, then FalconH1Model's overrides, for the config ``save_pretrained``
        writes (multipliers of 1)."""
        inner = c["mamba_d_ssm"]
        return {"context_length": c.get("max_position_embeddings", 8192), "embedding_length": c["hidden_size"],
                "feed_forward_length": c["intermediate_size"], "attention.head_count": c["num_attention_heads"],
                "block_count": c["num_hidden_layers"], "ssm.conv_kernel": c["mamba_d_conv"],
                "ssm.inner_size": inner, "ssm.state_size": c["mamba_d_state"],
                "ssm.time_step_rank": inner // c["mamba_d_head"], "ssm.group_count": c["mamba_n_groups"],
                "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
                "attention.head_count_kv": c["num_key_value_heads"], "attention.key_length": c["head_dim"],
                "attention.value_length": c["head_dim"],
                "rope.freq_base": float(c["rope_parameters"]["rope_theta"])}


class JambaArch:
    """``jamba`` - Hugging Face ``jamba`` (AI21 Jamba; conversion/jamba.py, a TextModel: no permute). Mamba-1 layers
    (``MambaArch``'s tensors and reshapes: A = -exp(A_log), the convolution squeezed) with Jamba's weighted RMS
    norms on dt, B and C (``ssm_dt_norm``, ``ssm_b_norm``, ``ssm_c_norm``, their epsilon the model's), attention
    without positions where ``attention.head_count_kv[i]`` > 0, and after each a SwiGLU MLP: a mixture of
    ``expert_count`` experts (``ffn_gate_inp`` the router - softmax, top ``expert_used_count``, not renormalised -
    and ``ffn_{gate,up,down}_exps`` the per-expert checkpoint tensors stacked) where the block has
    ``ffn_gate_inp``, else dense ``ffn_{gate,up,down}``. Which layers attend and which have experts must each
    be every k-th layer from an offset, as Jamba's config says it (``attn_layer_period`` / ``_offset``,
    ``expert_layer_period`` / ``_offset``); a file whose layout is not is refused by name. The converter writes
    no ``vocab_size`` for Jamba (llama.cpp counts the vocabulary's tokens); ``save_gguf`` writes it only for a
    file without a vocabulary (no tokenizer given), where llama.cpp would otherwise read 0."""
    arch = "jamba"
    hf_layer = "model.layers.{i}."
    writes_vocab_size = False
    top: ClassVar[dict] = {"token_embd.weight": "model.embed_tokens.weight",
                           "output_norm.weight": "model.final_layernorm.weight", "output.weight": "lm_head.weight"}
    layer: ClassVar[dict] = {
        **{k: v.replace("mixer.", "mamba.") for k, v in MambaArch.layer.items() if k != "attn_norm.weight"},
        "ssm_dt_norm.weight": "mamba.dt_layernorm.weight", "ssm_b_norm.weight": "mamba.b_layernorm.weight",
        "ssm_c_norm.weight": "mamba.c_layernorm.weight",
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "pre_ff_layernorm.weight",
        **SELF_ATTN,
        "ffn_gate.weight": "feed_forward.gate_proj.weight", "ffn_up.weight": "feed_forward.up_proj.weight",
        "ffn_down.weight": "feed_forward.down_proj.weight", "ffn_gate_inp.weight": "feed_forward.router.weight",
        # stacked experts: one checkpoint tensor per expert ({e}), split on loading, stacked on writing
        "ffn_gate_exps.weight": "feed_forward.experts.{e}.gate_proj.weight",
        "ffn_up_exps.weight": "feed_forward.experts.{e}.up_proj.weight",
        "ffn_down_exps.weight": "feed_forward.experts.{e}.down_proj.weight"}

    @staticmethod
    def to_hf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        return MambaArch.to_hf(name, t, c) if ".mamba." in name else t

    @staticmethod
    def to_gguf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        return MambaArch.to_gguf(name, t, c) if ".mamba." in name else t

    @classmethod
    def gguf_tensors(cls, tensors: dict, c: dict) -> dict:
        """Checkpoint -> GGUF tensors, each expert's matrices stacked (E, ...) as the converter does."""
        return stack_experts(cls, tensors, c)

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        from subquad.models.hf.jamba import attention_period

        a = cls.arch
        n, d = _get(meta, a, "block_count"), _get(meta, a, "embedding_length")
        heads = _get(meta, a, "attention.head_count")
        kv = _head_count_kv(meta, a, n)
        attn = [i for i, k in enumerate(kv) if k]
        moe = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
        experts = meta.get(f"{a}.expert_count", 0)
        if moe and experts < 2:
            raise ValueError(f"GGUF metadata {a}.expert_count={experts}, but blocks {moe} have experts")
        layout = {}
        for what, idx in (("attn", attn), ("expert", moe)):
            po = attention_period(idx, n) if idx else None
            if po is None and idx:
                raise ValueError(f"GGUF file of architecture {a!r}: the {what} layers {idx} are not every k-th layer "
                                 f"from an offset, which Jamba's config ({what}_layer_period / _offset) requires")
            layout[what] = po
        inner = _get(meta, a, "ssm.inner_size")
        if inner % d:
            raise ValueError(f"GGUF metadata {a}.ssm.inner_size={inner} is not a multiple of embedding_length={d}")
        ssm = next((i for i, k in enumerate(kv) if k == 0), None)
        c = {"model_type": "jamba", "hidden_size": d, "num_hidden_layers": n, "num_attention_heads": heads,
             "num_key_value_heads": max(kv) or heads, "intermediate_size": _get(meta, a, "feed_forward_length"),
             "attn_layer_period": layout["attn"][0] if attn else n + 1,
             "attn_layer_offset": layout["attn"][1] if attn else n,
             "num_experts": experts if moe else 1, "num_experts_per_tok": meta.get(f"{a}.expert_used_count", 1),
             "expert_layer_period": layout["expert"][0] if moe else 1,
             "expert_layer_offset": layout["expert"][1] if moe else 0,
             "mamba_d_state": _get(meta, a, "ssm.state_size"), "mamba_d_conv": _get(meta, a, "ssm.conv_kernel"),
             "mamba_expand": inner // d, "mamba_dt_rank": _get(meta, a, "ssm.time_step_rank"),
             "mamba_conv_bias": ssm is None or f"blk.{ssm}.ssm_conv1d.bias" in tensors, "mamba_proj_bias": False,
             "rms_norm_eps": float(_get(meta, a, "attention.layer_norm_rms_epsilon")), "hidden_act": "silu",
             "attention_bias": False, "tie_word_embeddings": "output.weight" not in tensors}
        return c

    @classmethod
    def meta(cls, c: dict) -> dict:
        """JambaModel.set_gguf_parameters for the config ``save_pretrained`` writes."""
        n, off, per = c["num_hidden_layers"], c["attn_layer_offset"], c["attn_layer_period"]
        kv = c.get("num_key_value_heads") or c["num_attention_heads"]
        return {"block_count": n, "context_length": c.get("max_position_embeddings", 262144),
                "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
                "attention.head_count": c["num_attention_heads"],
                "attention.head_count_kv": [kv if i >= off and (i - off) % per == 0 else 0 for i in range(n)],
                "ssm.conv_kernel": c["mamba_d_conv"], "ssm.inner_size": c["mamba_expand"] * c["hidden_size"],
                "ssm.state_size": c["mamba_d_state"], "ssm.time_step_rank": c["mamba_dt_rank"],
                "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]), "expert_count": c["num_experts"],
                "expert_used_count": c["num_experts_per_tok"]}


class NemotronHMoeArch(NemotronHArch):
    """``nemotron_h_moe`` - Hugging Face ``nemotron_h`` with mixture-of-experts layers (Nemotron 3; NemotronHModel
    with ``is_moe``, which the converter sets when the config has ``num_experts_per_tok``). As ``nemotron_h``
    (``NemotronHArch``), but a layer with ``feed_forward_length[i]`` > 0 is "E": ungated squared-ReLU experts,
    ``ffn_{up,down}_exps`` the per-expert checkpoint tensors stacked (E, ...), ``ffn_gate_inp`` the router
    (sigmoid, DeepSeek-V3's grouped top-k: ``expert_group_count`` groups, the best ``expert_group_used_count``
    of them by their two best scores, ``exp_probs_b`` the score-correction bias to choose), weights renormalised
    if ``expert_weights_norm`` and times ``expert_weights_scale``; the shared expert ``ffn_{up,down}_shexp``;
    with ``moe_latent_size`` the experts' latent projections ``ffn_latent_down`` / ``ffn_latent_up``.
    ``feed_forward_length[i]`` is the expert width (``expert_feed_forward_length``). Dense "-" layers have no
    place in this architecture (llama.cpp reads every MLP layer of it as experts, and the converter counts only
    "E"): a config with both is refused by name."""
    arch = "nemotron_h_moe"
    MLP = "E"
    layer: ClassVar[dict] = {
        **{k: v for k, v in NemotronHArch.layer.items() if k not in ("ffn_up.weight", "ffn_down.weight")},
        "ffn_gate_inp.weight": "mixer.gate.weight", "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
        "ffn_up_exps.weight": "mixer.experts.{e}.up_proj.weight",
        "ffn_down_exps.weight": "mixer.experts.{e}.down_proj.weight",
        "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
        "ffn_latent_down.weight": "mixer.fc1_latent_proj.weight",
        "ffn_latent_up.weight": "mixer.fc2_latent_proj.weight"}

    @classmethod
    def gguf_tensors(cls, tensors: dict, c: dict) -> dict:
        return stack_experts(cls, tensors, c)

    @classmethod
    def _moe(cls, meta: dict, ff: list) -> dict:
        a = cls.arch
        out = {"n_routed_experts": _get(meta, a, "expert_count"),
               "num_experts_per_tok": _get(meta, a, "expert_used_count"),
               "moe_intermediate_size": meta.get(f"{a}.expert_feed_forward_length", max(ff)),
               "moe_shared_expert_intermediate_size": _get(meta, a, "expert_shared_feed_forward_length"),
               "n_group": meta.get(f"{a}.expert_group_count", 1),
               "topk_group": meta.get(f"{a}.expert_group_used_count", 1),
               "routed_scaling_factor": float(meta.get(f"{a}.expert_weights_scale", 1.0)),
               "norm_topk_prob": bool(meta.get(f"{a}.expert_weights_norm", False))}
        if f"{a}.moe_latent_size" in meta:
            out["moe_latent_size"] = meta[f"{a}.moe_latent_size"]
        return out

    @classmethod
    def meta(cls, c: dict) -> dict:
        """NemotronHModel.set_gguf_parameters with ``is_moe``: TextModel's expert keys, then the per-layer
        feed_forward_length of the expert width and the MoE keys."""
        pattern = c["hybrid_override_pattern"]
        if "-" in pattern:
            raise ValueError(f"nemotron_h with both dense ('-') and MoE ('E') layers (hybrid_override_pattern="
                             f"{pattern!r}): llama.cpp's nemotron_h_moe reads every MLP layer as experts")
        out = super().meta(c)
        width = c["moe_intermediate_size"]
        out.update({"feed_forward_length": [width if ch == "E" else 0 for ch in pattern],
                    "expert_count": c["n_routed_experts"], "expert_used_count": c["num_experts_per_tok"],
                    "expert_group_count": c.get("n_group", 1), "expert_group_used_count": c.get("topk_group", 1),
                    "expert_feed_forward_length": width,
                    "expert_shared_feed_forward_length": c["moe_shared_expert_intermediate_size"],
                    "expert_shared_count": c.get("n_shared_experts", 1),
                    "expert_weights_norm": bool(c.get("norm_topk_prob", True)),
                    "expert_weights_scale": float(c.get("routed_scaling_factor", 1.0))})
        if c.get("moe_latent_size") is not None:
            out["moe_latent_size"] = c["moe_latent_size"]
        return out
