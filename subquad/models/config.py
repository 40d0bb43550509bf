"""Model configuration and the layer-pattern syntax.

A pattern names the mixer of every layer, comma-separated, with ``name*count``
for repeats:

    "softmax"                       every layer softmax attention
    "mamba2*3,softmax,mamba2*4"     Jamba's one attention layer in eight
    "linear,swa,linear,swa"         alternate linear and sliding-window attention

A single name fills all ``n_layers``; otherwise the counts must add up to
``n_layers``. Names are those of ``subquad.layers.MIXERS``. Per-mixer options go
in ``mixer_options`` keyed by mixer name: ``{"swa": {"window": 128},
"linear": {"feature_map": "performer"}}``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def parse_pattern(pattern: str, n_layers: int) -> list[str]:
    """Expand a pattern into one mixer name per layer; ValueError with the reason otherwise."""
    from subquad.layers import MIXERS

    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"pattern must be a non-empty string like 'mamba2*3,softmax', got {pattern!r}")
    layers = []
    items = [p.strip() for p in pattern.split(",")]
    for item in items:
        if not item:
            raise ValueError(f"pattern {pattern!r} has an empty item (two commas in a row?)")
        name, _, count = item.partition("*")
        name = name.strip()
        if name not in MIXERS:
            raise ValueError(f"pattern {pattern!r}: unknown mixer {name!r}; known: {', '.join(sorted(MIXERS))}")
        if count:
            if not count.strip().isdigit() or int(count) < 1:
                raise ValueError(f"pattern {pattern!r}: repeat count in {item!r} must be a positive integer")
            layers += [name] * int(count)
        else:
            layers.append(name)
    if len(items) == 1 and "*" not in items[0]:
        return layers * n_layers
    if len(layers) != n_layers:
        raise ValueError(f"pattern {pattern!r} describes {len(layers)} layers but n_layers={n_layers}")
    return layers


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None        # grouped-query attention for softmax layers (None: = n_heads)
    pattern: str = "softmax"
    mixer_options: dict = field(default_factory=dict)
    mlp: bool = True                     # SwiGLU MLP after each mixer (Zoology's recall setting turns it off)
    mlp_ratio: float = 4.0               # hidden = 2/3 * ratio * d_model: a SwiGLU with a 4x MLP's parameters
    context_length: int = 256
    pos_emb: str = "none"                # "none" (positions from the mixers: RoPE, recurrence) or "learned"
    tie_embeddings: bool = True
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "context_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must divide by n_heads={self.n_heads}")
        from subquad.layers.registry import check_mixer_options

        check_mixer_options(parse_pattern(self.pattern, self.n_layers), self.mixer_options)
        if self.pos_emb not in ("none", "learned"):
            raise ValueError(f"pos_emb must be 'none' or 'learned', got {self.pos_emb!r}")

    @property
    def layers(self) -> list[str]:
        return parse_pattern(self.pattern, self.n_layers)

    @property
    def mlp_hidden(self) -> int:
        return max(8, int(round(2 / 3 * self.mlp_ratio * self.d_model / 8)) * 8)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        d = dict(d)
        if "mixer_options" in d:                 # runs saved before the options had one name each
            d["mixer_options"] = {m: {RENAMED_OPTIONS.get(k, k): v for k, v in o.items()}
                                  for m, o in d["mixer_options"].items()}
        return cls(**d)


# option names of earlier versions -> today's (configs written before the rename still load)
RENAMED_OPTIONS = {"headdim": "head_dim", "d_conv": "conv_size"}
