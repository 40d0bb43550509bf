"""Mixers by name, for model configs and layer patterns."""

from __future__ import annotations

from subquad.layers.attention import SoftmaxAttention
from subquad.layers.deltanet import DeltaNet, GatedDeltaNet
from subquad.layers.gla import GatedLinearAttention
from subquad.layers.linear_attention import LinearAttention
from subquad.layers.mamba import Mamba
from subquad.layers.mamba2 import Mamba2
from subquad.layers.retention import MultiScaleRetention


def _softmax(d_model, n_heads, n_kv_heads=None, **kw):
    return SoftmaxAttention(d_model, n_heads, n_kv_heads=n_kv_heads, **kw)


def _swa(d_model, n_heads, n_kv_heads=None, window=64, **kw):
    return SoftmaxAttention(d_model, n_heads, n_kv_heads=n_kv_heads, window=window, **kw)


def _linear(d_model, n_heads, n_kv_heads=None, **kw):
    return LinearAttention(d_model, n_heads, **kw)


def _named_map(fmap, **defaults):
    def build(d_model, n_heads, n_kv_heads=None, **kw):
        return LinearAttention(d_model, n_heads, feature_map=fmap, **{**defaults, **kw})
    return build


def _retention(d_model, n_heads, n_kv_heads=None, **kw):
    return MultiScaleRetention(d_model, n_heads, **kw)


def _gla(d_model, n_heads, n_kv_heads=None, **kw):
    return GatedLinearAttention(d_model, n_heads, **kw)


def _mamba2(d_model, n_heads, n_kv_heads=None, **kw):
    kw.setdefault("headdim", max(8, 2 * d_model // max(n_heads, 1) // 2))
    kw.setdefault("d_state", 16)
    return Mamba2(d_model, **kw)


def _deltanet(d_model, n_heads, n_kv_heads=None, **kw):
    return DeltaNet(d_model, n_heads, **kw)


def _gated_deltanet(d_model, n_heads, n_kv_heads=None, **kw):
    return GatedDeltaNet(d_model, n_heads, **kw)


def _mamba(d_model, n_heads, n_kv_heads=None, **kw):
    return Mamba(d_model, **kw)


MIXERS = {
    "softmax": _softmax,          # full causal softmax attention (KV cache grows)
    "swa": _swa,                  # sliding-window softmax attention (bounded cache), window=64 unless set
    "linear": _linear,            # linear attention, elu+1 unless feature_map= is set
    "performer": _named_map("performer"),
    "taylor": _named_map("taylor", qk_dim=16),   # Based's second-order Taylor map on a 16-dim projection
    "retention": _retention,      # RetNet
    "gla": _gla,
    "mamba": _mamba,              # Mamba-1 (selective scan, S6)
    "mamba2": _mamba2,
    "deltanet": _deltanet,
    "gated_deltanet": _gated_deltanet,
}


def build_mixer(name: str, d_model: int, n_heads: int, n_kv_heads: int | None = None, **options):
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; known: {', '.join(sorted(MIXERS))}")
    return MIXERS[name](d_model, n_heads, n_kv_heads=n_kv_heads, **options)
