"""llama.cpp's ``lfm2moe``, ``rwkv7`` and ``kimi-linear`` against the Hugging Face checkpoints ``models.hf`` reads
(``hf/lfm2.py``'s ``lfm2_moe``, ``hf/rwkv7.py``'s fla layout, ``hf/kimi_linear.py``), as llama.cpp's converter
writes them (``conversion/lfm2.py``: LFM2MoeModel; ``conversion/rwkv.py``: Rwkv7Model;
``conversion/kimi_linear.py``: KimiLinearModel; gguf-py's ``tensor_mapping.py``; the loaders
``src/models/lfm2moe.cpp``, ``rwkv7.cpp``, ``kimi-linear.cpp``). The tables follow ``arch.py``'s and
``qwen.py``'s (``top`` / ``layer``, ``to_hf`` / ``to_gguf``, ``config`` / ``meta``, ``regroup`` / ``split``); each
class's docstring states its reshapes.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch

from subquad.models.gguf.arch import LLAMA_TOP, SELF_ATTN, Lfm2Arch, _get

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
    ``save_gguf`` refuses, by name, a model with other values (llama.cpp would compute another model), or with a
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
    writes_vocab_size = False            # Rwkv7Model writes no rwkv7.vocab_size (written without a token list)
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

    @staticmethod
    def unused(name: str) -> bool:
        """Layer 0's v0 / v1 / v2 (the converter's copies of a's): dropped by ``regroup``, not named as dequantised."""
        return name.startswith("model.layers.0.attn.v_lora.")

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


KIMI_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(w1|w2|w3)\.weight$")


class KimiLinearArch:
    """``kimi-linear`` (KimiLinearModel): Kimi Delta Attention layers (``head_count_kv`` 0) and multi-head latent
    attention layers (``head_count_kv`` 1: the converter's MQA form of MLA), a dense SwiGLU in the first
    ``leading_dense_block_count`` layers, then DeepSeek-V3 experts (sigmoid router with ``exp_probs_b``,
    renormalised, times ``expert_weights_scale``) and a shared expert. The converter's rewrites:

        KDA convs    ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (C, 1, k) as (1, C, 1, k): ``ssm_conv1d_{q,k,v}``
        A_log        (1, 1, H, 1) written as A = -exp(A_log) (``ssm_a``); dt_bias as ``ssm_dt.bias``
        kv_b_proj    (H (nope + v), R) split per head: ``attn_k_b`` = k_b transposed, (H, R, nope), and
                     ``attn_v_b`` (H, v, R) (``regroup`` / ``split``)
        experts      w1 / w3 / w2 stacked to (E, I, d) / (E, I, d) / (E, d, I): ``ffn_{gate,up,down}_exps``
        router bias  ``e_score_correction_bias`` as ``exp_probs_b.bias``

    The converter reads the released config's spelling (``linear_attn_config``, ``first_k_dense_replace``,
    ``moe_router_activation_func``); a file loads as transformers' ``kimi_linear`` config. What llama.cpp's loader
    cannot hold is refused by name on writing: KDA heads other than ``num_attention_heads`` (it takes both from
    ``head_count``), grouped routing (its files carry no group count), ``moe_renormalize`` false, dense layers that
    do not lead, a low-rank q (``q_lora_rank``: the converter writes ``attn_q_a`` / ``attn_q_b`` /
    ``attn_q_a_norm`` and ``attention.q_lora_rank``, which subquad reads, but llama.cpp's kimi-linear reads no
    q_lora_rank and multiplies by ``attn_q`` only). MLA rotates nothing, in llama.cpp as in transformers'
    Kimi-Linear."""
    arch = "kimi-linear"
    hf_layer = "model.layers.{i}."
    top: ClassVar[dict] = LLAMA_TOP
    layer: ClassVar[dict] = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        **SELF_ATTN,
        **{f"ssm_conv1d_{x}.weight": f"self_attn.{x}_conv1d.weight" for x in "qkv"},
        **{f"ssm_{x}.weight": f"self_attn.{x}_proj.weight" for x in ("f_a", "f_b", "g_a", "g_b")},
        "ssm_beta.weight": "self_attn.b_proj.weight", "ssm_a": "self_attn.A_log", "ssm_dt.bias": "self_attn.dt_bias",
        "ssm_norm.weight": "self_attn.o_norm.weight",
        "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_k_b.weight": "self_attn.kv_b_proj.k_b", "attn_v_b.weight": "self_attn.kv_b_proj.v_b",    # ``regroup``
        # the MLPs under "mlp." (``models.hf``'s unpack renames transformers' block_sparse_moe so; quantised
        # projections are kept in blocks only where the name is the format's own)
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
        "ffn_gate_exps.weight": "mlp.experts.w1", "ffn_up_exps.weight": "mlp.experts.w3",
        "ffn_down_exps.weight": "mlp.experts.w2"}

    @staticmethod
    def to_hf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if name.endswith("A_log"):
            return torch.log(-t)
        if name.endswith("_conv1d.weight"):
            return t.reshape(t.shape[1], 1, t.shape[-1])                 # (1, C, 1, k) -> (C, 1, k)
        return t

    @staticmethod
    def to_gguf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        if name.endswith("A_log"):
            return -torch.exp(t)
        if name.endswith("_conv1d.weight"):
            return t.reshape(1, t.shape[0], 1, t.shape[-1])
        return t

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        n = _get(meta, a, "block_count")
        kv = _get(meta, a, "attention.head_count_kv")
        kv = kv if isinstance(kv, list) else [kv] * n
        if len(kv) != n or set(kv) - {0, 1}:
            raise ValueError(f"GGUF metadata {a}.attention.head_count_kv={kv} must give each of the {n} layers 0 (KDA) "
                             f"or 1 (MLA)")
        gating = _get(meta, a, "expert_gating_func")
        if gating != SIGMOID:
            raise ValueError(f"GGUF metadata {a}.expert_gating_func={gating}: Kimi-Linear routes by sigmoid "
                             f"({SIGMOID})")
        dense = meta.get(f"{a}.leading_dense_block_count", 0)
        if not isinstance(dense, int) or not 0 <= dense <= n:
            raise ValueError(f"GGUF metadata {a}.leading_dense_block_count={dense} must be in [0, {n}]")
        groups = meta.get(f"{a}.expert_group_count", 1)     # llama.cpp's generic keys; the converter writes the
        # used count (topk_group) only
        heads, rope = _get(meta, a, "attention.head_count"), _get(meta, a, "rope.dimension_count")
        kv_rank, k_mla = _get(meta, a, "attention.kv_lora_rank"), _get(meta, a, "attention.key_length_mla")
        if _get(meta, a, "attention.key_length", kv_rank + rope) != kv_rank + rope or k_mla <= rope:
            raise ValueError(f"GGUF metadata {a}.attention.key_length={meta.get(f'{a}.attention.key_length')} must be "
                             f"kv_lora_rank + rope.dimension_count = {kv_rank + rope}, and key_length_mla={k_mla} more "
                             f"than rope.dimension_count={rope}")
        return {"model_type": "kimi_linear", "hidden_size": _get(meta, a, "embedding_length"), "num_hidden_layers": n,
                "num_attention_heads": heads, "num_key_value_heads": heads,
                "layer_types": ["full_attention" if k else "linear_attention" for k in kv],
                "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(n)],
                "intermediate_size": _get(meta, a, "feed_forward_length"),
                "linear_num_heads": heads, "linear_head_dim": _get(meta, a, "kda.head_dim"),
                "linear_conv_kernel_dim": _get(meta, a, "ssm.conv_kernel"),
                "kv_lora_rank": kv_rank, "q_lora_rank": meta.get(f"{a}.attention.q_lora_rank"),
                "qk_rope_head_dim": rope, "qk_nope_head_dim": k_mla - rope,
                "v_head_dim": _get(meta, a, "attention.value_length_mla"),
                "rms_norm_eps": float(_get(meta, a, "attention.layer_norm_rms_epsilon")), "hidden_act": "silu",
                "attention_bias": False, "tie_word_embeddings": "output.weight" not in tensors,
                "num_experts": _get(meta, a, "expert_count"),
                "num_experts_per_token": _get(meta, a, "expert_used_count"),
                "moe_intermediate_size": _get(meta, a, "expert_feed_forward_length"),
                "num_shared_experts": _get(meta, a, "expert_shared_count"), "num_expert_group": groups,
                "topk_group": meta.get(f"{a}.expert_group_used_count", groups),
                "routed_scaling_factor": float(meta.get(f"{a}.expert_weights_scale") or 1.0),
                "moe_renormalize": True}

    @classmethod
    def meta(cls, c: dict) -> dict:
        n, heads = c["num_hidden_layers"], c["num_attention_heads"]
        rope, kv_rank = c["qk_rope_head_dim"], c["kv_lora_rank"]
        dense = c["mlp_layer_types"].count("dense")
        problems = [f"{k}={c.get(k)}" for k, bad in (
            ("linear_num_heads", c["linear_num_heads"] != heads),
            ("num_expert_group", c.get("num_expert_group", 1) != c.get("topk_group", 1)),
            ("moe_renormalize", not c.get("moe_renormalize", True)),
            ("q_lora_rank", c.get("q_lora_rank") is not None),
            ("mlp_layer_types", c["mlp_layer_types"] != ["dense"] * dense + ["sparse"] * (n - dense))) if bad]
        if problems:
            raise ValueError(f"{cls.arch}: llama.cpp's kimi-linear holds KDA heads = num_attention_heads={heads}, "
                             f"ungrouped routing, renormalised top-k, leading dense layers and a full-rank q "
                             f"only; this model has {', '.join(problems)}")
        m = {"block_count": n, "context_length": c.get("model_max_length", 1048576),
             "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
             "attention.head_count": heads,
             "attention.head_count_kv": [1 if t == "full_attention" else 0 for t in c["layer_types"]],
             "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
             "expert_count": c["num_experts"], "expert_used_count": c["num_experts_per_token"],
             "expert_gating_func": SIGMOID, "expert_group_used_count": c.get("topk_group", 1),
             # the converter reads config.json through transformers, whose head_dim is qk_rope_head_dim: written as
             # value_length (llama.cpp's kimi-linear reads the _mla lengths)
             "attention.value_length": rope, "ssm.conv_kernel": c["linear_conv_kernel_dim"],
             "kda.head_dim": c["linear_head_dim"]}
        m.update({"attention.kv_lora_rank": kv_rank, "rope.dimension_count": rope,
                  "attention.key_length": kv_rank + rope, "attention.key_length_mla": c["qk_nope_head_dim"] + rope,
                  "attention.value_length_mla": c["v_head_dim"],
                  "expert_feed_forward_length": c["moe_intermediate_size"],
                  "expert_shared_count": c["num_shared_experts"], "leading_dense_block_count": dense,
                  "expert_weights_scale": float(c["routed_scaling_factor"])})
        return m

    @classmethod
    def regroup(cls, tensors: dict, c: dict) -> dict:
        """k_b (H, R, nope) and v_b (H, v, R) -> kv_b_proj (H (nope + v), R); stacked experts -> one per expert."""
        out = {}
        for name, t in tensors.items():
            if name.endswith("kv_b_proj.k_b"):
                p = name.removesuffix("k_b")
                v = tensors.get(p + "v_b")
                if v is None:                 # half a pair (load's probe of the quantised ones): not kept as is
                    continue
                out[p + "weight"] = torch.cat([t.transpose(1, 2), v], 1).reshape(-1, t.shape[1])
            elif name.endswith("kv_b_proj.v_b"):
                continue
            elif name.endswith(("mlp.experts.w1", "mlp.experts.w2",
                                "mlp.experts.w3")):
                p, _, w = name.rpartition(".")
                out.update({f"{p}.{e}.{w}.weight": x for e, x in enumerate(t.unbind(0))})
            else:
                out[name] = t
        return out

    @classmethod
    def split(cls, tensors: dict, c: dict) -> dict:
        """``regroup``'s inverse, as KimiLinearModel.modify_tensors splits and stacks."""
        out, stacks = {}, {}
        H, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
        for name, t in tensors.items():
            name = name.replace(".block_sparse_moe.", ".mlp.")       # as the tables name them (unpack's names)
            m = KIMI_EXPERT.match(name)
            if m:
                stacks.setdefault(m.group(1) + m.group(3), {})[int(m.group(2))] = t
            elif name.endswith("kv_b_proj.weight"):
                p = name.removesuffix("weight")
                k_b, v_b = t.reshape(H, nope + v, t.shape[-1]).split([nope, v], 1)
                out[p + "k_b"], out[p + "v_b"] = k_b.transpose(1, 2).contiguous(), v_b.contiguous()
            else:
                out[name] = t
        for name, parts in stacks.items():
            out[name] = torch.stack([parts[e] for e in range(len(parts))])
        return out


MORE_ARCHS = (Lfm2MoeArch, Rwkv7Arch, KimiLinearArch)
# the Hugging Face model_type each is written from
MORE_HF_TYPES = {"lfm2_moe": Lfm2MoeArch, "rwkv7": Rwkv7Arch, "kimi_linear": KimiLinearArch}
