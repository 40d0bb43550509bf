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


MORE_ARCHS = (Lfm2MoeArch,)
# the Hugging Face model_type each is written from
MORE_HF_TYPES = {"lfm2_moe": Lfm2MoeArch}
