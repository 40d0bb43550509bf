"""llama.cpp's ``lfm2moe`` and ``rwkv7`` against the Hugging Face checkpoints ``models.hf`` reads (``hf/lfm2.py``'s
``lfm2_moe``, ``hf/rwkv7.py``'s fla layout), as llama.cpp's converter writes them (``conversion/lfm2.py``:
LFM2MoeModel; ``conversion/rwkv.py``: Rwkv7Model; gguf-py's ``tensor_mapping.py``; the loaders
``src/models/lfm2moe.cpp``, ``rwkv7.cpp``). The tables follow ``arch.py``'s and ``qwen.py``'s (``top`` /
``layer``, ``to_hf`` / ``to_gguf``, ``config`` / ``meta``, ``regroup`` / ``split``); each class's docstring states
its reshapes.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch

from subquad.models.gguf.arch import Lfm2Arch, _get

SIGMOID = 2          # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (``expert_gating_func``)
LFM2_EXPERT = re.compile(r"(.*\.feed_forward\.experts\.)(\d+)\.(w1|w2|w3)\.weight$")


class Lfm2MoeArch(Lfm2Arch):
    """``lfm2moe`` (LFM2MoeModel): LFM2's layers (``lfm2``'s names and its one reshape, the (C, 1, k) convolution
    squeezed to (C, k)); the first ``leading_dense_block_count`` layers with a dense SwiGLU of
    ``feed_forward_length``, the rest ``expert_count`` experts of ``expert_feed_forward_length``: each expert's
    w1 / w3 / w2 stacked to (E, I, d) / (E, I, d) / (E, d, I) as ``ffn_gate_exps`` / ``ffn_up_exps`` /
    ``ffn_down_exps``, the router ``feed_forward.gate`` as ``ffn_gate_inp``, ``expert_bias`` as
    ``exp_probs_b.bias``.

    llama.cpp always routes by sigmoid (``expert_gating_func`` 2, anything else refused) with the expert bias
    and renormalises the chosen weights, unscaled - the converter writes neither ``norm_topk_prob`` nor
    ``routed_scaling_factor`` - so a file loads with ``norm_topk_prob`` true and ``routed_scaling_factor`` 1, and
    ``save_gguf`` refuses, by name, a model with other values (llama.cpp would run it otherwise), or with a
    convolution bias (llama.cpp's lfm2moe has no ``shortconv.conv.bias``). An untied head is read and written as
    ``output.weight`` (llama.cpp's loader takes it; gguf-py's lfm2moe tensor list lacks it, so its converter
    writes tied checkpoints only)."""
    arch = "lfm2moe"
    layer: ClassVar[dict] = {**Lfm2Arch.layer, "ffn_gate_inp.weight": "feed_forward.gate.weight",
                             "exp_probs_b.bias": "feed_forward.expert_bias",
                             # stacked: no ".weight"; ``regroup`` splits them into one tensor per expert
                             "ffn_gate_exps.weight": "feed_forward.experts.w1",
                             "ffn_up_exps.weight": "feed_forward.experts.w3",
                             "ffn_down_exps.weight": "feed_forward.experts.w2"}

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        c = super().config(meta, tensors)
        gating = _get(meta, a, "expert_gating_func")
        if gating != SIGMOID:
            raise ValueError(f"GGUF metadata {a}.expert_gating_func={gating}: LFM2-MoE routes by sigmoid "
                             f"({SIGMOID})")
        n = c["num_hidden_layers"]
        dense = meta.get(f"{a}.leading_dense_block_count", 0)
        if not isinstance(dense, int) or not 0 <= dense <= n:
            raise ValueError(f"GGUF metadata {a}.leading_dense_block_count={dense} must be in [0, {n}]")
        ff_exp = _get(meta, a, "expert_feed_forward_length")
        if isinstance(ff_exp, list):            # llama.cpp takes a per-layer array too: one width here
            if len(set(ff_exp[dense:])) > 1:
                raise ValueError(f"GGUF metadata {a}.expert_feed_forward_length={ff_exp}: subquad's experts have one "
                                 f"width")
            ff_exp = ff_exp[-1]
        c.pop("block_auto_adjust_ff_dim")
        return {**c, "model_type": "lfm2_moe", "num_dense_layers": dense,
                "num_experts": _get(meta, a, "expert_count"), "num_experts_per_tok": _get(meta, a, "expert_used_count"),
                "moe_intermediate_size": ff_exp, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
                "use_expert_bias": True}

    @classmethod
    def meta(cls, c: dict) -> dict:
        for key, ok in (("norm_topk_prob", True), ("routed_scaling_factor", 1.0), ("conv_bias", False)):
            if c.get(key, ok) != ok:
                raise ValueError(f"{cls.arch}: llama.cpp's lfm2moe holds {key}={ok} only; this model has "
                                 f"{key}={c[key]}")
        m = super().meta(c)
        return {**m, "expert_count": c["num_experts"], "expert_used_count": c["num_experts_per_tok"],
                "expert_feed_forward_length": c["moe_intermediate_size"],
                "leading_dense_block_count": c["num_dense_layers"], "expert_gating_func": SIGMOID}

    @classmethod
    def regroup(cls, tensors: dict, c: dict) -> dict:
        """(E, ...) stacks -> one tensor per expert, ``feed_forward.experts.{e}.w*.weight``."""
        out = {}
        for name, t in tensors.items():
            if name.endswith(("feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3")):
                p, _, w = name.rpartition(".")
                out.update({f"{p}.{e}.{w}.weight": x for e, x in enumerate(t.unbind(0))})
            else:
                out[name] = t
        return out

    @classmethod
    def split(cls, tensors: dict, c: dict) -> dict:
        """``regroup``'s inverse (the converter's stacking: experts in order, dim 0)."""
        out, stacks = {}, {}
        for name, t in tensors.items():
            m = LFM2_EXPERT.match(name)
            if m:
                stacks.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = t
            else:
                out[name] = t
        for name, parts in stacks.items():
            out[name] = torch.stack([parts[e] for e in range(len(parts))])
        return out


MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")      # the lerp order of time_mix_lerp_fused (Rwkv7Model's)
GROUP_NORM_EPS = 64e-5   # llama.cpp's ln_x epsilon, fixed (rwkv7-base.cpp); fla's is head_dim x norm_eps


class Rwkv7Arch:
    """``rwkv7`` (Rwkv7Model, fla-hub's RWKV7ForCausalLM layout): LayerNorms with biases (``token_embd_norm`` is
    layer 0's ``pre_norm``, ``attn_norm_2`` the channel mix's ``ffn_norm``, ``time_mix_ln`` the per-head GroupNorm
    ``g_norm``), the time mix as ``time_mix_*``, the channel mix as ``channel_mix_*``. The converter's rewrites:

        lerps        ``attn.x_r`` .. ``attn.x_g``, each (1, 1, D), stacked in that order to (6, 1, 1, D):
                     ``time_mix_lerp_fused`` (``regroup`` / ``split``)
        LoRAs        fla's ``{w,a,v,g}_lora.lora.0.weight`` (r, D) / ``lora.2.weight`` (D, r) / ``lora.2.bias`` (D)
                     as ``time_mix_{w,a,v,g}1`` / ``2`` / ``0``, not transposed (fla's are Linear weights already);
                     the decay's w1 / w2 and the lerps always F32
        r_k          (H, head) flattened to (D,); every other tensor squeezed (``channel_mix_lerp_k`` (D,))
        layer 0      has no value-residual LoRA (fla writes none); the converter writes a0 / a1 / a2 again as
                     v0 / v1 / v2 there for llama.cpp's loader, which never uses them: dropped on reading,
                     written back so
        metadata     ``wkv.head_size``, the four LoRA ranks, ``attention.layer_norm_epsilon``, ``head_count`` 0

    llama.cpp norms ``ln_x`` with 64e-5 whatever the metadata; fla (and a file read here) with head_size x
    layer_norm_epsilon - equal for every released RWKV-7 (head 64, 1e-5); ``save_gguf`` refuses a model where
    they differ, by name. The head is untied (llama.cpp requires ``output.weight``)."""
    arch = "rwkv7"
    vocab_size_key = False               # Rwkv7Model writes no rwkv7.vocab_size (written without a token list)
    hf_layer = "model.layers.{i}."
    top: ClassVar[dict] = {"token_embd.weight": "model.embeddings.weight",
                           "token_embd_norm.weight": "model.layers.0.pre_norm.weight",
                           "token_embd_norm.bias": "model.layers.0.pre_norm.bias",
                           "output_norm.weight": "model.norm.weight", "output_norm.bias": "model.norm.bias",
                           "output.weight": "lm_head.weight"}
    layer: ClassVar[dict] = {
        "attn_norm.weight": "attn_norm.weight", "attn_norm.bias": "attn_norm.bias",
        "attn_norm_2.weight": "ffn_norm.weight", "attn_norm_2.bias": "ffn_norm.bias",
        "time_mix_ln.weight": "attn.g_norm.weight", "time_mix_ln.bias": "attn.g_norm.bias",
        "time_mix_lerp_fused.weight": "attn.x_fused",                # ``regroup``: x_r .. x_g
        "time_mix_k_k.weight": "attn.k_k", "time_mix_k_a.weight": "attn.k_a", "time_mix_r_k.weight": "attn.r_k",
        "time_mix_receptance.weight": "attn.r_proj.weight", "time_mix_key.weight": "attn.k_proj.weight",
        "time_mix_value.weight": "attn.v_proj.weight", "time_mix_output.weight": "attn.o_proj.weight",
        **{f"time_mix_{n}1.weight": f"attn.{n}_lora.lora.0.weight" for n in "wavg"},
        **{f"time_mix_{n}2.weight": f"attn.{n}_lora.lora.2.weight" for n in "wavg"},
        **{f"time_mix_{n}0.weight": f"attn.{n}_lora.lora.2.bias" for n in "wav"},
        "channel_mix_lerp_k.weight": "ffn.x_k", "channel_mix_key.weight": "ffn.key.weight",
        "channel_mix_value.weight": "ffn.value.weight"}

    @staticmethod
    def to_hf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if name.endswith("attn.r_k"):
            return t.reshape(c["hidden_size"] // c["head_dim"], c["head_dim"])      # (D,) -> (H, head)
        return t

    @staticmethod
    def to_gguf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if name.endswith("attn.r_k"):
            return t.flatten()
        if name.endswith("attn.x_fused"):
            return t
        return t.squeeze() if t.dim() > 1 and 1 in t.shape else t        # the converter's squeeze

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        d, head = _get(meta, a, "embedding_length"), _get(meta, a, "wkv.head_size")
        if not isinstance(head, int) or head <= 0 or d % head:
            raise ValueError(f"GGUF metadata {a}.wkv.head_size={head} must divide {a}.embedding_length={d}")
        lerp = tensors.get("blk.0.time_mix_lerp_fused.weight")
        if lerp is not None and list(lerp.shape)[0] != len(MIXES):
            raise ValueError(f"GGUF tensor blk.0.time_mix_lerp_fused.weight has {list(lerp.shape)[0]} lerps: subquad's "
                             f"RWKV-7 has a gate ({len(MIXES)}: r, w, k, v, a, g)")
        return {"model_type": "rwkv7", "hidden_size": d, "num_hidden_layers": _get(meta, a, "block_count"),
                "head_dim": head, "num_heads": d // head,
                "decay_low_rank_dim": _get(meta, a, "attention.decay_lora_rank"),
                "a_low_rank_dim": _get(meta, a, "attention.iclr_lora_rank"),
                "v_low_rank_dim": _get(meta, a, "attention.value_residual_mix_lora_rank"),
                "gate_low_rank_dim": _get(meta, a, "attention.gate_lora_rank"),
                "intermediate_size": _get(meta, a, "feed_forward_length"), "hidden_act": "sqrelu",
                "norm_first": True, "norm_bias": True, "norm_eps": float(_get(meta, a, "attention.layer_norm_epsilon")),
                "attn": None, "tie_word_embeddings": "output.weight" not in tensors}

    @classmethod
    def meta(cls, c: dict) -> dict:
        from subquad.layers.rwkv7 import default_ranks

        d, head = c["hidden_size"], c["head_dim"]
        if abs(head * c["norm_eps"] - GROUP_NORM_EPS) > 1e-12:
            raise ValueError(f"{cls.arch}: llama.cpp norms ln_x with {GROUP_NORM_EPS}; this model's head_dim x "
                             f"norm_eps is {head} x {c['norm_eps']}")
        if c.get("tie_word_embeddings"):
            raise ValueError(f"{cls.arch}: llama.cpp's rwkv7 needs an untied head; this model has "
                             f"tie_word_embeddings=True")
        r = default_ranks(d, head)
        ranks = {k: c.get(f) or r[rk] for k, f, rk in (
            ("decay", "decay_low_rank_dim", "decay_rank"), ("iclr", "a_low_rank_dim", "a_rank"),
            ("value_residual_mix", "v_low_rank_dim", "v_rank"), ("gate", "gate_low_rank_dim", "gate_rank"))}
        return {"context_length": 1048576, "embedding_length": d, "block_count": c["num_hidden_layers"],
                "attention.layer_norm_epsilon": float(c["norm_eps"]), "wkv.head_size": head,
                **{f"attention.{k}_lora_rank": v for k, v in ranks.items()},
                "feed_forward_length": c["intermediate_size"], "attention.head_count": 0}

    @classmethod
    def regroup(cls, tensors: dict, c: dict) -> dict:
        """``x_fused`` (6, 1, 1, D) -> x_r .. x_g, each (1, 1, D); layer 0's v0 / v1 / v2 (copies of a's) dropped."""
        out = {}
        for name, t in tensors.items():
            if name.endswith("attn.x_fused"):
                p = name.removesuffix("x_fused")
                out.update({p + m: x.reshape(1, 1, -1) for m, x in zip(MIXES, t.reshape(len(MIXES), -1))})
            elif not name.startswith("model.layers.0.attn.v_lora."):
                out[name] = t
        return out

    @classmethod
    def split(cls, tensors: dict, c: dict) -> dict:
        """``regroup``'s inverse: the lerps stacked, layer 0's a LoRA written again as its v LoRA."""
        out = {}
        for name, t in tensors.items():
            p, _, leaf = name.rpartition(".")
            if leaf in MIXES and p.endswith(".attn"):
                if leaf == MIXES[0]:
                    out[p + ".x_fused"] = torch.stack([tensors[f"{p}.{m}"] for m in MIXES])
                continue
            if name.startswith("model.layers.0.attn.a_lora."):
                out[name.replace("a_lora", "v_lora")] = t              # before a's, as the converter yields them
            out[name] = t
        return out


MORE_ARCHS = (Lfm2MoeArch, Rwkv7Arch)
# the Hugging Face model_type each is written from
MORE_HF_TYPES = {"lfm2_moe": Lfm2MoeArch, "rwkv7": Rwkv7Arch}
