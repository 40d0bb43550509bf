"""Named model shapes. Each is a function returning a ModelConfig; keyword arguments override fields."""

from __future__ import annotations

from subquad.models.config import ModelConfig


def micro(**overrides) -> ModelConfig:
    """The plate's shape: head dim 32, 4 layers, d_model 128, context 256 (~1.4M parameters with vocab 4,096)."""
    return ModelConfig(**{"d_model": 128, "n_layers": 4, "n_heads": 4, "context_length": 256, **overrides})


def small(**overrides) -> ModelConfig:
    """A step up: d_model 256, 6 layers, 8 heads of 32, context 512."""
    return ModelConfig(**{"d_model": 256, "n_layers": 6, "n_heads": 8, "context_length": 512, **overrides})


def jamba(**overrides) -> ModelConfig:
    """Jamba-like hybrid: Mamba-2 layers with one softmax attention layer in eight (GQA 4:1)."""
    return ModelConfig(**{"d_model": 128, "n_layers": 8, "n_heads": 4, "n_kv_heads": 1, "context_length": 256,
                          "pattern": "mamba2*3,softmax,mamba2*4", **overrides})


PRESETS = {"micro": micro, "small": small, "jamba": jamba}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name](**overrides)
