"""``zamba2`` (Zamba2ForCausalLM, Zyphra's Zamba2): Mamba-2 layers (the gated norm per group at eps 1e-5, dt
clamped from ``time_step_min``), and at the "hybrid" layers of ``layers_block_type`` a shared attention + MLP
block over [h, embeddings] whose output, projected by the layer's ``linear``, enters that layer's Mamba-2
input - subquad's shared blocks (``models.shared``, ``ModelConfig.shared``). Hybrid use j takes block
j mod ``num_mem_blocks``; its LoRA adapters (``adapter_rank``: on the MLP's fused gate/up always, on q, k, v
with ``use_shared_attention_adapter``) are its own. The attention has heads of 2 hidden_size /
num_attention_heads dims, scores scaled by (head_dim / 2)^-1/2, rotary with ``use_mem_rope``; the MLP is
gated by ``hidden_act``.

The checkpoint names a shared block under the first hybrid layer that uses it
(``model.layers.{L}.shared_transformer.*``), with every use's adapters in lists there (index j); the other
layers using it are transformers' aliases of those names. ``unpack`` reads them once (an alias must equal its
original: a checkpoint whose copies differ has no shared weights to load) and splits the fused gate/up;
``pack`` fuses it and writes every alias, as transformers' state dict names them. (transformers 5 ties the
aliases only with ``tie_word_embeddings``; untied, it loads each copy on its own - the same model while the
copies are equal, as every folder subquad writes has them.)
"""

from __future__ import annotations

import math
import re

import torch

from subquad.models.config import ModelConfig
from subquad.models.hf.common import Format, _rename, check_rope_type, config_float, json_float, require

MAMBA_NORM_EPS = 1e-5            # transformers' Zamba2 fixes the Mamba-2 gated norm's epsilon
LAYER_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}   # transformers' new and legacy names
ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}           # hidden_act -> SwiGLU's act
DEFAULT_TYPES = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3
                 + ["hybrid"] + ["mamba"] * 2)                                       # transformers' default (54)

TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.final_layernorm.weight",
       "head.weight": "lm_head.weight"}
MAMBA = {"norm1.weight": "input_layernorm.weight", "mixer.conv.{p}": "mamba.conv1d.{p}", "mixer.{p}": "mamba.{p}"}
SHARED = {"norm1.weight": "input_layernorm.weight", "attn.{p}": "self_attn.{p}",
          "norm2.weight": "pre_ff_layernorm.weight",
          "mlp.w_gate.weight": "feed_forward.gate_proj.weight", "mlp.w_up.weight": "feed_forward.up_proj.weight",
          "mlp.w_down.weight": "feed_forward.down_proj.weight"}        # gate_proj + up_proj: the fused gate_up_proj
ADAPTERS = {"use.q_adapter.{p}": "self_attn.linear_q_adapter_list.{j}.{p}",
            "use.k_adapter.{p}": "self_attn.linear_k_adapter_list.{j}.{p}",
            "use.v_adapter.{p}": "self_attn.linear_v_adapter_list.{j}.{p}",
            "use.mlp_adapter.{p}": "feed_forward.gate_up_proj_adapter_list.{j}.{p}"}


def layer_types(c: dict) -> list:
    """"mamba" or "hybrid" per layer, from ``layers_block_type`` (or transformers' default)."""
    types = c.get("layers_block_type")
    types = list(DEFAULT_TYPES) if types is None else types
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"config field layers_block_type={types!r} must name 'mamba' (or 'linear_attention') or "
                         "'hybrid' for each layer")
    n = c.get("num_hidden_layers")
    if n is not None and n != len(types):
        raise ValueError(f"config field layers_block_type names {len(types)} layers, num_hidden_layers={n}")
    return [LAYER_TYPES[t] for t in types]


def _uses(cfg: ModelConfig) -> tuple[dict, dict]:
    """({layer: (its use j, its block b)} for the layers that use a shared block, {block b: its first layer})."""
    s = cfg.shared
    if s is None:
        return {}, {}
    uses = {i: (j, j % s["blocks"]) for j, i in enumerate(s["layers"])}
    return uses, {b: s["layers"][b] for b in range(s["blocks"])}


class Zamba2Format(Format):
    model_type = "zamba2"
    shared_blocks = True
    shared_key = "shared_transformer"    # the shared block's module name under a hybrid layer (Zamba's: shared_transf)
    shared_names = SHARED
    fused_gate_up = True                 # the MLP's gate and up in one gate_up_proj (Zamba's: apart)

    @classmethod
    def _shared_name(cls) -> re.Pattern:
        return re.compile(rf"model\.layers\.(\d+)\.{cls.shared_key}\.(.+)")

    @staticmethod
    def config(c: dict) -> ModelConfig:
        require(c, "add_bias_linear", False)
        act = c.get("hidden_act", "gelu")
        if act not in ACTS:
            raise ValueError(f"config field hidden_act={act!r} is not supported (subquad implements "
                             f"{', '.join(ACTS)})")
        types = layer_types(c)
        H, heads = c["hidden_size"], c.get("num_attention_heads", 32)
        kv = c.get("num_key_value_heads") or heads
        if H % heads or heads % kv:
            raise ValueError(f"config field num_attention_heads={heads} must divide hidden_size={H}, and "
                             f"num_key_value_heads={kv} divide it")
        adapter, rank = c.get("use_shared_attention_adapter", False), c.get("adapter_rank", 128)
        if rank < 1:
            raise ValueError(f"config field adapter_rank={rank} must be at least 1")
        if adapter and kv != heads:
            raise ValueError(f"config field num_key_value_heads={kv} with use_shared_attention_adapter is not "
                             f"supported (transformers' k and v adapters write all {heads} heads)")
        E, mheads, groups = c.get("mamba_expand", 2), c.get("n_mamba_heads", 8), c.get("mamba_ngroups", 1)
        if E * H % mheads:
            raise ValueError(f"config field n_mamba_heads={mheads} must divide mamba_expand x hidden_size = {E * H}")
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or mheads % groups:
            raise ValueError(f"config field mamba_ngroups={groups!r} must divide n_mamba_heads={mheads}")
        m2 = {"d_state": c.get("mamba_d_state", 64), "head_dim": E * H // mheads, "expand": E,
              "conv_size": c.get("mamba_d_conv", 4), "n_groups": groups, "norm_eps": MAMBA_NORM_EPS,
              # transformers clamps dt to [time_step_min, inf) (its one-token step does not clamp)
              "dt_limit": (config_float(c.get("time_step_min", 0.001)), float("inf"))}
        rotary, theta = c.get("use_mem_rope", False), 10000.0
        if rotary:
            rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta", 10000.0)}
            check_rope_type(rope)
            theta = float(rope.get("rope_theta", 10000.0))
        hybrid = [i for i, t in enumerate(types) if t == "hybrid"]
        shared = None if not hybrid else {
            "layers": hybrid, "blocks": min(c.get("num_mem_blocks", 1), len(hybrid)),
            "hidden": c.get("intermediate_size") or 4 * H, "act": ACTS[act], "rotary": rotary, "rotary_base": theta,
            "scale": (2 * H // heads / 2) ** -0.5, "adapter_rank": rank, "attention_adapter": adapter}
        if shared is not None and shared["blocks"] < 1:
            raise ValueError(f"config field num_mem_blocks={c.get('num_mem_blocks')} must be at least 1")
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=len(types), n_heads=heads, n_kv_heads=kv,
                           pattern="mamba2", mlp=False, norm_eps=c.get("rms_norm_eps", 1e-5),
                           tie_embeddings=c.get("tie_word_embeddings", True), context_length=1 << 20,
                           mixer_options={"mamba2": m2}, shared=shared)

    @classmethod
    def names(cls, cfg: ModelConfig, shapes: dict) -> dict:
        """Each subquad name's checkpoint name (module doc): a shared weight and a use's adapters under the
        first layer that uses its block."""
        uses, first = _uses(cfg)
        out = {}
        for ours in shapes:
            part, _, rest = ours.partition(".")
            theirs = None
            if part in ("blocks", "shared"):
                k, _, rest = rest.partition(".")
                k = int(k)
                if part == "shared":
                    t = _rename(rest, cls.shared_names)
                    theirs = None if t is None else f"model.layers.{first[k]}.{cls.shared_key}.{t}"
                elif k in uses and rest == "use.proj.weight":
                    theirs = f"model.layers.{k}.linear.weight"
                elif k in uses and rest.startswith("use."):
                    j, b = uses[k]
                    t = _rename(rest, ADAPTERS)
                    theirs = None if t is None else f"model.layers.{first[b]}.{cls.shared_key}.{t}".replace(
                        "{j}", str(j))
                else:
                    t = _rename(rest, MAMBA)
                    theirs = None if t is None else f"model.layers.{k}.{'mamba_decoder.' if k in uses else ''}{t}"
            else:
                theirs = _rename(ours, TOP)
            if theirs is None:
                raise ValueError(f"{cls.model_type}: no checkpoint name for subquad's {ours}")
            out[ours] = theirs
        return out

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        """Aliases read once (each must equal the name it repeats), the fused gate/up split in two."""
        uses, first = _uses(cfg)
        out, pattern = {}, cls._shared_name()
        for name, t in tensors.items():
            m = pattern.fullmatch(name)
            if m and int(m[1]) in uses and first[uses[int(m[1])][1]] != int(m[1]):
                original = f"model.layers.{first[uses[int(m[1])][1]]}.{cls.shared_key}.{m[2]}"
                if original in tensors and not torch.equal(tensors[original], t):
                    raise ValueError(f"{cls.model_type}: {name} differs from {original}, the weight of the shared block it "
                                     "repeats: these layers do not share it (transformers unties copies that differ, "
                                     "and all of them with tie_word_embeddings=false); subquad loads one weight per "
                                     "shared block")
                name = original
            if cls.fused_gate_up and name.endswith(f"{cls.shared_key}.feed_forward.gate_up_proj.weight"):
                if t.shape[0] % 2:
                    raise ValueError(f"{cls.model_type}: {name} has shape {tuple(t.shape)}; it holds gate and up, an even "
                                     "number of rows")
                p = name.removesuffix("gate_up_proj.weight")
                out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t.chunk(2, 0)
            else:
                out[name] = t
        return out

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        """The gate/up fused, and every shared name repeated under each layer that uses its block."""
        uses, first = _uses(cfg)
        out, pattern = {}, cls._shared_name()
        for name, t in tensors.items():
            if cls.fused_gate_up and name.endswith("feed_forward.up_proj.weight"):
                continue
            if cls.fused_gate_up and name.endswith("feed_forward.gate_proj.weight"):
                p = name.removesuffix("gate_proj.weight")
                name, t = p + "gate_up_proj.weight", torch.cat([t, tensors[p + "up_proj.weight"]], 0)
            out[name] = t
            m = pattern.fullmatch(name)
            if m:
                b = uses[int(m[1])][1]
                for layer, (_, other) in uses.items():
                    if other == b and layer != first[b]:
                        out[f"model.layers.{layer}.{cls.shared_key}.{m[2]}"] = t.clone()
        return out

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        o, s = opts["mamba2"], cfg.shared
        layers = set() if s is None else set(s["layers"])
        out = {"model_type": "zamba2", "architectures": ["Zamba2ForCausalLM"], "vocab_size": cfg.vocab_size,
               "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
               "layers_block_type": ["hybrid" if i in layers else "mamba" for i in range(cfg.n_layers)],
               "mamba_d_state": o["d_state"], "mamba_d_conv": o["conv_size"], "mamba_expand": o["expand"],
               "mamba_ngroups": o["n_groups"], "n_mamba_heads": o["expand"] * cfg.d_model // o["head_dim"],
               "time_step_min": json_float(o["dt_limit"][0]), "use_conv_bias": True, "add_bias_linear": False,
               "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads,
               "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings}
        if s is not None:
            out.update({"intermediate_size": s["hidden"] or cfg.mlp_hidden,
                        "hidden_act": next(k for k, v in ACTS.items() if v == s["act"]),
                        "num_mem_blocks": s["blocks"], "adapter_rank": s["adapter_rank"],
                        "use_shared_attention_adapter": s["attention_adapter"], "use_mem_rope": s["rotary"],
                        "rope_parameters": {"rope_type": "default", "rope_theta": s["rotary_base"]}})
        return out

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        o, s = opts.get("mamba2"), cfg.shared
        return (cfg.layers == ["mamba2"] * cfg.n_layers and not cfg.mlp and cfg.moe is None and cfg.pos_emb == "none"
                and not cfg.parallel and not cfg.post_norm and cfg.scaled_residual is None
                and o["norm_eps"] == MAMBA_NORM_EPS and o["dt_limit"][1] == float("inf")
                and (s is None or (s["adapter_rank"] >= 1 and s["scale"] is not None
                                   and math.isclose(s["scale"], (cfg.d_model / cfg.n_heads) ** -0.5, rel_tol=1e-12)
                                   and (not s["attention_adapter"] or (cfg.n_kv_heads or cfg.n_heads) == cfg.n_heads))))
