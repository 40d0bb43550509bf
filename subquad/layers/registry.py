"""Mixers by name, for model configs and layer patterns."""

from __future__ import annotations

from subquad.layers.attention import SoftmaxAttention
from subquad.layers.deltanet import DeltaNet, GatedDeltaNet
from subquad.layers.gla import GatedLinearAttention
from subquad.layers.kda import KimiDeltaAttention
from subquad.layers.lightning import LightningAttention
from subquad.layers.linear_attention import LinearAttention
from subquad.layers.mamba import Mamba
from subquad.layers.mamba2 import Mamba2
from subquad.layers.mla import LatentAttention
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
    kw.setdefault("head_dim", max(8, d_model // max(n_heads, 1)))
    kw.setdefault("d_state", 16)
    return Mamba2(d_model, **kw)


def _deltanet(d_model, n_heads, n_kv_heads=None, **kw):
    return DeltaNet(d_model, n_heads, **kw)


def _gated_deltanet(d_model, n_heads, n_kv_heads=None, **kw):
    return GatedDeltaNet(d_model, n_heads, **kw)


def _kda(d_model, n_heads, n_kv_heads=None, **kw):
    return KimiDeltaAttention(d_model, n_heads, **kw)


def _mla(d_model, n_heads, n_kv_heads=None, **kw):
    return LatentAttention(d_model, n_heads, **kw)


def _lightning(d_model, n_heads, n_kv_heads=None, **kw):
    return LightningAttention(d_model, n_heads, **kw)


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
    "kda": _kda,                  # Kimi Delta Attention: the gated delta rule with a decay per key channel
    "mla": _mla,                  # multi-head latent attention (softmax; the cache keeps latents)
    "lightning": _lightning,      # MiniMax's lightning attention: linear attention, fixed decays, gated norm
}


# the layer class each name builds: its constructor's keywords are the options that name accepts
CLASSES = {"softmax": SoftmaxAttention, "swa": SoftmaxAttention, "linear": LinearAttention,
           "performer": LinearAttention, "taylor": LinearAttention, "retention": MultiScaleRetention,
           "gla": GatedLinearAttention, "mamba": Mamba, "mamba2": Mamba2, "deltanet": DeltaNet,
           "gated_deltanet": GatedDeltaNet, "kda": KimiDeltaAttention, "mla": LatentAttention,
           "lightning": LightningAttention}


# mixers whose head count may be set apart from the model's n_heads (a checkpoint's value heads)
OWN_HEADS = {"deltanet", "gated_deltanet", "kda"}


def mixer_options(name: str) -> list[str]:
    """The option names ``--mixer-option NAME.KEY=VALUE`` accepts for mixer ``name``."""
    import inspect

    sig = inspect.signature(CLASSES[name].__init__)
    fixed = {"self", "d_model", "n_kv_heads"} | (set() if name in OWN_HEADS else {"n_heads"})
    return sorted(n for n, p in sig.parameters.items()
                  if n not in fixed and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_mixer_options(layers: list[str], options: dict, in_pattern: bool = False) -> None:
    """Every option names a known mixer (or '*', every mixer of the pattern) and a keyword that mixer takes;
    with ``in_pattern`` (the command line) the mixer must also be one of the pattern's. A config may carry
    options for mixers it does not use (one options dict shared by several patterns)."""
    if not isinstance(options, dict):
        raise ValueError(f"mixer_options must be a dict {{mixer: {{option: value}}}}, got {type(options).__name__}")
    for mixer, opts in options.items():
        if mixer != "*" and mixer not in MIXERS:
            raise ValueError(f"mixer option for unknown mixer {mixer!r}; known: {', '.join(sorted(MIXERS))}")
        if in_pattern and mixer != "*" and mixer not in layers:
            raise ValueError(f"mixer option for {mixer!r}, which is not in the pattern ({', '.join(dict.fromkeys(layers))})")
        if not isinstance(opts, dict):
            raise ValueError(f"mixer_options[{mixer!r}] must be a dict of options, got {type(opts).__name__}")
        for name in (dict.fromkeys(layers) if mixer == "*" else [mixer]):      # each mixer it applies to
            valid = mixer_options(name)
            for key in opts:
                if key not in valid:
                    raise ValueError(f"mixer option {mixer}.{key}: {name} has no option {key!r}; its options: "
                                     f"{', '.join(valid)}")


def build_mixer(name: str, d_model: int, n_heads: int, n_kv_heads: int | None = None, **options):
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; known: {', '.join(sorted(MIXERS))}")
    try:
        return MIXERS[name](d_model, n_heads, n_kv_heads=n_kv_heads, **options)
    except TypeError as e:                      # a wrong option name or value type: say which mixer
        raise ValueError(f"mixer {name!r} with options {options}: {e}") from None
