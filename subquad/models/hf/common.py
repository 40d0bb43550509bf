"""What the checkpoint formats share: the ``Format`` base class and its name tables, config translation
helpers, the tensor reshuffles several formats need, reading a folder, and the options a built model's
layers hold (``layer_options``, which ``Format.matches`` compares against).

A format's name map is a table of key patterns, subquad name -> the checkpoint's:

    top     = {"embed.weight": "model.embed_tokens.weight", ...}              outside the blocks
    layer   = "model.layers.{i}."                                              the checkpoint's block prefix
    layers  = {"softmax": {"mixer.{p}": "self_attn.{p}"}, "*": {...}}          inside block i (``blocks.{i}.``),
                                                                               by the layer's mixer, then "*"

``{p}`` stands for the rest of a name, the same on both sides; the first pattern that matches wins, so a
specific rename comes before its wildcard. A checkpoint name holding ``{e}`` is one tensor per expert,
stacked along dim 0 of ours (the experts of an MoE layer). Every tensor of the model must match a pattern,
and no two may map to one name.
"""

from __future__ import annotations

import functools
import json
import math
import re
import warnings
from pathlib import Path

import torch

from subquad.models.config import ModelConfig
from subquad.tensorfile import read_safetensors

TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}
SWIGLU = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}     # transformers' MLP names
W132 = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}        # Mixtral's, kept by Kimi Linear and MiniMax


def swiglu(ours: str, theirs: str, names: dict = SWIGLU) -> dict:
    """A SwiGLU's three projections: ``{ours}w_gate.weight`` -> ``{theirs}gate_proj.weight``, ..."""
    return {f"{ours}{a}.weight": f"{theirs}{b}.weight" for a, b in names.items()}


def experts(ours: str, theirs: str, router: str, names: dict = SWIGLU) -> dict:
    """A mixture of experts' router and stacked experts: ``{ours}router.weight`` -> ``{theirs}{router}``, and
    ``{ours}w_gate`` (E, hidden, d_model) -> ``{theirs}experts.{e}.gate_proj.weight``, one per expert, ..."""
    return {f"{ours}router.weight": theirs + router,
            **{f"{ours}{a}": f"{theirs}experts.{{e}}.{b}.weight" for a, b in names.items()}}


@functools.lru_cache(maxsize=None)
def _pattern(p: str) -> re.Pattern:
    return re.compile(re.escape(p).replace(r"\{p\}", "(?P<p>.+)") + r"\Z")


def _rename(name: str, table: dict):
    for ours, theirs in table.items():
        m = _pattern(ours).match(name)
        if m:
            return theirs.replace("{p}", m.groupdict().get("p", ""))
    return None


class Format:
    """One Hugging Face ``model_type``: its config to a ``ModelConfig`` (``config``) and back (``to_config``),
    which built models it can hold (``matches``), its name tables (module doc) and, where the checkpoint
    fuses, splits or shifts tensors, ``unpack`` (checkpoint -> one tensor per subquad name) and ``pack``."""

    model_type = ""
    conv_bias_key = None             # the config field that turns the mixers' convolution bias off, if any
    any_mlp = False                  # matches() checks ModelConfig.mlp_kind and mlp_layers itself; else the saver
                                     # holds the type to SwiGLUs in every layer
    any_mamba2 = False               # matches() checks Mamba-2's d_inner and gated_norm itself; else the saver holds
                                     # the type to expand x d_model wide Mamba-2 layers with the gated norm
    any_block = False                # matches() checks ModelConfig.parallel itself; else the saver refuses it
    any_norm = False                 # matches() checks ModelConfig.norm and embed_norm itself; else RMSNorms only
    shared_blocks = False            # matches() checks ModelConfig.shared itself; else the saver refuses shared blocks
    hyper_connections = False        # matches() checks ModelConfig.hyper itself; else the saver refuses it
    latent_moe = False               # matches() holds a MoE with ``latent`` experts; else plain() refuses one
    gates_and_sandwich = False       # matches() checks ModelConfig.sandwich_norm and attention's head_gate
                                     # itself; else plain() refuses them
    sigmoid_gdn_gate = False         # matches() checks the Gated DeltaNet's output_gate; else silu only
    not_loaded: dict = {}            # checkpoint name prefix -> what it holds, left out with a warning (a vision
                                     # tower beside the language model, a multi-token-prediction head)
    top = TOP
    layer = "model.layers.{i}."
    layers: dict = {}
    # a multi-token-prediction head (``models.mtp``) in the checkpoint: how many of the format's layers its block
    # spans ("mtp.layers.0." ...: Nemotron-H's attention and MoE are two), its own tensors' names, and the mixer of
    # its block (a ``layers`` table's key: Ling's head attends by MLA)
    mtp_layers = 1
    mtp_own = {"mtp.fc.weight": "mtp.fc.weight", "mtp.norm.weight": "mtp.norm.weight",
               "mtp.norm_embed.weight": "mtp.pre_fc_norm_embedding.weight",
               "mtp.norm_hidden.weight": "mtp.pre_fc_norm_hidden.weight"}
    mtp_mixer = "softmax"

    @staticmethod
    def mtp_fields(head) -> dict:
        """Config fields that declare a multi-token-prediction head ``head`` in a saved folder ({}: none needed)."""
        return {}

    @staticmethod
    def mtp_prefix(cfg: ModelConfig) -> tuple[str, str]:
        """(the checkpoint's prefix of the MTP tensors, the name it is read as): "mtp." as itself; Ling's head is
        the layer after the decoder layers, "model.layers.{n_layers}." read as "mtp.layers.0."."""
        return "mtp.", "mtp."

    @staticmethod
    def config(c: dict) -> ModelConfig:
        raise NotImplementedError

    @staticmethod
    def to_config(cfg: ModelConfig, opts: dict) -> dict:
        raise NotImplementedError

    @classmethod
    def matches(cls, cfg: ModelConfig, opts: dict) -> bool:
        """Whether a model of this config, whose layers were built with ``opts`` (``layer_options``), is this
        type - what ``save_pretrained`` writes it as."""
        raise NotImplementedError

    @classmethod
    def plain(cls, cfg: ModelConfig, opts: dict) -> bool:
        """Whether the model leaves off the options most formats have no field for (an MLP other than SwiGLU or
        a biased one, a MoE with latent experts, LayerNorms or a norm on the embeddings, scaled embeddings, capped
        logits, a bias on attention's output or its scores scaled other than by K^-1/2, sandwich norms, a gate per
        attention head, a Gated DeltaNet's sigmoid output gate): ``save_pretrained`` asks this before
        ``matches``, so no format drops them silently. A format that holds them overrides it."""
        plain_mlp = cls.any_mlp or (cfg.mlp_kind == "swiglu" and cfg.mlp_layers is None)
        plain_norm = cls.any_norm or (cfg.norm == "rms" and not cfg.embed_norm and not cfg.norm_bias)
        plain_moe = cls.latent_moe or cfg.moe is None or cfg.moe.get("latent") is None
        plain_gates = cls.gates_and_sandwich or (not cfg.sandwich_norm
                                                 and not any(o.get("head_gate") for o in opts.values()))
        plain_gdn = cls.sigmoid_gdn_gate or (opts.get("gated_deltanet") or {}).get("output_gate", "silu") == "silu"
        return (plain_mlp and plain_norm and plain_moe and plain_gates and plain_gdn and not cfg.mlp_bias
                and cfg.embed_scale is None
                and cfg.logit_soft_cap is None
                and not any(o.get("o_bias") or o.get("scale") is not None for o in opts.values()))

    @classmethod
    def unpack(cls, tensors: dict, cfg: ModelConfig, dtype=None) -> dict:
        return tensors

    @classmethod
    def drop_not_loaded(cls, tensors: dict) -> dict:
        """``tensors`` less those under a ``not_loaded`` prefix, with one warning naming what was left out."""
        dropped, out = {}, {}
        for name, t in tensors.items():
            skip = next((p for p in cls.not_loaded if name.startswith(p)), None)
            if skip is None:
                out[name] = t
            else:
                dropped[skip] = dropped.get(skip, 0) + 1
        if dropped:
            warnings.warn(f"{cls.model_type}: not loaded (subquad loads the language model alone): "
                          + ", ".join(f"{cls.not_loaded[p]} ({p}*, {k} tensors)" for p, k in dropped.items()),
                          stacklevel=4)
        return out

    @classmethod
    def pack(cls, tensors: dict, cfg: ModelConfig) -> dict:
        return tensors

    @classmethod
    def names(cls, cfg: ModelConfig, shapes: dict) -> dict:
        """subquad name -> the checkpoint's (a tuple of names: stacked experts) for every tensor of a model's
        state dict, given as {name: shape}; ValueError for a name no pattern matches."""
        out = {}
        for ours, shape in shapes.items():
            head, _, rest = ours.partition(".")
            if head == "blocks":
                i, _, rest = rest.partition(".")
                kind = cfg.layers[int(i)]
                theirs = _rename(rest, cls.layers.get(kind, {})) or _rename(rest, cls.layers.get("*", {}))
                theirs = None if theirs is None else cls.layer.format(i=i) + theirs
            else:
                theirs = _rename(ours, cls.top)
            if theirs is None:
                raise ValueError(f"{cls.model_type}: no checkpoint name for subquad's {ours}")
            out[ours] = tuple(theirs.replace("{e}", str(e)) for e in range(shape[0])) if "{e}" in theirs else theirs
        flat = [t for v in out.values() for t in (v if isinstance(v, tuple) else (v,))]
        if len(flat) != len(set(flat)):
            raise ValueError(f"{cls.model_type}: several subquad tensors map to one checkpoint name")
        return out


# -- config translation -------------------------------------------------------------------------------


def require(c: dict, key: str, value):
    """Refuse a config whose ``key`` is present and not ``value`` (the one setting subquad implements)."""
    if key in c and c.get(key) != value:
        raise ValueError(f"config field {key}={c[key]!r} is not supported (subquad implements {key}={value!r})")


def config_float(v) -> float:
    """A float from config.json; transformers writes infinities as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def json_float(v: float):
    """The inverse of ``config_float``."""
    return {"__float__": "Infinity" if v > 0 else "-Infinity"} if math.isinf(v) else v


def transformer_config(c: dict, pattern: str, eps: float, **fields) -> ModelConfig:
    """The fields every hybrid with attention and MLPs shares (hidden size, layers, heads, MLP width)."""
    return ModelConfig(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
                       n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads"), pattern=pattern,
                       mlp=True, mlp_size=c["intermediate_size"], norm_eps=eps,
                       tie_embeddings=c.get("tie_word_embeddings", False), context_length=1 << 20, **fields)


def check_layer_types(types: list, n: int) -> list:
    """``types`` if it names "linear_attention" or "full_attention" for each of the ``n`` layers, else ValueError."""
    if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"config field layer_types={types!r} must name 'linear_attention' or 'full_attention' "
                         f"for each of the {n} layers")
    return types


def check_rope_type(rope: dict) -> None:
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"config field rope_parameters.rope_type={rope['rope_type']!r} is not supported "
                         "(subquad implements 'default')")


def plain_moe(m: dict) -> bool:
    """A softmax-routed MoE placed by every/offset (Jamba's, Qwen3-Next's)."""
    return m["router"] == "softmax" and m["layers"] is None and m["scale"] == 1.0


# -- the Mamba hybrids (bamba, jamba) ---------------------------------------------------------------

HYBRID_TOP = {**TOP, "norm.weight": "model.final_layernorm.weight"}
HYBRID_BLOCK = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "pre_ff_layernorm.weight",
                **swiglu("mlp.", "feed_forward."), **experts("mlp.", "feed_forward.", "router.weight")}


def check_hybrid(c: dict) -> None:
    """The fields Bamba and Jamba share that subquad implements one way."""
    require(c, "hidden_act", "silu")
    require(c, "mamba_proj_bias", False)
    require(c, "attention_bias", False)
    require(c, "mlp_bias", False)
    hd = c.get("head_dim")
    if hd is not None and hd != c["hidden_size"] // c["num_attention_heads"]:
        raise ValueError(f"config field head_dim={hd} is not supported (subquad's attention uses hidden_size / "
                         f"num_attention_heads = {c['hidden_size'] // c['num_attention_heads']})")


def mamba2_options(c: dict, eps: float) -> dict:
    """The ``mamba2`` layers' options from the ``mamba_*`` fields (Bamba's, kept by Granite 4)."""
    H, E = c["hidden_size"], c.get("mamba_expand", 2)
    heads = c.get("mamba_n_heads", 128)
    hd = c.get("mamba_d_head", "auto")
    hd = E * H // heads if hd == "auto" else hd
    if heads * hd != E * H:
        raise ValueError(f"config fields mamba_n_heads={heads} x mamba_d_head={hd} must equal mamba_expand x "
                         f"hidden_size = {E * H}")
    m2 = {"d_state": c.get("mamba_d_state", 256), "head_dim": hd, "expand": E, "conv_size": c.get("mamba_d_conv", 4),
          "n_groups": c.get("mamba_n_groups", 1), "norm_eps": eps}
    limit = tuple(config_float(v) for v in (c.get("time_step_limit") or (0.0, float("inf"))))
    if limit != (0.0, float("inf")):
        m2["dt_limit"] = limit
    return m2


def mamba2_config(cfg: ModelConfig, o: dict) -> dict:
    """The inverse of ``mamba2_options``: the ``mamba_*`` fields."""
    return {"mamba_n_heads": o["expand"] * cfg.d_model // o["head_dim"], "mamba_d_head": o["head_dim"],
            "mamba_n_groups": o["n_groups"], "mamba_d_state": o["d_state"], "mamba_d_conv": o["conv_size"],
            "mamba_expand": o["expand"], "mamba_conv_bias": True, "mamba_proj_bias": False,
            "time_step_limit": [json_float(v) for v in o["dt_limit"]]}


def plain_attention(cfg: ModelConfig, opts: dict) -> bool:
    """Softmax layers (if any) without q/k norms or an output gate, heads of d_model / n_heads, in pre-norm
    blocks (Bamba's and Jamba's)."""
    a = opts.get("softmax")
    return not cfg.post_norm and cfg.scaled_residual is None and (
        a is None or (a["qk_norm"] is None and not a["output_gate"] and a["head_dim"] * cfg.n_heads == cfg.d_model))


# -- the Gated DeltaNet hybrids (qwen3_next, olmo_hybrid) ----------------------------------------------

FLA_L2_EPS = 1e-6                # both L2-normalise q and k as fla does: x rsqrt(|x|^2 + 1e-6)


def gdn_layer_types(c: dict, n: int) -> list:
    """``layer_types``, or full attention every ``full_attention_interval``-th layer (default 4)."""
    types = c.get("layer_types")
    if types is None:
        every = c.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    return check_layer_types(types, n)


def gdn_rope(c: dict, partial_default: float) -> dict:
    """The softmax layers' rotary options from rope_parameters - absent: the legacy fields or the defaults,
    as transformers reads it; a null rope_theta: no positions (NoPE, OLMo-Hybrid's released checkpoints)."""
    rope = c.get("rope_parameters")
    if rope is None:
        rope = {"rope_theta": c.get("rope_theta", 10000.0),
                "partial_rotary_factor": c.get("partial_rotary_factor", partial_default)}
    if rope.get("rope_theta") is None:
        return {"rotary": False}
    check_rope_type(rope)
    return {"rotary": True, "rotary_base": float(rope["rope_theta"]),
            "rotary_fraction": float(rope.get("partial_rotary_factor", partial_default))}


def gdn_options(c: dict, norm_eps: float, neg: bool) -> dict:
    """The ``gated_deltanet`` layers' options from the config's ``linear_*`` fields."""
    return {"n_heads": c["linear_num_value_heads"], "n_key_heads": c["linear_num_key_heads"],
            "head_dim": c["linear_key_head_dim"], "value_head_dim": c["linear_value_head_dim"],
            "conv_size": c.get("linear_conv_kernel_dim", 4), "open_gate": False, "qk_eps": FLA_L2_EPS,
            "allow_neg_eigval": neg, "norm_eps": norm_eps}


def gdn_config(o: dict) -> dict:
    """The inverse of ``gdn_options``: the config's ``linear_*`` fields."""
    return {"linear_num_value_heads": o["n_heads"], "linear_num_key_heads": o["n_key_heads"],
            "linear_key_head_dim": o["head_dim"], "linear_value_head_dim": o["value_head_dim"],
            "linear_conv_kernel_dim": o["conv_size"]}


def gated_attention(a: dict | None, norm_eps: float) -> bool:
    """Softmax layers' built options (None: no such layers) as Qwen3-Next's gated attention has them: an output
    gate, per-head q/k norms of the model's eps, rotary, no window."""
    return a is None or (a["output_gate"] and a["qk_norm"] == "head" and a["qk_norm_eps"] == norm_eps and a["rotary"]
                         and a["window"] is None)


def gdn_matches(o: dict, norm_eps: float, neg) -> bool:
    """Built layer options ``o`` that ``gdn_options`` could have made (``neg`` None: either beta range)."""
    return (not o["open_gate"] and o["qk_eps"] == FLA_L2_EPS and o["norm_eps"] == norm_eps
            and (neg is None or o["allow_neg_eigval"] == neg))


def attention_types(cfg: ModelConfig, attention: str = "softmax") -> list:
    """``layer_types`` of a model: "full_attention" at its ``attention`` layers, "linear_attention" elsewhere."""
    return ["full_attention" if n == attention else "linear_attention" for n in cfg.layers]


# -- tensor reshuffles --------------------------------------------------------------------------------


def join_convs(tensors: dict, module: str) -> dict:
    """``{module}.q_conv1d``, ``k_conv1d``, ``v_conv1d`` (written per part by OLMo-Hybrid and Kimi Linear) ->
    one ``{module}.conv1d`` over [q, k, v], as transformers and subquad hold it; other tensors as they are."""
    out = dict(tensors)
    for name in list(tensors):
        if name.endswith(f"{module}.q_conv1d.weight"):
            p = name.removesuffix("q_conv1d.weight")
            parts = [p + f"{x}_conv1d.weight" for x in "qkv"]
            if all(x in out for x in parts):
                out[p + "conv1d.weight"] = torch.cat([out.pop(x) for x in parts], 0)
    return out


def split_conv(name: str, t: torch.Tensor, sizes: list) -> dict:
    """The inverse of ``join_convs`` for one ``...conv1d.weight``: its q, k, v parts by ``sizes``."""
    p = name.removesuffix("conv1d.weight")
    return {p + f"{x}_conv1d.weight": part for x, part in zip("qkv", t.split(sizes, 0))}


# -- the folder ---------------------------------------------------------------------------------------

# What a field's name says its value is, as transformers' configs use the names. A format reads its config
# through ``HFConfig``, which checks each field it reads against these, so a wrong type is one line naming
# the field, never a TypeError in the forward pass or a string repeated ("64" * 2 = "6464").
_INT = re.compile(r"(^|_)(size|dim|heads|groups|experts|rank|period|offset|interval|kernel|expand|top_k|"
                  r"experts_per_tok|window|length|embeddings|state|conv|head)$|^(num|n)_|_(heads|layers|groups)_")
_FLOAT = re.compile(r"(eps|epsilon|theta|factor|multiplier|scale|scaling|cap|coef|range|std)$|^time_step_(min|max|floor)$")
_BOOL = re.compile(r"^(use|tie|has|is|add|norm)_|_bias$|^(rms_norm|residual_in_fp32)$")
_INT_LIST = re.compile(r"_(indices|ids)$|^(?!(num|n)_).*_layers$")     # full_attn_layers, not num_hidden_layers


def _expected(key: str) -> str | None:
    if key.endswith("token_id"):
        return "token id"
    if _INT_LIST.search(key):
        return "list of ints"
    if _FLOAT.search(key):
        return "number"
    if _BOOL.search(key):
        return "bool"
    if _INT.search(key):
        return "int"
    return None


def _type_ok(kind: str, v) -> bool:
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if kind == "int":
        return is_int or v == "auto"                  # transformers' "auto": sized from the others (Mamba's ranks)
    if kind == "number":
        return is_int or isinstance(v, float) or (isinstance(v, dict) and "__float__" in v)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "list of ints":
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    return is_int or (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v))


class HFConfig(dict):
    """A config.json as a dict that checks each field it hands out: ``c["hidden_size"]`` is an int or a
    ValueError naming the field and the type expected; a field a format requires and the file lacks (or
    holds as null) is named too. ``c.get(key)`` allows absence and null (the format's default applies).
    Nested objects (``rope_parameters``, ``text_config``) come back as HFConfigs named by their path."""

    def __init__(self, d: dict, where: str = "config.json", prefix: str = ""):
        super().__init__(d)
        self.where, self.prefix = where, prefix

    def _check(self, key, v):
        if isinstance(v, dict) and not (len(v) == 1 and "__float__" in v):
            return HFConfig(v, self.where, f"{self.prefix}{key}.")
        kind = _expected(key) if isinstance(key, str) else None
        if v is not None and kind is not None and not _type_ok(kind, v):
            raise ValueError(f"{self.where}: field {self.prefix}{key} must be {'an' if kind == 'int' else 'a'} "
                             f"{kind}, got {v!r} ({type(v).__name__})")
        return v

    def __getitem__(self, key):
        if key not in self:
            raise ValueError(f"{self.where}: the required field {self.prefix}{key} is missing")
        v = super().__getitem__(key)
        if v is None:
            raise ValueError(f"{self.where}: field {self.prefix}{key} is null; it must be set")
        return self._check(key, v)

    def get(self, key, default=None):
        return self._check(key, super().get(key, default))


def read_file_json(path: Path, what: str = "") -> dict:
    """A JSON object from ``path``; ValueError naming the file for anything else (invalid JSON, not an object)."""
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON{what} ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: must hold a JSON object{what}, got a {type(out).__name__}")
    return out


def check_folder(path) -> Path:
    """``path`` as a local model folder, or a ValueError saying what it is instead (a hub id among them)."""
    p = Path(path)
    if p.is_dir():
        return p
    s = str(path)
    if not p.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", s):
        raise ValueError(f"{s!r} is not a local folder. subquad reads local model folders only and downloads "
                         f"nothing; fetch it first, e.g. `hf download {s} --local-dir {s.split('/')[-1]}`, "
                         f"then pass that folder")
    raise ValueError(f"{s} is not a model folder: " + ("it is a file" if p.exists() else "no such folder"))


def read_json(path) -> HFConfig:
    """The folder's config.json as an ``HFConfig``."""
    path = check_folder(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not a model folder: it has no config.json")
    return HFConfig(read_file_json(path / "config.json"), str(path / "config.json"))


def eos_token_ids(path, config: dict | None = None) -> list[int]:
    """The folder's end-of-text ids, where transformers' ``generate`` stops: ``eos_token_id`` (an int or a
    list) of ``generation_config.json`` when it names one, else of ``config.json``; [] when neither does."""
    path = Path(path)
    gen = path / "generation_config.json"
    for source in ([read_file_json(gen)] if gen.exists() else []) + [config or read_json(path)]:
        eos = dict.get(source, "eos_token_id")
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
        return sorted(set(ids))
    return []


def chat_template_source(files: dict) -> tuple[dict, str | None]:
    """(``tokenizer_config.json``, the chat template) of a folder's files ({name: bytes}): the config's
    ``chat_template`` (a string, or the "default" of a list of named ones), else ``chat_template.jinja``'s text;
    ({}, None) for none. transformers' rule, and llama.cpp's converter's (gguf-py ``SpecialVocab``)."""
    config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
    source = config.get("chat_template")
    if isinstance(source, list):
        source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}.get("default")
    if source is None and "chat_template.jinja" in files:
        source = files["chat_template.jinja"].decode("utf-8")
    return config, source or None


def all_finite(t, block=1 << 22) -> bool:
    """Whether ``t`` holds no NaN or inf, checked ``block`` elements at a time: ``torch.isfinite`` of the whole
    tensor allocates a float copy (its ``abs``) and two masks as large as the tensor, which made loading peak at
    1.7x the weights (the vocabulary matrices are the largest)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + block]).all()) for i in range(0, flat.numel(), block))


class NonFinite(Exception):
    """A weight holding NaN or inf (raised inside the reader, re-raised as ValueError)."""


def _shard_names(index: Path, weight_map: dict) -> list[str]:
    """The index's shard file names, each a relative path inside its folder: the index is data from whoever
    published the folder, and "../x" or "/x" would open a file outside it. Checked on the name, not the
    resolved path: a hub cache's snapshot files are symlinks into its blobs folder, outside the snapshot."""
    names = set(weight_map.values())
    for name in names:
        if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{index}: the shard {name!r} is not a file name inside {index.parent}; refusing it")
    return sorted(names)


def read_weights(path, mapped=()) -> dict:
    """Every tensor of the folder's safetensors file(s), by name; those named in ``mapped`` as views of a
    memory map of their file (``tensorfile.read_safetensors``). A missing shard, a file safetensors cannot
    read (truncated, not safetensors) or a tensor holding NaN or inf is a ValueError naming the file or tensor."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    single = (path / "model.safetensors").exists()
    if index.exists() and not single:           # both: the single file, as transformers reads such a folder
        weight_map = read_file_json(index, " (the shard index)").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: must map tensor names to shard files under 'weight_map'")
        files = _shard_names(index, weight_map)
    elif single:
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} holds no model.safetensors (nor a sharded model.safetensors.index.json)")
    out = {}
    for f in files:
        if not (path / f).is_file():
            raise ValueError(f"{path / f}: the shard is missing (listed in {index.name})")
        def finite(name, t, f=f):
            if t.is_floating_point() and not all_finite(t):
                raise NonFinite(f"{path / f}: weight {name} holds NaN or inf values; refusing to load it")

        try:
            part = read_safetensors(path / f, mapped=mapped, check=finite)
        except NonFinite as e:
            raise ValueError(str(e)) from None
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path / f}: not a readable safetensors file - truncated or damaged? ({e})") from None
        out.update(part)
    if index.exists() and not single:
        absent = sorted(set(weight_map) - set(out))
        if absent:
            raise ValueError(f"{index}: lists weights no shard holds: {', '.join(absent[:5])}")
    return out


# -- a built model's layers ---------------------------------------------------------------------------


def layer_options(model) -> dict:
    """{mixer name: the options its layers were built with, read from the first such layer}: every constructor
    argument (``build_mixer``'s ``build_options``, defaults included), an argument left None (sized by the
    layer: head_dim, dt_rank, gate_rank, ...) as the layer resolved it. No per-mixer code: a new mixer's
    options are here as soon as it is in the table."""
    out = {}
    for block in model.blocks:
        beside = [(block.beside_name, block.beside)] if hasattr(block, "beside") else []     # a ParallelBlock's
        for name, m in [(block.mixer_name, block.mixer)] + beside:
            if name not in out:
                out[name] = {k: getattr(m, k, v) if v is None else v for k, v in m.build_options.items()}
    return out


def plain_mamba2(cfg: ModelConfig, opts: dict) -> bool:
    """No Mamba-2 layers, or ones every Mamba-2 format writes: expand x d_model wide, with the gated norm."""
    o = opts.get("mamba2")
    return o is None or (o["gated_norm"] and o["d_inner"] == o["expand"] * cfg.d_model)


def first_set(c: dict, *names, default=None):
    """The first of ``names`` the config sets (transformers writes aliases: num_experts for num_local_experts)."""
    for n in names:
        if c.get(n) is not None:
            return c[n]
    return default


def deepseek_moe(c: dict, sparse: list, *, experts: int, hidden: int, groups: int, topk_groups: int,
                 scale: float) -> dict:
    """``ModelConfig.moe`` of DeepSeek-V3's mixture of experts as Kimi Linear and Ling write it: a sigmoid router
    with the score-correction bias, grouped top-k, ``routed_scaling_factor``, an ungated shared expert of
    ``num_shared_experts`` x ``moe_intermediate_size``; ``sparse`` the MoE layers, the keywords the defaults of
    the type's released config."""
    hidden = c.get("moe_intermediate_size", hidden)
    return {"experts": first_set(c, "num_experts", "num_local_experts", default=experts),
            "top_k": first_set(c, "num_experts_per_token", "num_experts_per_tok", default=8),
            "hidden": hidden, "shared": hidden * first_set(c, "num_shared_experts", "n_shared_experts", default=1),
            "shared_gate": False, "router": "sigmoid", "groups": first_set(c, "num_expert_group", "n_group",
                                                                            default=groups),
            "topk_groups": c.get("topk_group") or topk_groups, "scale": float(c.get("routed_scaling_factor", scale)),
            "renormalize": bool(first_set(c, "moe_renormalize", "norm_topk_prob", default=True)),
            "aux_loss_coef": 0.0, "layers": sparse}


def deepseek_moe_fields(m: dict, cfg: ModelConfig) -> dict:
    """``deepseek_moe``'s inverse: the config fields of the MoE ``m``."""
    hidden = m["hidden"] or cfg.mlp_hidden
    return {"num_experts": m["experts"], "num_experts_per_token": m["top_k"], "moe_intermediate_size": hidden,
            "num_shared_experts": m["shared"] // hidden, "num_expert_group": m["groups"],
            "topk_group": m["topk_groups"], "routed_scaling_factor": m["scale"], "moe_renormalize": m["renormalize"]}


def deepseek_moe_holds(m: dict | None, cfg: ModelConfig) -> bool:
    """Whether ``deepseek_moe_fields`` can write the MoE ``m`` (None: no MoE, held)."""
    if m is None:
        return True
    hidden = m["hidden"] or cfg.mlp_hidden
    return m["router"] == "sigmoid" and not m["shared_gate"] and m["shared"] > 0 and m["shared"] % hidden == 0
