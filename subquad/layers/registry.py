"""The table of mechanisms: every mixer by name, for model configs, layer patterns, the recall sweep,
the checkpoint loaders and the contract tests. Adding a mixer is its layer file plus one entry here
(or ``register_mixer`` from outside the package)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from subquad.layers.attention import SoftmaxAttention
from subquad.layers.base import Mixer
from subquad.layers.deltanet import DeltaNet, GatedDeltaNet
from subquad.layers.gla import GatedLinearAttention
from subquad.layers.griffin import GriffinRecurrentBlock
from subquad.layers.kda import KimiDeltaAttention
from subquad.layers.lightning import LightningAttention
from subquad.layers.linear_attention import LinearAttention
from subquad.layers.linformer import Linformer
from subquad.layers.mamba import Mamba
from subquad.layers.mamba2 import Mamba2
from subquad.layers.mla import LatentAttention
from subquad.layers.mlstm import MLSTM
from subquad.layers.retention import MultiScaleRetention
from subquad.layers.short_conv import GatedShortConv
from subquad.layers.rwkv7 import RWKV7
from subquad.layers.qsa import IndexedAttention


@dataclass(frozen=True)
class MixerEntry:
    """One mechanism of the table: what a name builds and how the model's sizes reach it.

    cls       the layer (a ``Mixer``); its constructor's keywords are the options the name accepts
    defaults  options the name fixes (``swa``'s window, ``performer``'s feature map), or a function
              (d_model, n_heads) -> options for a layer that sizes itself from them (Mamba-2's head_dim)
    heads     how the model's head counts reach the layer: "n_heads", "n_kv_heads" (both, grouped-query
              attention), or None (the layer sizes itself: Mamba)
    own_heads a checkpoint may set the layer's head count apart from the model's (its value heads)
    recall    options the recall sweep gives it (``subquad.bench.recall``: Zoology's short convolution)
    attention softmax attention (a KV cache over every kept token): in a model with such a layer, the
              mixers with normalised outputs start with a smaller output projection
              (``LanguageModel._init_residual_branches``)
    encoder_only  the layer has no causal form and no decoding state (Linformer): it is no language model's
              layer (patterns refuse it) and the battery (``subquad.testing``) runs its whole-sequence checks
              in place of decoding, packing and the model
    rollback  how speculative decoding keeps the state after the first j of k verified tokens
              (``subquad.layers.rollback``): "truncate" (a KV cache drops the rejected tokens' entries) or
              "replay" (the layer runs the j accepted tokens again from the state before verification) or
              "states" (a fixed state built only through ``seq.recurrence`` and ``seq.causal_conv``: the
              compiled verification keeps it after every token and takes the j-th; replayed otherwise)
    about     one line for listings
    The layer itself declares the rest: its op (called through ``seq.recurrence`` / ``seq.attention``,
    the op's ``Transition`` gives context parallelism), its state layout (``empty_state``) and its FLOPs.
    """
    cls: type
    defaults: dict | Callable = field(default_factory=dict)
    heads: str | None = "n_heads"
    own_heads: bool = False
    recall: dict = field(default_factory=dict)
    attention: bool = False
    encoder_only: bool = False
    rollback: str = "replay"
    about: str = ""

    def __post_init__(self):
        from subquad.layers.rollback import ROLLBACKS

        if self.rollback not in ROLLBACKS:
            raise ValueError(f"rollback must be one of {ROLLBACKS}, got {self.rollback!r}")

    def options(self, d_model: int, n_heads: int) -> dict:
        return dict(self.defaults(d_model, n_heads) if callable(self.defaults) else self.defaults)


def _mamba2_sizes(d_model, n_heads):
    return {"head_dim": max(8, d_model // max(n_heads, 1)), "d_state": 16}


CONV = {"conv_size": 4}       # the recall sweep's short convolution before attention-like mixers

MIXERS: dict[str, MixerEntry] = {
    "softmax": MixerEntry(SoftmaxAttention, heads="n_kv_heads", attention=True,
                          rollback="truncate", about="full causal softmax attention (KV cache grows)"),
    "swa": MixerEntry(SoftmaxAttention, {"window": 64}, heads="n_kv_heads", attention=True, rollback="truncate",
                      about="sliding-window softmax attention (bounded cache), window 64 unless set"),
    "qsa": MixerEntry(IndexedAttention, heads="n_kv_heads", attention=True, rollback="truncate",
                      about="softmax attention over the blocks an indexer selects (Qwen4-Exp's QSA)"),
    "linear": MixerEntry(LinearAttention, recall=CONV, rollback="states",
                         about="linear attention, elu+1 unless feature_map= is set"),
    "performer": MixerEntry(LinearAttention, {"feature_map": "performer"}, recall=CONV,
                            rollback="states", about="linear attention with Performer's random features"),
    "taylor": MixerEntry(LinearAttention, {"feature_map": "taylor", "qk_dim": 16}, recall=CONV,
                         rollback="states", about="Based's second-order Taylor map on a 16-dim projection"),
    "retention": MixerEntry(MultiScaleRetention, recall=CONV, about="RetNet's multi-scale retention"),
    "gla": MixerEntry(GatedLinearAttention, recall=CONV, rollback="states",
                      about="gated linear attention, a decay per key channel"),
    "mamba": MixerEntry(Mamba, heads=None, rollback="states", about="Mamba-1 (selective scan, S6)"),
    "mamba2": MixerEntry(Mamba2, _mamba2_sizes, heads=None, rollback="states", about="Mamba-2 (SSD)"),
    "deltanet": MixerEntry(DeltaNet, own_heads=True, rollback="states", about="the delta rule"),
    "gated_deltanet": MixerEntry(GatedDeltaNet, own_heads=True, rollback="states", about="the gated delta rule"),
    "kda": MixerEntry(KimiDeltaAttention, own_heads=True, rollback="states",
                      about="Kimi Delta Attention: the gated delta rule with a decay per key channel"),
    "mla": MixerEntry(LatentAttention, attention=True, rollback="truncate",
                      about="multi-head latent attention (softmax; the cache keeps latents)"),
    "lightning": MixerEntry(LightningAttention, rollback="states",
                            about="MiniMax's lightning attention: linear attention, fixed decays, gated norm"),
    "gated_conv": MixerEntry(GatedShortConv, heads=None, rollback="states",
                             about="LFM2's gated short convolution: out(c * conv(b * x)), no recurrence"),
    "rglru": MixerEntry(GriffinRecurrentBlock, about="Griffin's recurrent block (RG-LRU)"),
    "rwkv7": MixerEntry(RWKV7, rollback="states",
                        about="RWKV-7 time mix: the generalised delta rule, token shift, value residual"),
    "mlstm": MixerEntry(MLSTM, rollback="states",
                        about="xLSTM's mLSTM: a matrix memory, exponential input gate, max-stabilised normaliser"),
    "linformer": MixerEntry(Linformer, encoder_only=True,
                            about="Linformer: softmax attention over keys and values projected along time"),
}


def causal_mixers() -> list[str]:
    """The names a language model's pattern may use: every entry but the encoder-only ones."""
    return [name for name, e in MIXERS.items() if not e.encoder_only]


BUILTIN = frozenset(MIXERS)          # the table's own entries: register_mixer never replaces them


def register_mixer(name: str, cls: type, *, replace: bool = False, **entry) -> MixerEntry:
    """Add a mechanism to the table: ``register_mixer("tiny_decay", TinyDecay)``. The name is then
    usable in patterns, ``build_mixer``, ``--mixer-option`` and the generic battery
    (``subquad.testing.check_mixer``). ``entry``: ``MixerEntry``'s other fields. ``replace``: a mixer registered
    before under ``name`` is replaced (a notebook's class edited and run again); subquad's own are never."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a mixer name must be an identifier (it appears in patterns), got {name!r}")
    if name in BUILTIN or (name in MIXERS and not replace):
        own = "one of subquad's own" if name in BUILTIN else "replace=True replaces it"
        raise ValueError(f"mixer {name!r} is already registered ({MIXERS[name].cls.__name__}; {own})")
    if not (isinstance(cls, type) and issubclass(cls, Mixer)):
        raise ValueError(f"cls must be a subclass of subquad.layers.base.Mixer, got {cls!r}")
    MIXERS[name] = MixerEntry(cls, **entry)
    return MIXERS[name]


def mixer_options(name: str) -> list[str]:
    """The option names ``--mixer-option NAME.KEY=VALUE`` accepts for mixer ``name``."""
    e = MIXERS[name]
    sig = inspect.signature(e.cls.__init__)
    fixed = {"self", "d_model", "n_kv_heads"} | (set() if e.own_heads else {"n_heads"})
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
        e = MIXERS[name]
        heads = {} if e.heads is None else {"n_heads": n_heads}
        if e.heads == "n_kv_heads":
            heads["n_kv_heads"] = n_kv_heads
        kwargs = {**heads, **e.options(d_model, n_heads), **options}
        layer = e.cls(d_model, **kwargs)
    except TypeError as e:                      # a wrong option name or value type: say which mixer
        raise ValueError(f"mixer {name!r} with options {options}: {e}") from None
    # every constructor argument it was built with, defaults included (what checkpoint writers read)
    bound = inspect.signature(type(layer).__init__).bind(layer, d_model, **kwargs)
    bound.apply_defaults()
    layer.build_options = {k: v for k, v in bound.arguments.items() if k not in ("self", "d_model")}
    return layer
