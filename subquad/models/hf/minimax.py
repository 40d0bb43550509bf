"""``minimax`` (MiniMaxForCausalLM, MiniMax-Text-01's architecture).

Lightning-attention layers (``layers/lightning.py``) and softmax layers (GQA, rotary) as ``layer_types``
says, each followed by a top-k softmax-routed mixture of experts (renormalised, in every layer); blocks with
MiniMax's scaled residual from the normed stream (``linear_attn_alpha_factor`` / ``beta``, ``full_attn_*``,
``mlp_*``; ``ModelConfig.scaled_residual``).

The checkpoint carries the lightning layers' decay buffers: ``slope_rate`` (H, 1, 1) loads into the layer's
slopes, and the block-wise factors derived from it (``query_decay``, ``key_decay``, ``diagonal_decay``) are
checked against them and rebuilt on saving.
"""

from __future__ import annotations

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import (W132, Format, check_layer_types, check_rope_type, experts, require,
                                      transformer_config)

_DERIVED = ("query_decay", "key_decay", "diagonal_decay")
_BLOCK = 256                                         # transformers' default block_size, written on saving


def _decay_buffers(slope: torch.Tensor, block: int) -> dict:
    """transformers' block-wise decay factors from the slopes (H,), as MiniMaxLightningAttention builds them."""
    s = slope.double().view(-1, 1, 1)
    r = torch.arange(block, dtype=torch.float64) + 1
    diag = s * (r[:, None] - r[None, :])[None]
    diag = torch.exp(torch.where(diag >= 0, -diag, float("-inf")))
    return {"query_decay": torch.exp(-s * r[:, None]), "key_decay": torch.exp(-s * (block - r[:, None])),
            "diagonal_decay": diag[None]}


class MiniMaxFormat(Format):
    model_type = "minimax"
    layers = {"lightning": {"mixer.slope": "self_attn.slope_rate",
                            "mixer.{p}": "self_attn.{p}"},
              "softmax": {"mixer.{p}": "self_attn.{p}"},
              "*": {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
                    **experts("mlp.", "block_sparse_moe.", "gate.weight", W132)}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "hidden_act", "silu")
        require(c, "sliding_window", None)
        require(c, "router_jitter_noise", 0.0)
        n, eps = c["num_hidden_layers"], c.get("rms_norm_eps", 1e-5)
        types = check_layer_types(
            c.get("layer_types") or ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)], n)
        rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 1e6)}
        check_rope_type(rope)
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        factors = {"lightning": [c.get("linear_attn_alpha_factor", 1), c.get("linear_attn_beta_factor", 1)],
                   "softmax": [c.get("full_attn_alpha_factor", 1), c.get("full_attn_beta_factor", 1)],
                   "mlp": [c.get("mlp_alpha_factor", 1), c.get("mlp_beta_factor", 1)]}
        moe = {"experts": c.get("num_local_experts", 8), "top_k": c.get("num_experts_per_tok", 2), "renormalize": True,
               "aux_loss_coef": c.get("router_aux_loss_coef", 0.001)}
        pattern = ",".join("softmax" if t == "full_attention" else "lightning" for t in types)
        return transformer_config(c, pattern, eps, moe=moe, scaled_residual=factors,
                       mixer_options={"lightning": {"head_dim": hd},
                                      "softmax": {"head_dim": hd, "rotary_base": float(rope.get("rope_theta", 1e6))}})

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """slope_rate (H, 1, 1) -> (H,); the derived decay buffers must agree with it, then go."""
        out = {}
        for name, t in tensors.items():
            if name.endswith("self_attn.slope_rate"):
                out[name] = t.reshape(-1)
            elif name.endswith(_DERIVED):
                continue
            else:
                out[name] = t
        for name, t in tensors.items():
            if name.endswith("self_attn.query_decay"):
                p = name.removesuffix("query_decay")
                want = _decay_buffers(out[p + "slope_rate"], t.shape[1])
                for d in _DERIVED:
                    got = tensors.get(p + d)
                    if got is not None and not torch.allclose(got.double(), want[d], rtol=1e-4, atol=1e-6):
                        raise ValueError(f"weight {p + d} disagrees with {p}slope_rate: subquad derives the decays "
                                         "from the slopes and cannot load a checkpoint whose buffers differ")
        return out

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        out = {}
        for name, t in tensors.items():
            if name.endswith("self_attn.slope_rate"):
                out[name] = t.view(-1, 1, 1)
                p = name.removesuffix("slope_rate")
                out.update({p + d: x.to(t.dtype) for d, x in _decay_buffers(t, _BLOCK).items()})
            else:
                out[name] = t
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        sr, m, li = cfg.scaled_residual, cfg.moe, opts["lightning"]
        a = opts.get("softmax", {"rotary_base": 1e6})
        return {"model_type": "minimax", "architectures": ["MiniMaxForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "intermediate_size": m["hidden"] or cfg.mlp_hidden,
                "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
                "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "head_dim": li["head_dim"],
                "layer_types": ["full_attention" if n == "softmax" else "linear_attention" for n in cfg.layers],
                "block_size": _BLOCK, "num_local_experts": m["experts"], "num_experts_per_tok": m["top_k"],
                "router_aux_loss_coef": m["aux_loss_coef"], "router_jitter_noise": 0.0, "rms_norm_eps": cfg.norm_eps,
                "hidden_act": "silu", "sliding_window": None, "tie_word_embeddings": cfg.tie_embeddings,
                "rope_parameters": {"rope_type": "default", "rope_theta": a["rotary_base"]},
                "linear_attn_alpha_factor": sr.get("lightning", [1, 1])[0],
                "linear_attn_beta_factor": sr.get("lightning", [1, 1])[1],
                "full_attn_alpha_factor": sr.get("softmax", [1, 1])[0], "full_attn_beta_factor": sr.get("softmax", [1, 1])[1],
                "mlp_alpha_factor": sr.get("mlp", [1, 1])[0], "mlp_beta_factor": sr.get("mlp", [1, 1])[1],
                "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        if not (set(cfg.layers) <= {"lightning", "softmax"} and "lightning" in cfg.layers):
            return False
        li, a, m = opts["lightning"], opts.get("softmax"), cfg.moe
        every = m is not None and len(cfg.moe_layers) == cfg.n_layers
        return (cfg.mlp and cfg.pos_emb == "none" and not cfg.post_norm and cfg.scaled_residual is not None and every
                and m["router"] == "softmax" and m["renormalize"] and not m["shared"] and m["scale"] == 1.0
                and li["norm_eps"] == 1e-6 and li["n_heads"] == cfg.n_heads
                and (a is None or (a["rotary"] and a["rotary_fraction"] == 1.0 and a["qk_norm"] is None
                                   and not a["output_gate"] and a["window"] is None and a["head_dim"] == li["head_dim"])))
