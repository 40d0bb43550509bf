"""Reading a Hugging Face model folder into a subquad ``LanguageModel`` (``from_pretrained``).

The folder's ``model_type`` picks its format (``registry.MAPPINGS``); the format's config translation
builds the model's ``ModelConfig``, its name tables say which checkpoint tensor fills which parameter, and
every tensor must be used exactly once: a missing weight, an unexpected one or a wrong shape is refused by
name. A BlinkDL RWKV-7 ``.pth`` file (or a folder holding one and no config.json) loads the same way, its
config read off its tensors (``rwkv7_pth``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from subquad.data.rwkv_world import VOCAB_FILE as WORLD_VOCAB
from subquad.data.rwkv_world import WorldTokenizer
from subquad.heap import release_freed
from subquad.models.config import ModelConfig
from subquad.models.decode import decode_layout
from subquad.models.hf.common import eos_token_ids, read_json, read_weights
from subquad.models.hf.registry import MAPPINGS
from subquad.models.hf.rwkv7_pth import RWKV7PthFormat, pth_file, read_pth
from subquad.models.hf.saver import PLAIN
from subquad.models.lm import LanguageModel


class PlainFormat:
    """A folder ``save_plain`` wrote: subquad's own config and parameter names (``subquad export`` of a model of
    no Hugging Face type)."""
    conv_bias_key = None

    @staticmethod
    def config(c: dict) -> ModelConfig:
        if not isinstance(c.get("config"), dict):
            raise ValueError("config.json of model_type 'subquad' has no 'config' object (the model's ModelConfig)")
        return ModelConfig.from_dict(c["config"])

    @staticmethod
    def names(cfg, shapes: dict) -> dict:
        return {k: k for k in shapes}

    @staticmethod
    def drop_not_loaded(weights: dict) -> dict:
        return weights

    @staticmethod
    def unpack(tensors: dict, cfg, dtype) -> dict:
        return dict(tensors)


def read_config(path) -> dict:
    """The folder's config.json; ValueError for a folder without one or a ``model_type`` subquad cannot read."""
    c = read_json(path)
    mt = c.get("model_type")
    if mt not in MAPPINGS and mt != PLAIN:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {', '.join(sorted(MAPPINGS))}, and "
                         f"{PLAIN!r} (a folder subquad wrote for a model of no Hugging Face type)")
    return c


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}
# what a saved folder carries beside the weights, kept from the folder a model was read from
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json")


def resolve_dtype(dtype, c: dict | None = None):
    """A torch dtype, None (the checkpoint's own), a name as transformers users write it ("bfloat16",
    "torch.float16", "bf16") or "auto" (the config's ``dtype`` / ``torch_dtype``; none given: the checkpoint's)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name == "auto":
            named = None if c is None else (dict.get(c, "dtype") or dict.get(c, "torch_dtype"))
            return None if named is None else resolve_dtype(named)
        if name in DTYPES:
            return DTYPES[name]
    raise ValueError(f"dtype must be a torch.dtype, None, 'auto' or one of {', '.join(DTYPES)}; got {dtype!r}")


def _tokenizer(path):
    """The folder's tokenizer.json read by ``tokenizers``, or None when it has none."""
    if not (Path(path) / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    except Exception as e:                                                    # noqa: BLE001 - any parse error
        raise ValueError(f"{Path(path) / 'tokenizer.json'}: the tokenizers library cannot read it ({e})") from None


def _from_quantized(path, c, dtype, device, quantize, group_size=None):
    """``from_pretrained`` of a folder ``saver.save_quantized`` wrote."""
    from subquad.models.quant import load_quantized

    kind = (c.get("quantization") or {}).get("kind")
    if quantize not in (None, kind) or resolve_dtype(dtype, c) not in (None, torch.float32) or group_size is not None:
        asked = [f"quantize={quantize!r}"] if quantize not in (None, kind) else []
        asked += [] if group_size is None else [f"group_size={group_size}"]
        asked += [] if resolve_dtype(dtype, c) in (None, torch.float32) else [f"dtype={dtype}"]
        raise ValueError(f"{path} holds a model quantised to {kind}: it loads as it is (quantize None or {kind!r}, "
                         f"its other weights float32), got {' and '.join(asked)}")
    model = load_quantized(path, c)
    if device is not None:
        model.to(device=device)
    model.hf_source = {"config": dict(c), "files": {f: (Path(path) / f).read_bytes() for f in SIDE_FILES
                                                    if (Path(path) / f).is_file()}}
    return model, _tokenizer(path)


def from_pretrained(path, dtype=None, device=None, quantize=None, group_size=None):
    """(LanguageModel in eval mode, tokenizer or None) from a Hugging Face model folder (``models.hf``), or a
    BlinkDL RWKV-7 ``.pth`` (the file, or a folder holding it; the world tokenizer when its vocabulary file
    ``rwkv_vocab_v20230424.txt`` is beside it).
    ``dtype``: ``resolve_dtype``'s forms ("bfloat16", "auto", torch.bfloat16). ``quantize`` "int8", "int4" or
    "bf16" quantises the projections for inference (``models.quant``; from float32). A folder a quantised model
    was saved to loads quantised as it was saved (``quant.load_quantized``; ``quantize`` None or its kind).
    The model keeps the folder's config and its tokenizer and generation files (``model.hf_source``) for
    ``save_pretrained`` to write back. A Qwen3-Next, Qwen3.5, Nemotron-H or Ling 3 folder's multi-token-prediction
    tensors (``mtp.*``; Ling's layer after the decoder layers: ``Format.mtp_prefix``) load as ``model.mtp``
    (``models.mtp``: ``generate(..., speculative="mtp")`` drafts with it).
    A ``.gguf`` file (llama.cpp's format) is ``models.hf.from_pretrained``'s, through ``models.gguf``."""
    pth = pth_file(path)
    if pth is not None:
        c, fmt, weights = {}, RWKV7PthFormat, read_pth(pth)
        cfg = fmt.config_from_weights(weights)
    else:
        c = read_config(path)
        if c["model_type"] == PLAIN and "quantization" in c:
            return _from_quantized(path, c, dtype, device, quantize, group_size)
        if c["model_type"] == PLAIN:
            fmt, weights = PlainFormat, read_weights(path)
            cfg = fmt.config(c)
        else:
            fmt, weights = MAPPINGS[c["model_type"]], None
            cfg = fmt.config(c)
            cfg.eos_token_ids = [t for t in eos_token_ids(path, c) if t < cfg.vocab_size]   # generate stops there
    model = build(path, c, fmt, cfg, weights, dtype, device, quantize, group_size=group_size)
    if quantize is not None:           # the float weights it was quantised from are freed: their pages go back
        weights = None                 # (the heap keeps freed blocks: subquad.heap), not kept at the float size
        release_freed()
    model.hf_source = {"config": dict(c), "files": {f: (Path(path) / f).read_bytes() for f in SIDE_FILES
                                                    if (Path(path) / f).is_file()}}
    tok = None
    if pth is not None and (pth.parent / WORLD_VOCAB).exists():      # RWKV's world vocabulary beside the .pth
        tok = WorldTokenizer.from_file(pth.parent / WORLD_VOCAB)
    elif pth is None:
        tok = _tokenizer(path)
    return model.eval(), tok


def build(path, c: dict, fmt, cfg: ModelConfig, weights: dict | None, dtype=None, device=None, quantize=None,
          finish=None, group_size=None) -> LanguageModel:
    """The model of config ``cfg`` with the checkpoint's tensors ``weights`` ({checkpoint name: tensor}; None:
    read from the folder ``path``) put in place by ``fmt``'s name tables, each used exactly once (module doc).
    ``finish(model, names)`` (a GGUF file's quantised matrices, ``models.gguf``) runs after the tensors are in
    place (``names``: subquad name -> the checkpoint's) and before the decoding layout and ``quantize``."""
    from subquad.models.mtp import MTP_TYPES, load_mtp
    from subquad.models.quant import QUANTIZE

    dtype = resolve_dtype(dtype, c)
    if quantize is not None and (quantize not in QUANTIZE or dtype not in (None, torch.float32)):
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)} with float32 weights, got quantize="
                         f"{quantize!r}, dtype={dtype}")
    with torch.device("meta"):                        # no memory and no random init: the weights come next
        model = LanguageModel(cfg)
    own = model.state_dict()
    names = fmt.names(cfg, {k: v.shape for k, v in own.items()})
    # an untied embedding is looked up a row per token, never multiplied: mapped, not read, its untouched rows
    # (most of a large vocabulary) cost no memory (tensorfile.read_safetensors)
    lookup = names.get("embed.weight") if not cfg.tie_embeddings else None
    weights = read_weights(path, mapped={lookup} if isinstance(lookup, str) else ()) if weights is None else weights
    mtp = {}
    if c.get("model_type") in MTP_TYPES:              # its multi-token-prediction head, when it has one
        src = fmt.mtp_prefix(cfg)[0]
        mtp = {k: weights.pop(k) for k in [k for k in weights if k.startswith(src)]}
    tensors = fmt.unpack(fmt.drop_not_loaded(weights), cfg, dtype)   # fused or shifted -> one per parameter
    del weights
    if fmt.conv_bias_key and c.get(fmt.conv_bias_key, True) is False:   # no conv bias in the checkpoint: zeros
        for ours, theirs in names.items():
            if ours.endswith("mixer.conv.bias"):
                tensors[theirs] = torch.zeros(own[ours].shape)
    wanted = [t for theirs in names.values() for t in (theirs if isinstance(theirs, tuple) else (theirs,))]
    missing = [t for t in wanted if t not in tensors]
    if missing:
        raise ValueError(f"{path}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    extra = set(tensors) - set(wanted) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if extra:
        raise ValueError(f"{path}: unexpected weights in the checkpoint: {', '.join(sorted(extra)[:5])}")
    state = {}
    for ours, theirs in names.items():
        parts = theirs if isinstance(theirs, tuple) else (theirs,)
        want = own[ours].shape[1:] if isinstance(theirs, tuple) else own[ours].shape
        for t in parts:
            if tensors[t].shape != want:
                raise ValueError(f"{path}: weight {t} has shape {tuple(tensors[t].shape)}, the config implies "
                                 f"{tuple(want)}")
        t = torch.stack([tensors.pop(t) for t in parts]) if isinstance(theirs, tuple) else tensors.pop(theirs)
        state[ours] = t.to(dtype) if dtype is not None and t.is_floating_point() else t   # one copy at a time
    model.load_state_dict(state, strict=True, assign=True)
    del state
    if finish is not None:
        finish(model, names)
    if mtp:                                           # speculative decoding's drafter (models.mtp)
        try:
            model.mtp = load_mtp(fmt, cfg, mtp, dtype)
        except ValueError as e:                       # the language model is whole without it: said, not refused
            warnings.warn(f"{c['model_type']}: not loaded: the multi-token-prediction head ({src}*, {len(mtp)} "
                          f"tensors): {e}", stacklevel=2)
        del mtp
    decode_layout(model)                              # the weights as one-token decoding reads them fastest
    if quantize is not None:
        from subquad.models.quant import quantize as quantize_model

        quantize_model(model, quantize, group_size=group_size)
    if device is not None:
        model.to(device=device)
    return model.eval()
