"""llama.cpp's ``minimax-01`` (MiniMax-Text-01 / MiniMax-M1) against the Hugging Face checkpoint ``models.hf``
reads (``hf/minimax.py``: transformers' ``minimax``), as llama.cpp's converter writes it (``conversion/minimax.py``:
MiniMaxText01Model, a TextModel; gguf-py's ``tensor_mapping.py``) and its C++ runs it (``src/models/minimax-01.cpp``).
The table follows ``arch.py``'s (``top`` / ``layer``, ``to_hf`` / ``to_gguf``, ``config`` / ``meta``) and
``hybrid.py``'s hooks (``gguf_tensors``; a ``{e}`` name is one checkpoint tensor per expert).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from subquad.models.gguf.arch import LLAMA_TOP, SELF_ATTN, _get, hf_name

INTERVAL = 8        # llama.cpp's full_attention_interval when a file names no layout: every 8th layer attends
DERIVED = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")    # the lightning layers' buffers


def _layer(h: str) -> int:
    return int(h.split(".")[2])


def default_layout(n: int) -> list:
    """The layer types llama.cpp assumes for a file without ``attention.recurrent_layers``."""
    return ["full_attention" if (i + 1) % INTERVAL == 0 else "linear_attention" for i in range(n)]


class MiniMax01Arch:
    """``minimax-01`` (MiniMaxText01Model): lightning-attention layers (``attn_qkv`` - per head [q, k, v], as the
    checkpoint's ``qkv_proj`` -, ``attn_gate`` the output gate, ``attn_norm_2`` the norm over all heads,
    ``attn_output`` the out_proj) and softmax layers (``attn_q/k/v/output``: GQA, NeoX rotary over
    ``rope.dimension_count`` dims), each followed by a softmax-routed, renormalised mixture of ``expert_count``
    experts (``ffn_gate_inp``; each expert's w1 / w3 / w2 stacked as ``ffn_{gate,up,down}_exps``). No reshapes.

        residual      the converter writes one ``residual_scale`` (all three alphas, which it asserts equal, the
                      betas 1): llama.cpp adds alpha x the normed stream to each branch's output, as transformers'
                      MiniMax with factors (alpha, 1)
        slopes        not in the file: llama.cpp derives them from the head count and depth, as transformers does
                      (``layers.lightning.slopes``; llama.cpp's depth factor 1 - l / (L - 1) + 1e-5 lacks
                      transformers' 1e-5 in the denominator, a 1e-5 relative difference); the checkpoint's
                      ``slope_rate`` and its derived decays are dropped on writing (checked against the
                      derivation first) and rebuilt on reading
        layout        which layers attend is read off the tensors (``attn_qkv``: lightning); the converter writes
                      no layout and llama.cpp then assumes every 8th layer attends (MiniMax-Text-01's) unless
                      ``attention.recurrent_layers`` says otherwise - which ``save_gguf`` writes for any other
                      layout (the converter's file of such a model does not load in llama.cpp); a file's stated
                      layout must agree with its tensors

    Where llama.cpp computes another model than transformers (not refusable - the file cannot say it): the
    lightning layers' output norm takes ``attention.layer_norm_rms_epsilon`` in llama.cpp, transformers' and
    subquad's a fixed 1e-6. Refused by name on reading: a rotary part other than the whole head
    (``rope.dimension_count`` != ``key_length``: transformers' MiniMax, and subquad's, rotate the whole head; the
    released MiniMax-Text-01 rotates 64 of 128 dims); on writing: residual factors llama.cpp cannot hold, a
    single-layer model (llama.cpp's depth factor divides by L - 1)."""
    arch = "minimax-01"
    hf_layer = "model.layers.{i}."
    top: ClassVar[dict] = LLAMA_TOP
    layer: ClassVar[dict] = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        **SELF_ATTN,                             # attn_output: o_proj; a lightning layer's out_proj (hf_name_for)
        "attn_qkv.weight": "self_attn.qkv_proj.weight", "attn_gate.weight": "self_attn.output_gate.weight",
        "attn_norm_2.weight": "self_attn.norm.weight", "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
        # stacked experts: one checkpoint tensor per expert ({e}), split on loading, stacked on writing
        "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
        "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
        "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight"}

    @staticmethod
    def to_hf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        return t

    @staticmethod
    def to_gguf(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
        return t

    @classmethod
    def hf_name_for(cls, g: str, c: dict) -> str:
        """The checkpoint name of GGUF tensor ``g`` in the model of config ``c``: a lightning layer's
        ``attn_output`` is its ``out_proj``."""
        h = hf_name(cls, g)
        if h.endswith(".self_attn.o_proj.weight") and c["layer_types"][_layer(h)] == "linear_attention":
            return h.replace(".o_proj.", ".out_proj.")
        return h

    @classmethod
    def regroup(cls, tensors: dict, c: dict) -> dict:
        """The lightning layers' slopes, which the file does not hold (class doc), as the checkpoint's (H, 1, 1)."""
        from subquad.layers.lightning import slopes

        n, H = c["num_hidden_layers"], c["num_attention_heads"]
        return {**tensors, **{f"model.layers.{i}.self_attn.slope_rate": slopes(H, i, n).float().view(H, 1, 1)
                              for i, t in enumerate(c["layer_types"]) if t == "linear_attention"}}

    @classmethod
    def gguf_tensors(cls, tensors: dict, c: dict) -> dict:
        """Checkpoint -> GGUF tensors: the derived buffers dropped (the slopes checked against llama.cpp's
        derivation), out_proj written as attn_output, each expert's matrices stacked (E, ...)."""
        from subquad.layers.lightning import slopes
        from subquad.models.gguf.hybrid import stack_experts

        n, H = c["num_hidden_layers"], c["num_attention_heads"]
        kept = {}
        for h, t in tensors.items():
            if h.endswith("self_attn.slope_rate"):
                want = slopes(H, _layer(h), n)
                if not torch.allclose(t.double().reshape(-1), want, rtol=1e-6, atol=0):
                    raise ValueError(f"{cls.arch}: {h} is not MiniMax's slopes for layer {_layer(h)} of {n} with "
                                     f"{H} heads, which llama.cpp derives (the file holds none)")
            if h.rpartition(".")[2] in DERIVED:
                continue
            kept[h.replace(".self_attn.out_proj.", ".self_attn.o_proj.")] = t
        return stack_experts(cls, kept, c)

    @classmethod
    def config(cls, meta: dict, tensors: dict) -> dict:
        a = cls.arch
        n, d = _get(meta, a, "block_count"), _get(meta, a, "embedding_length")
        heads = _get(meta, a, "attention.head_count")
        kv = _get(meta, a, "attention.head_count_kv", heads)
        if isinstance(kv, list):                   # llama.cpp takes an array too: one count here
            if len(kv) != n or len(set(kv)) != 1:
                raise ValueError(f"GGUF metadata {a}.attention.head_count_kv={kv} must give the {n} layers one count")
            kv = kv[0]
        hd = _get(meta, a, "attention.key_length", d // heads)
        rot = _get(meta, a, "rope.dimension_count", hd)
        if _get(meta, a, "attention.value_length", hd) != hd or rot != hd:
            raise ValueError(f"GGUF metadata {a}.rope.dimension_count={rot}, attention.value_length="
                             f"{meta.get(f'{a}.attention.value_length')}: subquad's MiniMax (transformers') rotates "
                             f"whole heads of key_length={hd} = value_length")
        types = ["linear_attention" if f"blk.{i}.attn_qkv.weight" in tensors else "full_attention" for i in range(n)]
        stated = meta.get(f"{a}.attention.recurrent_layers")
        if stated is None and f"{a}.full_attention_interval" in meta:
            k = meta[f"{a}.full_attention_interval"]
            stated = [(i + 1) % k != 0 for i in range(n)]
        if stated is not None and [bool(s) for s in stated] != [t == "linear_attention" for t in types]:
            raise ValueError(f"GGUF metadata {a}.attention.recurrent_layers={list(stated)} (or full_attention_interval)"
                             f" disagrees with the file's tensors, whose lightning layers (attn_qkv) are "
                             f"{[i for i, t in enumerate(types) if t == 'linear_attention']}")
        alpha = float(_get(meta, a, "residual_scale"))
        return {"model_type": "minimax", "hidden_size": d, "num_hidden_layers": n, "num_attention_heads": heads,
                "num_key_value_heads": kv, "head_dim": hd, "layer_types": types,
                "intermediate_size": _get(meta, a, "feed_forward_length"),
                "num_local_experts": _get(meta, a, "expert_count"),
                "num_experts_per_tok": _get(meta, a, "expert_used_count"),
                "rms_norm_eps": float(_get(meta, a, "attention.layer_norm_rms_epsilon")), "hidden_act": "silu",
                "rope_parameters": {"rope_type": "default", "rope_theta": float(_get(meta, a, "rope.freq_base", 1e6))},
                **{f"{k}_alpha_factor": alpha for k in ("linear_attn", "full_attn", "mlp")},
                **{f"{k}_beta_factor": 1.0 for k in ("linear_attn", "full_attn", "mlp")},
                "tie_word_embeddings": "output.weight" not in tensors}

    @classmethod
    def meta(cls, c: dict) -> dict:
        """TextModel's and MiniMaxText01Model's metadata for the released config of the model ``c`` describes
        (its ``head_dim`` and ``rotary_dim`` the head), + ``attention.recurrent_layers`` for a layout other than
        llama.cpp's default (class doc)."""
        n = c["num_hidden_layers"]
        alphas = {c.get(f"{k}_alpha_factor", 1) for k in ("linear_attn", "full_attn", "mlp")}
        betas = {c.get(f"{k}_beta_factor", 1) for k in ("linear_attn", "full_attn", "mlp")}
        if len(alphas) != 1 or betas != {1}:
            raise ValueError(f"{cls.arch}: llama.cpp's minimax-01 holds one residual_scale (linear_attn_, full_attn_ "
                             f"and mlp_alpha_factor equal) and beta factors 1; this model has alphas "
                             f"{sorted(alphas)}, betas {sorted(betas)}")
        if n < 2:
            raise ValueError(f"{cls.arch}: llama.cpp scales the slopes by 1 - l / (L - 1): it needs "
                             f"num_hidden_layers >= 2, this model has {n}")
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        m = {"block_count": n, "context_length": c.get("max_position_embeddings", 131072),
             "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
             "attention.head_count": c["num_attention_heads"],
             "attention.head_count_kv": c.get("num_key_value_heads") or c["num_attention_heads"],
             "rope.freq_base": float(c["rope_parameters"]["rope_theta"]),
             "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
             "expert_count": c["num_local_experts"], "expert_used_count": c["num_experts_per_tok"],
             "attention.key_length": hd, "attention.value_length": hd,
             "residual_scale": float(alphas.pop()), "rope.dimension_count": hd}
        if c["layer_types"] != default_layout(n):
            m["attention.recurrent_layers"] = [t == "linear_attention" for t in c["layer_types"]]
        return m


MINIMAX_ARCHS = (MiniMax01Arch,)
MINIMAX_HF_TYPES = {"minimax": MiniMax01Arch}
