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

The MLP after each mixer is a SwiGLU, a GeGLU with ``mlp_kind="geglu"``, or with ``mlp_kind="relu2"`` an ungated
squared-ReLU MLP; ``mlp_layers``
lists the layers that have one (Nemotron-H's pattern: "M-M*-MM-" has no MLP after its fourth mixer), the
others being the mixer alone.

A sparse mixture-of-experts MLP (``subquad.models.moe``) replaces the dense one in every ``every``-th
layer from ``offset`` (Jamba: every second layer from layer 1):

    moe={"experts": 16, "top_k": 2, "every": 2, "offset": 1, "aux_loss_coef": 0.001, "renormalize": False}

``hidden`` sets each expert's width (default: the dense MLP's), ``shared`` adds a shared expert of that
width (0: none), gated by a learned sigmoid unless ``shared_gate`` is False; ``router`` "sigmoid" with
``groups``, ``topk_groups``, ``scale`` and ``renorm_eps`` is DeepSeek-V3's routing (``subquad.models.moe``); ``layers``
lists the MoE layers explicitly, instead of every/offset (Kimi Linear: every layer but the first). The experts
are MLPs of ``mlp_kind`` ("swiglu", or "relu2": Nemotron-H's); with ``mlp_layers`` the MoE layers are among
them. An optional ``latent`` (absent: none) runs the routed experts in a space that wide (Nemotron-H's
``moe_latent_size``).

Shared transformer blocks (``subquad.models.shared``, Zamba2): attention + MLP blocks whose weights serve several
layers, each use with its own LoRA adapters and output projection, writing into that layer's mixer input:

    shared={"layers": [5, 11, 17], "blocks": 2, "adapter_rank": 128, "attention_adapter": True, "act": "gelu"}

Hyper-connections (``subquad.models.hyper``, Qwen4-Exp): n residual streams, every block's branches reading a
learned mix of them and writing into each with a learned weight, and optional per-layer hashed n-gram embeddings:

    hyper={"streams": 4, "rank": 320, "ple": {"layers": [0, 2], "dim": 2048, "eos": 248046, "ngram": 3, ...}}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def parse_pattern(pattern: str, n_layers: int) -> list[str]:
    """Expand a pattern into one mixer name per layer; ValueError with the reason otherwise."""
    from subquad.layers.registry import MIXERS, causal_mixers

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
            raise ValueError(f"pattern {pattern!r}: unknown mixer {name!r}; "
                             f"known: {', '.join(sorted(causal_mixers()))} (a mixer of your own: register_mixer "
                             f"it first, subquad.layers.registry)")
        if MIXERS[name].encoder_only:
            raise ValueError(f"pattern {pattern!r}: {name} is encoder-only (no causal form, no decoding state), so a "
                             f"causal language model cannot use it; causal mixers: {', '.join(sorted(causal_mixers()))}")
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
    mlp_size: int | None = None          # the MLP's hidden width, when set (checkpoints give it); else mlp_ratio's
    mlp_bias: bool = False               # biases on the MLP's three projections (RecurrentGemma)
    moe: dict | None = None              # sparse mixture-of-experts MLPs (module doc); None: dense everywhere
    mlp_kind: str = "swiglu"             # the MLP: "swiglu", "geglu" (Gemma's tanh GeLU gate), "relu2" (ungated
                                         # W_down relu(W_up x)^2: Primer, Nemotron-H) or "rwkv7" (RWKV's channel
                                         # mix: token shift, relu^2; it has a state)
    mlp_layers: list | None = None       # indices of the layers with an MLP (None: all); the rest: the mixer alone
    context_length: int = 256
    pos_emb: str = "none"                # "none" (positions from the mixers: RoPE, recurrence) or "learned"
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    post_norm: list = field(default_factory=list)   # mixer names whose blocks norm the branch outputs (lm.py)
    sandwich_norm: bool = False          # norms before and after both branches of every block (LFM3; lm.py)
    scaled_residual: dict | None = None  # MiniMax-01's blocks: {mixer name | "mlp": [alpha, beta]} (lm.py)
    parallel: dict = field(default_factory=dict)   # {mixer name: mixer run beside it, summed} (Falcon-H1; lm.py)
    eos_token_ids: list = field(default_factory=list)  # end-of-text ids: ``generate`` stops after emitting one
    embed_scale: float | None = None     # the embeddings times this (Gemma: sqrt(d_model)); None: 1
    logit_soft_cap: float | None = None  # logits = cap tanh(logits / cap) (Gemma 2, RecurrentGemma); None: none
    norm: str = "rms"                    # the blocks' and final norms: "rms", or "layer" (LayerNorm with bias: RWKV)
    norm_bias: bool = False              # a bias on the blocks' RMS norms, not the final one's (xLSTM's use_bias)
    embed_norm: bool = False             # a norm on the embeddings before the first block (RWKV's ln0)
    shared: dict | None = None           # shared transformer blocks and the layers that use them (module doc; Zamba2)
    hyper: dict | None = None            # hyper-connections: {"streams", "rank", "ple"} (models.hyper; Qwen4-Exp)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "context_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must divide by n_heads={self.n_heads}")
        from subquad.layers.registry import check_mixer_options

        check_mixer_options(parse_pattern(self.pattern, self.n_layers), self.mixer_options)
        if self.mlp_size is not None and (isinstance(self.mlp_size, bool) or not isinstance(self.mlp_size, int)
                                          or self.mlp_size <= 0):
            raise ValueError(f"mlp_size must be a positive int or None, got {self.mlp_size!r}")
        if self.moe is not None:
            self.moe = _check_moe(self.moe, self.mlp)
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(f"mlp_kind must be one of {MLP_KINDS}, got {self.mlp_kind!r}")
        if self.mlp_layers is not None:
            if not isinstance(self.mlp_layers, (list, tuple)) or any(
                    isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers for i in self.mlp_layers):
                raise ValueError(f"mlp_layers must be None or a list of layer indices in [0, {self.n_layers}), "
                                 f"got {self.mlp_layers!r}")
            self.mlp_layers = sorted(set(self.mlp_layers))
        if self.moe is not None and self.mlp_kind not in ("swiglu", "relu2"):
            raise ValueError(f"moe: its experts are MLPs of mlp_kind, 'swiglu' or 'relu2', got {self.mlp_kind!r}")
        if self.moe is not None and self.mlp_layers is not None and not set(self.moe_layers) <= set(self.mlp_layers):
            raise ValueError(f"moe layers {self.moe_layers} must be among mlp_layers={self.mlp_layers} (the layers "
                             "with an MLP)")
        from subquad.layers import MIXERS

        if not isinstance(self.post_norm, (list, tuple)) or any(n not in MIXERS for n in self.post_norm):
            raise ValueError(f"post_norm must be a list of mixer names ({', '.join(sorted(MIXERS))}), "
                             f"got {self.post_norm!r}")
        self.post_norm = list(self.post_norm)
        if not isinstance(self.parallel, dict) or any(
                a not in MIXERS or b not in MIXERS or a == b or MIXERS[b].encoder_only for a, b in self.parallel.items()):
            raise ValueError(f"parallel must be a dict {{mixer name: another (causal) mixer name run beside it}}, "
                             f"got {self.parallel!r}")
        if not isinstance(self.sandwich_norm, bool):
            raise ValueError(f"sandwich_norm must be a bool, got {self.sandwich_norm!r}")
        if self.sandwich_norm and (self.parallel or self.post_norm or self.scaled_residual is not None
                                   or self.shared is not None):
            raise ValueError("sandwich_norm blocks take no parallel, post_norm, scaled_residual or shared")
        if self.parallel and (self.post_norm or self.scaled_residual is not None):
            raise ValueError("parallel blocks are pre-norm: they take no post_norm or scaled_residual")
        self.parallel = dict(self.parallel)
        if self.scaled_residual is not None:
            sr = self.scaled_residual
            if not isinstance(sr, dict) or any(k != "mlp" and k not in MIXERS for k in sr) or any(
                    not isinstance(v, (list, tuple)) or len(v) != 2
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) for v in sr.values()):
                raise ValueError("scaled_residual must be None or a dict {mixer name | 'mlp': [alpha, beta]}, "
                                 f"got {sr!r}")
            self.scaled_residual = {k: [float(x) for x in v] for k, v in sr.items()}
        if not isinstance(self.eos_token_ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be a list of token ids in [0, {self.vocab_size}), "
                             f"got {self.eos_token_ids!r}")
        self.eos_token_ids = list(self.eos_token_ids)
        if not isinstance(self.mlp_bias, bool):
            raise ValueError(f"mlp_bias must be a bool, got {self.mlp_bias!r}")
        for name in ("embed_scale", "logit_soft_cap"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
                raise ValueError(f"{name} must be a positive finite number or None, got {v!r}")
        if self.pos_emb not in ("none", "learned"):
            raise ValueError(f"pos_emb must be 'none' or 'learned', got {self.pos_emb!r}")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm must be 'rms' or 'layer', got {self.norm!r}")
        if not isinstance(self.norm_bias, bool) or (self.norm_bias and self.norm != "rms"):
            raise ValueError(f"norm_bias must be a bool, and True only with norm='rms' (a LayerNorm has its bias), "
                             f"got {self.norm_bias!r} with norm={self.norm!r}")
        if not isinstance(self.embed_norm, bool):
            raise ValueError(f"embed_norm must be a bool, got {self.embed_norm!r}")
        if self.shared is not None:
            from subquad.models.shared import check_shared

            self.shared = check_shared(self.shared, self.n_layers)
            if self.parallel or self.post_norm or self.scaled_residual is not None:
                raise ValueError("the layers that use shared blocks are pre-norm: shared takes no parallel, "
                                 "post_norm or scaled_residual")

        if self.hyper is not None:
            from subquad.models.hyper import check_hyper

            self.hyper = check_hyper(self.hyper, self.n_layers, self.vocab_size)
            if (self.parallel or self.post_norm or self.scaled_residual is not None or self.shared is not None
                    or self.sandwich_norm or self.mlp_kind == "rwkv7" or self.pos_emb != "none"):
                raise ValueError("hyper-connection blocks take no parallel, post_norm, scaled_residual, shared, "
                                 "sandwich_norm, learned positions or rwkv7 MLP")

    @property
    def layers(self) -> list[str]:
        return parse_pattern(self.pattern, self.n_layers)

    @property
    def mlp_hidden(self) -> int:
        if self.mlp_size is not None:
            return self.mlp_size
        return max(8, int(round(2 / 3 * self.mlp_ratio * self.d_model / 8)) * 8)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers whose MLP is a mixture of experts."""
        if self.moe is None:
            return []
        if self.moe["layers"] is not None:
            return [i for i in self.moe["layers"] if i < self.n_layers]
        return [i for i in range(self.n_layers) if i % self.moe["every"] == self.moe["offset"]]

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


MLP_KINDS = ("swiglu", "geglu", "relu2", "rwkv7")

MOE_DEFAULTS = {"top_k": 2, "every": 1, "offset": 0, "aux_loss_coef": 0.01, "renormalize": False, "hidden": None,
                "shared": 0, "shared_gate": True, "router": "softmax", "groups": 1, "topk_groups": 1, "scale": 1.0,
                "layers": None, "renorm_eps": 1e-20}


def _check_moe(moe, mlp: bool) -> dict:
    """The moe option with its defaults filled in; ValueError naming the key otherwise."""
    if not isinstance(moe, dict):
        raise ValueError(f"moe must be a dict like {{'experts': 8, 'top_k': 2}} or None, got {type(moe).__name__}")
    unknown = set(moe) - set(MOE_DEFAULTS) - {"experts", "latent"}
    if unknown:
        raise ValueError(f"unknown moe keys {sorted(unknown)}; known: experts, {', '.join(MOE_DEFAULTS)}, latent")
    latent = moe.get("latent")
    if latent is not None and (isinstance(latent, bool) or not isinstance(latent, int) or latent < 1):
        raise ValueError(f"moe['latent'] (the routed experts' width in; absent or None: d_model) must be a positive "
                         f"int, got {latent!r}")
    if not mlp:
        raise ValueError("moe replaces the MLP: it needs mlp=True")
    m = {**MOE_DEFAULTS, **moe}
    for key, low in (("experts", 2), ("top_k", 1), ("every", 1), ("offset", 0)):
        v = m.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"moe['{key}'] must be an int >= {low}, got {v!r}")
    if m["top_k"] > m["experts"]:
        raise ValueError(f"moe['top_k']={m['top_k']} exceeds moe['experts']={m['experts']}")
    if m["offset"] >= m["every"]:
        raise ValueError(f"moe['offset']={m['offset']} must be below moe['every']={m['every']}")
    if not isinstance(m["aux_loss_coef"], (int, float)) or m["aux_loss_coef"] < 0:
        raise ValueError(f"moe['aux_loss_coef'] must be a number >= 0, got {m['aux_loss_coef']!r}")
    if m["hidden"] is not None and (isinstance(m["hidden"], bool) or not isinstance(m["hidden"], int)
                                    or m["hidden"] < 1):
        raise ValueError(f"moe['hidden'] (each expert's width; None: the MLP's) must be a positive int, "
                         f"got {m['hidden']!r}")
    if isinstance(m["shared"], bool) or not isinstance(m["shared"], int) or m["shared"] < 0:
        raise ValueError(f"moe['shared'] (the shared expert's width; 0: none) must be an int >= 0, got {m['shared']!r}")
    for key in ("shared_gate", "renormalize"):
        if not isinstance(m[key], bool):
            raise ValueError(f"moe['{key}'] must be a bool, got {m[key]!r}")
    if m["router"] not in ("softmax", "sigmoid"):
        raise ValueError(f"moe['router'] must be 'softmax' or 'sigmoid', got {m['router']!r}")
    for key in ("groups", "topk_groups"):
        if isinstance(m[key], bool) or not isinstance(m[key], int) or m[key] < 1:
            raise ValueError(f"moe['{key}'] must be a positive int, got {m[key]!r}")
    if m["experts"] % m["groups"] or m["topk_groups"] > m["groups"]:
        raise ValueError(f"moe['groups']={m['groups']} must divide moe['experts']={m['experts']}, and "
                         f"moe['topk_groups']={m['topk_groups']} be at most it")
    if isinstance(m["scale"], bool) or not isinstance(m["scale"], (int, float)) or m["scale"] <= 0:
        raise ValueError(f"moe['scale'] must be a positive number, got {m['scale']!r}")
    if isinstance(m["renorm_eps"], bool) or not isinstance(m["renorm_eps"], (int, float)) or m["renorm_eps"] < 0:
        raise ValueError(f"moe['renorm_eps'] must be a number >= 0, got {m['renorm_eps']!r}")
    if m["layers"] is not None:
        if not isinstance(m["layers"], (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                              for i in m["layers"]):
            raise ValueError(f"moe['layers'] must be a list of layer indices (or None: every/offset), got {m['layers']!r}")
        m["layers"] = sorted(set(m["layers"]))
    if not isinstance(m["renormalize"], bool):
        raise ValueError(f"moe['renormalize'] must be a bool, got {m['renormalize']!r}")
    return m


# option names of earlier versions -> today's (configs written before the rename still load)
RENAMED_OPTIONS = {"headdim": "head_dim", "d_conv": "conv_size"}
