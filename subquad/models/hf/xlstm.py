"""``xlstm`` (xLSTMForCausalLM; xLSTM-7B, NX-AI): pre-norm blocks of RMSNorm -> mLSTM layer (``layers.mlstm``) and
RMSNorm -> SwiGLU (``proj_up_gate``, ``proj_up``, ``proj_down``), a final RMSNorm, an untied head and logits
soft-capped: cap tanh(logits / cap).

The config's sizes: q and k are int(hidden_size * qk_dim_factor) wide, v int(hidden_size * v_dim_factor) (the
layer's own widths; transformers' ``qk_dim`` property rounds up to 64, which only its cache uses), the SwiGLU
round_up(hidden_size * ffn_proj_factor, ffn_round_up_to_multiple_of) wide. ``weight_mode="fused"`` folders hold
q, k, v and the output gate in one ``qkv_opreact`` and the two gates in one ``ifgate_preact``, and the SwiGLU's
two input projections in one ``proj_up_gate_z``: ``unpack`` splits them, and a folder is written back unfused
("single"). The kernel fields (``chunkwise_kernel``, ``sequence_kernel``, ``step_kernel``, ``mode``,
``autocast_kernel_dtype``, ``inference_state_dtype``, ``max_inference_chunksize``) choose how transformers or
NX-AI's package computes the same mLSTM and are read as such. ``use_bias`` puts biases on every projection but the
gates' (which always have one), the per-head norm, the SwiGLU and the blocks' RMS norms - not the final norm
(``ModelConfig.norm_bias``, ``mlp_bias`` and the layer's ``bias``). Refused by name: ``add_out_norm=false``
(transformers keeps the final norm whatever it says; NX-AI's package drops it).
"""

from __future__ import annotations

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import Format, config_float, require

KERNEL_FIELDS = ("chunkwise_kernel", "sequence_kernel", "step_kernel", "mode", "autocast_kernel_dtype",
                 "inference_state_dtype", "max_inference_chunksize", "return_last_states",
                 "norm_reduction_force_float32")
LAYER = "mlstm_layer."


def round_up(x: float, multiple: int) -> int:
    """xLSTM's ``round_up_to_next_multiple_of``."""
    return int(((x + multiple - 1) // multiple) * multiple)


def _one_of(c: dict, a: str, b: str):
    """A size the config may give under two names (transformers fills both); they must agree."""
    va, vb = c.get(a), c.get(b)
    if va is not None and vb is not None and va != vb:
        raise ValueError(f"config fields {a}={va} and {b}={vb} must agree")
    if va is None and vb is None:
        raise ValueError(f"config.json: the required field {a} (or {b}) is missing")
    return va if va is not None else vb


def _positive(c: dict, key: str, default):
    v = c.get(key, default)
    v = None if v is None else config_float(v)
    if v is not None and not v > 0:
        raise ValueError(f"config field {key}={v!r} must be a positive number")
    return v


class XLSTMFormat(Format):
    model_type = "xlstm"
    top = {"embed.weight": "backbone.embeddings.weight", "norm.weight": "backbone.out_norm.weight",
           "head.weight": "lm_head.weight"}
    layer = "backbone.blocks.{i}."
    layers = {"mlstm": {"mixer.q_proj.{p}": LAYER + "q.{p}", "mixer.k_proj.{p}": LAYER + "k.{p}",
                        "mixer.v_proj.{p}": LAYER + "v.{p}", "mixer.o_gate.{p}": LAYER + "ogate_preact.{p}",
                        "mixer.i_proj.{p}": LAYER + "igate_preact.{p}", "mixer.f_proj.{p}": LAYER + "fgate_preact.{p}",
                        "mixer.norm.{p}": LAYER + "multihead_norm.{p}", "mixer.out_proj.{p}": LAYER + "out_proj.{p}"},
              "*": {"norm1.{p}": "norm_mlstm.{p}", "norm2.{p}": "norm_ffn.{p}",
                    "mlp.w_gate.{p}": "ffn.proj_up_gate.{p}", "mlp.w_up.{p}": "ffn.proj_up.{p}",
                    "mlp.w_down.{p}": "ffn.proj_down.{p}"}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "add_out_norm", True)
        bias = c.get("use_bias", False)
        weight_mode = c.get("weight_mode", "single")
        if weight_mode not in ("single", "fused"):
            raise ValueError(f"config field weight_mode={weight_mode!r} must be 'single' or 'fused'")
        D = _one_of(c, "hidden_size", "embedding_dim")
        n = _one_of(c, "num_hidden_layers", "num_blocks")
        H = c.get("num_heads", 8)
        fk, fv = _positive(c, "qk_dim_factor", 0.5), _positive(c, "v_dim_factor", 1.0)
        for name, f in (("qk_dim_factor", fk), ("v_dim_factor", fv)):
            width = int(D * f)
            if width < H or width % H:
                raise ValueError(f"config field {name}={f}: int(hidden_size * {name}) = {width} must be a positive "
                                 f"multiple of num_heads={H}")
        multiple = c.get("ffn_round_up_to_multiple_of", 64)
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"config field ffn_round_up_to_multiple_of={multiple!r} must be a positive int")
        chunk = c.get("chunk_size", 64)
        if chunk < 1:
            raise ValueError(f"config field chunk_size={chunk!r} must be a positive int")
        mlstm = {"expand_k": fk, "expand_v": fv, "gate_soft_cap": _positive(c, "gate_soft_cap", 15.0),
                 "eps": _positive(c, "eps", 1e-6), "norm_eps": _positive(c, "norm_eps", 1e-6), "chunk_size": chunk,
                 "bias": bias}
        return ModelConfig(vocab_size=c["vocab_size"], d_model=D, n_layers=n, n_heads=H, pattern="mlstm", mlp=True,
                           mlp_size=round_up(D * _positive(c, "ffn_proj_factor", 2.667), multiple), mlp_bias=bias,
                           norm_bias=bias,
                           norm_eps=mlstm["norm_eps"], tie_embeddings=c.get("tie_word_embeddings", False),
                           context_length=1 << 20, logit_soft_cap=_positive(c, "output_logit_soft_cap", 30.0),
                           mixer_options={"mlstm": mlstm})

    @classmethod
    def plain(cls, cfg: ModelConfig, opts: dict) -> bool:
        return True                                   # its options are its own: ``matches`` checks them

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """A fused folder's tensors split into the single-mode names (module doc)."""
        o = cfg.mixer_options["mlstm"]
        qk, v, H, F = int(cfg.d_model * o["expand_k"]), int(cfg.d_model * o["expand_v"]), cfg.n_heads, cfg.mlp_hidden
        fused = {LAYER + "qkv_opreact": (("q", "k", "v", "ogate_preact"), [qk, qk, v, v]),
                 LAYER + "ifgate_preact": (("igate_preact", "fgate_preact"), [H, H]),
                 "ffn.proj_up_gate_z": (("proj_up_gate", "proj_up"), [F, F])}
        out = {}
        for name, t in tensors.items():
            head, _, tail = name.rpartition(".")               # tail: weight or bias
            key = next((k for k in fused if head.endswith(k)), None)
            if key is None:
                out[name] = t
                continue
            parts, sizes = fused[key]
            if t.shape[0] != sum(sizes):
                raise ValueError(f"weight {name} has {t.shape[0]} rows, the config implies {sum(sizes)}")
            base = head.removesuffix(key.rpartition(".")[2])
            for part, piece in zip(parts, torch.split(t, sizes)):
                out[f"{base}{part}.{tail}"] = piece.clone()      # its own storage, not a view of the fused one
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o = opts["mlstm"]
        return {"model_type": "xlstm", "architectures": ["xLSTMForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "embedding_dim": cfg.d_model, "num_hidden_layers": cfg.n_layers,
                "num_blocks": cfg.n_layers, "num_heads": cfg.n_heads, "use_bias": o["bias"], "add_out_norm": True,
                "norm_eps": cfg.norm_eps, "qk_dim_factor": o["expand_k"], "v_dim_factor": o["expand_v"],
                "gate_soft_cap": o["gate_soft_cap"], "output_logit_soft_cap": cfg.logit_soft_cap, "eps": o["eps"],
                "chunk_size": o["chunk_size"], "ffn_proj_factor": cfg.mlp_hidden / cfg.d_model,
                # round_up(d_model * factor, m) gives mlp_hidden back whatever the float's last bit
                "ffn_round_up_to_multiple_of": 64 if cfg.mlp_hidden % 64 == 0 else cfg.mlp_hidden,
                "weight_mode": "single",
                "tie_word_embeddings": cfg.tie_embeddings}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        o = opts.get("mlstm")
        return (set(cfg.layers) == {"mlstm"} and o["bias"] == cfg.mlp_bias == cfg.norm_bias
                and o["norm_eps"] == cfg.norm_eps and o["n_heads"] == cfg.n_heads and cfg.mlp and cfg.moe is None
                and cfg.mlp_kind == "swiglu" and cfg.mlp_layers is None and cfg.embed_scale is None and cfg.pos_emb == "none"
                and cfg.norm == "rms" and not cfg.embed_norm and not cfg.post_norm and cfg.scaled_residual is None)
