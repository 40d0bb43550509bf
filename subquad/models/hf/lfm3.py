"""``lfm3`` (Lfm3ForCausalLM, Liquid AI's LFM3): LFM2's gated short convolutions (``gated_conv``) beside two kinds
of attention layer as ``layer_types`` says - "sliding_attention" (``swa``: the last ``sliding_window`` keys, the
query's own among them, so subquad's window is sliding_window - 1) and "full_attention" (``softmax``) - each with
RMS norms on each head's q and k, grouped kv heads of ``head_dim`` and, with ``use_attention_gate``, one sigmoid
gate per head from the layer's input (``g_proj``: attention's ``head_gate``); every layer is followed by a SwiGLU
(w1, w3, w2 of ``intermediate_size``). With ``use_sandwich_norm`` every block norms both branches' outputs too
(``ModelConfig.sandwich_norm``). The final norm is ``embedding_norm``.

Rotary is per attention kind (``rope_parameters`` keyed by layer type). "default" rotates every dim (LFM3 reads
no ``partial_rotary_factor`` there). "proportional" (the released full-attention layers': theta 1e6, factor 0.5)
rotates r = int(factor head_dim / 2) pairs (i, i + head_dim / 2), i < r, at theta^(-2i / head_dim), the other
pairs not at all. That is subquad's partial rotary of the leading 2r dims, pairs (i, i + r) at base^(-i / r),
once each head's dims are reordered [0, r) + [hd/2, hd/2 + r) + the rest and base = theta^(2r / head_dim): the
reorder applies to the rows of q_proj and k_proj and to q_norm and k_norm (scores are sums over all dims, and an
RMS norm's statistic ignores the order) - ``unpack`` reorders, ``pack`` restores.
"""

from __future__ import annotations

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import TOP, W132, Format, require, swiglu

LAYER_TYPES = {"conv": "gated_conv", "sliding_attention": "swa", "full_attention": "softmax"}
ROPE_DEFAULT = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                                   "partial_rotary_factor": 0.5}}
ID_DEFAULTS = {"pad_token_id": 124_893, "bos_token_id": 124_894, "eos_token_id": 124_900}
ATTENTION = {"mixer.g_proj.weight": "self_attn.gate_proj.weight", "mixer.{p}": "self_attn.{p}"}   # the file's name


def default_types(n: int) -> list:
    """transformers' default ``layer_types``: full attention at i % 4 == 2, sliding at i % 4 == 0 (i > 0)."""
    return ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
            for i in range(n)]


def _rope(c: dict, kind: str, head_dim: int) -> dict:
    """The attention options of one kind's ``rope_parameters``: rotary_base and rotary_fraction (module doc)."""
    ropes = c.get("rope_parameters") or ROPE_DEFAULT
    rope = ropes.get(kind) if isinstance(ropes, dict) else None
    if not isinstance(rope, dict):
        raise ValueError(f"config field rope_parameters.{kind} is missing: LFM3 keys rotary by attention layer type")
    kind_type, theta = rope.get("rope_type", "default"), float(rope.get("rope_theta", 10_000.0))
    if kind_type == "default":
        return {"rotary": True, "rotary_base": theta, "rotary_fraction": 1.0}
    if kind_type != "proportional":
        raise ValueError(f"config field rope_parameters.{kind}.rope_type={kind_type!r} is not supported (subquad "
                         "implements 'default' and 'proportional')")
    if float(rope.get("factor", 1.0)) != 1.0:
        raise ValueError(f"config field rope_parameters.{kind}.factor={rope['factor']} is not supported (subquad "
                         "implements proportional rotary without scaling, factor 1.0)")
    r = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    if head_dim % 2:
        raise ValueError(f"config field head_dim={head_dim} must be even for rotary")
    if r == 0:
        return {"rotary": False}
    return {"rotary": True, "rotary_base": theta ** (2 * r / head_dim), "rotary_fraction": 2 * r / head_dim}


def _order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Each head's dims in subquad's order (module doc): [0, r) + [hd/2, hd/2 + r) + [r, hd/2) + [hd/2 + r, hd)."""
    r, half = rotary_dim // 2, head_dim // 2
    return torch.cat([torch.arange(r), torch.arange(half, half + r), torch.arange(r, half),
                      torch.arange(half + r, head_dim)])


def _reorder(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """A per-head tensor ((heads x hd, ...) rows, or a norm's (hd,) weight) with each head's dims in ``order``."""
    hd = len(order)
    return t[order] if t.dim() == 1 else t.unflatten(0, (-1, hd))[:, order].flatten(0, 1)


def _proportional_layers(cfg: ModelConfig) -> list:
    """[(attention layer, its dims' reorder)] for the layers whose rotary is proportional and partial (module doc)."""
    out = []
    for name in ("swa", "softmax"):
        a = cfg.mixer_options.get(name)
        if a is None or not a.get("rotary", True) or a.get("rotary_fraction", 1.0) == 1.0:
            continue
        hd = a.get("head_dim") or cfg.d_model // cfg.n_heads
        order = _order(hd, int(hd * a["rotary_fraction"]))
        out += [(i, order) for i, n in enumerate(cfg.layers) if n == name]
    return out


PERMUTED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")


class Lfm3Format(Format):
    model_type = "lfm3"
    gates_and_sandwich = True
    top = {**TOP, "norm.weight": "model.embedding_norm.weight"}
    layers = {"gated_conv": {"mixer.{p}": "conv.{p}"}, "softmax": ATTENTION, "swa": ATTENTION,
              "*": {"norm1.weight": "operator_norm.weight", "norm2.weight": "ffn_norm.weight",
                    "post_norm1.weight": "post_operator_norm.weight", "post_norm2.weight": "post_ffn_norm.weight",
                    **swiglu("mlp.", "feed_forward.", W132)}}

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "attention_bias", False)
        n, eps = c["num_hidden_layers"], c.get("norm_eps", 1e-5)
        types = c.get("layer_types")
        types = default_types(n) if types is None else types
        if not isinstance(types, list) or len(types) != n or set(types) - set(LAYER_TYPES):
            raise ValueError(f"config field layer_types={types!r} must name 'conv', 'sliding_attention' or "
                             f"'full_attention' for each of the num_hidden_layers={n} layers")
        conv_size = dict.get(c, "conv_L_cache", 7)
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 1:
            raise ValueError(f"config field conv_L_cache must be a positive int, got {conv_size!r}")
        H, heads = c["hidden_size"], c.get("num_attention_heads", 16)
        hd = c.get("head_dim") or 128
        gate, sandwich = c.get("use_attention_gate", True), c.get("use_sandwich_norm", True)
        attn = {"head_dim": hd, "qk_norm": "head", "qk_norm_eps": eps, "head_gate": gate}
        options = {"gated_conv": {"conv_size": conv_size, "bias": c.get("conv_bias", False)}}
        if "sliding_attention" in types:
            window = c.get("sliding_window", 256)
            if window is None or window < 1:        # transformers' sliding layers need one too
                raise ValueError(f"config field sliding_window={window} must be a positive int (the layer_types "
                                 "name sliding_attention layers)")
            options["swa"] = {**attn, **_rope(c, "sliding_attention", hd), "window": window - 1}
        if "full_attention" in types:
            options["softmax"] = {**attn, **_rope(c, "full_attention", hd)}
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=n, n_heads=heads,
                           n_kv_heads=c.get("num_key_value_heads", 4), pattern=",".join(LAYER_TYPES[t] for t in types),
                           mlp=True, mlp_size=c.get("intermediate_size", 7680), norm_eps=eps,
                           tie_embeddings=c.get("tie_word_embeddings", True), context_length=1 << 20,
                           mixer_options=options, sandwich_norm=sandwich)

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """Proportional rotary's attention layers: each head's q, k dims reordered (module doc)."""
        out = dict(tensors)
        for i, order in _proportional_layers(cfg):
            for part in PERMUTED:
                name = f"model.layers.{i}.{part}"
                if name in out:
                    if out[name].shape[0] % len(order):
                        raise ValueError(f"lfm3: {name} has shape {tuple(out[name].shape)}, not heads of head_dim="
                                         f"{len(order)}")
                    out[name] = _reorder(out[name], order)
        return out

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        out = dict(tensors)
        for i, order in _proportional_layers(cfg):
            for part in PERMUTED:
                out[f"model.layers.{i}.{part}"] = _reorder(out[f"model.layers.{i}.{part}"], torch.argsort(order))
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        a = opts.get("swa") or opts.get("softmax") or {"head_dim": 128, "head_gate": True}
        kinds = {"swa": "sliding_attention", "softmax": "full_attention"}
        rope = {}
        for name, kind in kinds.items():
            o = opts.get(name)
            if o is None:
                continue
            f = o["rotary_fraction"] if o["rotary"] else 0.0
            if f == 1.0:
                rope[kind] = {"rope_type": "default", "rope_theta": o["rotary_base"]}
            else:                                   # proportional: theta from subquad's base (module doc)
                theta = 1.0 if f == 0.0 else float(f"{o['rotary_base'] ** (1 / f):.12g}")
                rope[kind] = {"rope_type": "proportional", "rope_theta": theta, "partial_rotary_factor": f}
        sw = opts.get("swa", {}).get("window")
        ids = {k: None for k, d in ID_DEFAULTS.items() if d >= cfg.vocab_size}     # Lfm3Config's, out of range
        return {**ids, "model_type": "lfm3", "architectures": ["Lfm3ForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
                "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "head_dim": a["head_dim"],
                "layer_types": [{v: k for k, v in LAYER_TYPES.items()}[n] for n in cfg.layers],
                "intermediate_size": cfg.mlp_hidden, "norm_eps": cfg.norm_eps,
                "conv_L_cache": opts["gated_conv"]["conv_size"], "conv_bias": opts["gated_conv"]["bias"],
                "sliding_window": 256 if sw is None else sw + 1, "use_attention_gate": a["head_gate"],
                "use_sandwich_norm": cfg.sandwich_norm, "attention_bias": False,
                "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope}

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        attn = [opts[n] for n in ("swa", "softmax") if n in opts]

        def ok(a, windowed):
            return (a["qk_norm"] == "head" and a["qk_norm_eps"] == cfg.norm_eps and not a["output_gate"]
                    and not a["o_bias"] and a["scale"] is None and a["d_out"] is None
                    and (a["window"] is not None) == windowed and a["head_gate"] == attn[0]["head_gate"]
                    and a["head_dim"] == attn[0]["head_dim"])

        return (set(cfg.layers) <= set(LAYER_TYPES.values()) and cfg.mlp and cfg.moe is None
                and cfg.mlp_kind == "swiglu" and cfg.mlp_layers is None and cfg.pos_emb == "none"
                and not cfg.post_norm and cfg.scaled_residual is None and not cfg.parallel and cfg.shared is None
                and cfg.norm == "rms" and not cfg.embed_norm
                and all(ok(opts[n], n == "swa") for n in ("swa", "softmax") if n in opts)
                and (not attn or attn[0]["head_dim"] % 2 == 0))
