"""Hugging Face model folders <-> subquad ``LanguageModel``s, without importing transformers.

    model, tokenizer = from_pretrained("path/to/folder", dtype=None, device=None)
    save_pretrained(model, "path/to/out")

A folder holds ``config.json``, the weights (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) and, when present, ``tokenizer.json`` (loaded with ``tokenizers``).
Each ``model_type`` has a mapping: its config to a ``ModelConfig`` - every field that changes the math
honoured or refused with a ``ValueError`` naming it - and its weight names to subquad's. A missing
weight, an unexpected one or a wrong shape is refused by name: never a silently different model.

Supported: ``mamba`` (MambaForCausalLM), ``falcon_mamba`` (its RMS norms on dt, B and C) and ``mamba2``
(Mamba2ForCausalLM: ``n_groups``, the gated norm per group with the config's epsilon, ``time_step_limit``).
The other types of the checkpoint issues build on this.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from subquad.models.config import ModelConfig

_INIT_ONLY = {"initializer_range", "rescale_prenorm_residual", "time_step_scale", "time_step_min", "time_step_max",
              "time_step_init_scheme", "time_step_floor"}   # fields that shape only a fresh model's weights


class _Mamba:
    """MambaForCausalLM: embedding, blocks of rmsnorm -> Mamba mixer (a residual each, no MLP), rmsnorm,
    tied or untied head."""

    model_type = "mamba"
    layer = "mamba"

    @staticmethod
    def conv_channels(c: dict) -> int:
        return c["hidden_size"] * c.get("expand", 2)

    @classmethod
    def matches(cls, cfg: ModelConfig) -> bool:
        """Whether a subquad model of this layer is this type (Falcon-Mamba's norms make the other)."""
        return cfg.mixer_options.get("mamba", {}).get("bcdt_rms_eps") is None

    @staticmethod
    def config(c: dict) -> ModelConfig:
        _require(c, "hidden_act", "silu")
        _require(c, "use_bias", False)
        H, E = c["hidden_size"], c.get("expand", 2)
        if c.get("intermediate_size", E * H) != E * H:
            raise ValueError(f"config field intermediate_size={c['intermediate_size']} must be expand * hidden_size "
                             f"= {E * H}")
        rank = c.get("time_step_rank", "auto")
        rank = math.ceil(H / 16) if rank == "auto" else int(rank)
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=c["num_hidden_layers"], n_heads=1,
                           pattern="mamba", mlp=False, norm_eps=c.get("layer_norm_epsilon", 1e-5),
                           tie_embeddings=c.get("tie_word_embeddings", True), context_length=1 << 20,
                           mixer_options={"mamba": {"d_state": c.get("state_size", 16), "expand": E,
                                                    "conv_size": c.get("conv_kernel", 4), "dt_rank": rank}})

    @staticmethod
    def names(cfg: ModelConfig) -> dict:
        """subquad parameter name -> the checkpoint's."""
        return _backbone_names(cfg, ("A_log", "D", "in_proj.weight", "x_proj.weight", "dt_proj.weight",
                                     "dt_proj.bias", "out_proj.weight"))

    @staticmethod
    def to_config(cfg: ModelConfig) -> dict:
        o = cfg.mixer_options["mamba"]
        return {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "state_size": o["d_state"],
                "expand": o["expand"], "intermediate_size": o["expand"] * cfg.d_model, "conv_kernel": o["conv_size"],
                "time_step_rank": o["dt_rank"], "layer_norm_epsilon": cfg.norm_eps, "use_bias": False,
                "use_conv_bias": True, "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
                "residual_in_fp32": True}


class _FalconMamba(_Mamba):
    """FalconMambaForCausalLM: Mamba with a weightless RMS norm on dt, B and C (``mixer_rms_eps``)."""

    model_type = "falcon_mamba"
    layer = "mamba"

    @staticmethod
    def config(c: dict) -> ModelConfig:
        cfg = _Mamba.config(c)
        cfg.mixer_options["mamba"]["bcdt_rms_eps"] = c.get("mixer_rms_eps", 1e-6)
        return cfg

    @staticmethod
    def to_config(cfg: ModelConfig) -> dict:
        return {**_Mamba.to_config(cfg), "model_type": "falcon_mamba", "architectures": ["FalconMambaForCausalLM"],
                "mixer_rms_eps": cfg.mixer_options["mamba"]["bcdt_rms_eps"]}

    @classmethod
    def matches(cls, cfg: ModelConfig) -> bool:
        return cfg.mixer_options.get("mamba", {}).get("bcdt_rms_eps") is not None


class _Mamba2:
    """Mamba2ForCausalLM: embedding, blocks of rmsnorm -> Mamba-2 mixer (SSD, B and C per group, gated norm
    per group), rmsnorm, head (untied by default)."""

    model_type = "mamba2"
    layer = "mamba2"

    @staticmethod
    def conv_channels(c: dict) -> int:
        return int(c.get("expand", 2) * c["hidden_size"]) + 2 * c.get("n_groups", 1) * c.get("state_size", 128)

    @staticmethod
    def config(c: dict) -> ModelConfig:
        _require(c, "hidden_act", "silu")
        _require(c, "use_bias", False)
        _require(c, "rms_norm", True)
        _require(c, "norm_before_gate", False)
        H, E = c["hidden_size"], c.get("expand", 2)
        heads, hd = c.get("num_heads", 128), c.get("head_dim", 64)
        if heads * hd != int(E * H):
            raise ValueError(f"config fields num_heads={heads} x head_dim={hd} must equal expand x hidden_size = "
                             f"{int(E * H)}")
        eps = c.get("layer_norm_epsilon", 1e-5)
        opts = {"d_state": c.get("state_size", 128), "head_dim": hd, "expand": E, "conv_size": c.get("conv_kernel", 4),
                "n_groups": c.get("n_groups", 1), "norm_eps": eps}
        limit = tuple(_float(v) for v in c.get("time_step_limit", (0.0, float("inf"))))
        if limit != (0.0, float("inf")):
            opts["dt_limit"] = limit
        return ModelConfig(vocab_size=c["vocab_size"], d_model=H, n_layers=c["num_hidden_layers"], n_heads=1,
                           pattern="mamba2", mlp=False, norm_eps=eps, tie_embeddings=c.get("tie_word_embeddings", False),
                           context_length=1 << 20, mixer_options={"mamba2": opts})

    @staticmethod
    def names(cfg: ModelConfig) -> dict:
        return _backbone_names(cfg, ("dt_bias", "A_log", "D", "in_proj.weight", "norm.weight", "out_proj.weight"))

    @staticmethod
    def to_config(cfg: ModelConfig) -> dict:
        o = cfg.mixer_options["mamba2"]
        return {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "state_size": o["d_state"],
                "head_dim": o["head_dim"], "num_heads": o["expand"] * cfg.d_model // o["head_dim"],
                "expand": o["expand"], "n_groups": o.get("n_groups", 1), "conv_kernel": o["conv_size"],
                "layer_norm_epsilon": cfg.norm_eps, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
                "time_step_limit": [_json_float(v) for v in o.get("dt_limit", (0.0, float("inf")))],
                "tie_word_embeddings": cfg.tie_embeddings, "residual_in_fp32": True}

    @classmethod
    def matches(cls, cfg: ModelConfig) -> bool:
        o = cfg.mixer_options.get("mamba2", {})
        return o.get("norm_eps", 1e-6) == cfg.norm_eps


MAPPINGS = {m.model_type: m for m in (_Mamba, _FalconMamba, _Mamba2)}


def _backbone_names(cfg: ModelConfig, mixer_params) -> dict:
    """subquad name -> the checkpoint's, for the Mamba family's layout: backbone.{embeddings, layers.i.{norm,
    mixer.*}, norm_f} and lm_head; the mixer's short convolution is ``conv1d`` there, ``conv`` here."""
    out = {"embed.weight": "backbone.embeddings.weight", "norm.weight": "backbone.norm_f.weight"}
    for i in range(cfg.n_layers):
        a, b = f"blocks.{i}.", f"backbone.layers.{i}."
        out[a + "norm1.weight"] = b + "norm.weight"
        for p in mixer_params:
            out[a + "mixer." + p] = b + "mixer." + p
        out[a + "mixer.conv.weight"] = b + "mixer.conv1d.weight"
        out[a + "mixer.conv.bias"] = b + "mixer.conv1d.bias"
    if not cfg.tie_embeddings:
        out["head.weight"] = "lm_head.weight"
    return out


def _float(v) -> float:
    """A float from config.json; transformers writes infinities as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def _json_float(v: float):
    return {"__float__": "Infinity" if v > 0 else "-Infinity"} if math.isinf(v) else v


def _require(c: dict, key: str, value):
    if key in c and c[key] != value:
        raise ValueError(f"config field {key}={c[key]!r} is not supported (subquad implements {key}={value!r})")


def read_config(path) -> dict:
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not a model folder: it has no config.json")
    c = json.loads((path / "config.json").read_text())
    mt = c.get("model_type")
    if mt not in MAPPINGS:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {', '.join(sorted(MAPPINGS))}")
    return c


def read_weights(path) -> dict:
    """Every tensor of the folder's safetensors file(s), by name."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} holds no model.safetensors (nor a sharded model.safetensors.index.json)")
    out = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def from_pretrained(path, dtype=None, device=None):
    """(LanguageModel in eval mode, tokenizer or None) from a Hugging Face model folder (see the module doc)."""
    from subquad.models.lm import LanguageModel

    c = read_config(path)
    mapping = MAPPINGS[c["model_type"]]
    cfg = mapping.config(c)
    model = LanguageModel(cfg)
    names = mapping.names(cfg)
    tensors = read_weights(path)
    if c.get("use_conv_bias", True) is False:        # no bias in the checkpoint: ours stays zero
        for i in range(cfg.n_layers):
            tensors[f"backbone.layers.{i}.mixer.conv1d.bias"] = torch.zeros(mapping.conv_channels(c))
    own = model.state_dict()
    missing = [theirs for ours, theirs in names.items() if theirs not in tensors]
    if missing:
        raise ValueError(f"{path}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    extra = set(tensors) - set(names.values()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if extra:
        raise ValueError(f"{path}: unexpected weights in the checkpoint: {', '.join(sorted(extra)[:5])}")
    state = {}
    for ours, theirs in names.items():
        t = tensors[theirs]
        if t.shape != own[ours].shape:
            raise ValueError(f"{path}: weight {theirs} has shape {tuple(t.shape)}, the config implies "
                             f"{tuple(own[ours].shape)}")
        state[ours] = t
    model.load_state_dict(state, strict=True)
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    tok = None
    if (Path(path) / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return model.eval(), tok


def save_pretrained(model, path) -> None:
    """Write ``model`` as a Hugging Face folder (config.json, model.safetensors) that ``from_pretrained``
    and transformers read back. The model must have the structure of a supported type."""
    from safetensors.torch import save_file

    cfg = model.config
    kind = next((m for m in MAPPINGS.values() if set(cfg.layers) == {m.layer} and not cfg.mlp and m.matches(cfg)),
                None)
    if kind is None:
        raise ValueError(f"no Hugging Face model type has this structure (pattern {cfg.pattern!r}, mlp={cfg.mlp}); "
                         f"supported: {', '.join(sorted(MAPPINGS))}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    own = model.state_dict()
    tensors = {theirs: own[ours].detach().cpu().contiguous() for ours, theirs in kind.names(cfg).items()}
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(kind.to_config(cfg), indent=1))
