"""Writing a subquad ``LanguageModel`` as a Hugging Face model folder (``save_pretrained``): the first format
(``registry.MAPPINGS``) whose structure the model has, its config and its tensors under the checkpoint's
names - a folder that ``from_pretrained`` and transformers read back."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from subquad.models.hf.common import layer_options, plain_mamba2
from subquad.models.hf.registry import MAPPINGS


def save_pretrained(model, path, tokenizer=None, model_type: str | None = None) -> None:
    """Write ``model`` as a Hugging Face folder: config.json, model.safetensors, generation_config.json and the
    tokenizer. The model must have the structure of a supported type: ``model_type`` when given (several
    types can hold one structure: a Qwen3.5 model is also a Qwen3-Next one), else the type of the folder it
    was read from when that type can hold it, else the first of ``registry.MAPPINGS`` that can.

    A model read by ``from_pretrained`` writes back what its folder held beside the weights: every config
    field (``bos/eos/pad_token_id``, ``max_position_embeddings``, fields subquad reads but does not use)
    under the fields the format writes, and the tokenizer and generation files as they were. ``tokenizer``
    (a ``tokenizers.Tokenizer``) is written as tokenizer.json in place of any such file. A quantised model
    (``models.quant``) is written in subquad's own format with its quantised weights (``save_quantized``).
    """
    if getattr(model, "quantized", None):
        if model_type not in (None, PLAIN):
            raise ValueError(f"a quantised model ({model.quantized}) is written in subquad's own format "
                             f"(model_type {PLAIN!r}), not as {model_type!r}: no Hugging Face type holds its weights")
        return save_quantized(model, path, tokenizer)
    if model_type == PLAIN:
        return save_plain(model, path, tokenizer)
    cfg = model.config
    model_type, opts, tensors = checkpoint_tensors(model, model_type)
    fmt = MAPPINGS[model_type]
    source = getattr(model, "hf_source", None) or {"config": {}, "files": {}}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_weights(path, tensors, {"format": "pt"})
    conf = fmt.to_config(cfg, opts)
    if getattr(model, "mtp", None) is not None:       # the multi-token-prediction head written: declared
        conf.update(fmt.mtp_fields(model.mtp))
    if cfg.eos_token_ids:
        conf["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids
    if source["config"].get("model_type") == conf["model_type"]:     # what the format does not write, kept
        conf = {**{k: v for k, v in source["config"].items() if k not in ("dtype", "torch_dtype")}, **conf}
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        conf["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    _write(path / "config.json", json.dumps(conf, indent=1).encode())
    files = dict(source["files"])
    if "generation_config.json" not in files:
        gen = {k: conf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if conf.get(k) is not None}
        files["generation_config.json"] = json.dumps(gen, indent=1).encode()
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer.to_str().encode()
    for name, data in files.items():
        _write(path / name, data)


def checkpoint_tensors(model, model_type: str | None = None) -> tuple[str, dict, dict]:
    """(the Hugging Face type ``model`` is written as - ``save_pretrained``'s choice -, its layer options, and
    {checkpoint name: tensor} on the CPU, as that type's checkpoint holds them); ValueError as ``save_pretrained``."""
    cfg = model.config
    model_type, opts = _format_for(model, model_type)
    fmt = MAPPINGS[model_type]
    own = model.state_dict()
    mtp = {k: own.pop(k) for k in [k for k in own if k.startswith("mtp.")]}
    tensors = {}
    for ours, theirs in fmt.names(cfg, {k: v.shape for k, v in own.items()}).items():
        t = own[ours].detach().cpu()
        if isinstance(theirs, tuple):                       # stacked experts: one tensor each
            tensors.update({name: part.contiguous() for name, part in zip(theirs, t.unbind(0))})
        else:
            tensors[theirs] = t.contiguous()
    tensors = {n: t.contiguous() for n, t in fmt.pack(tensors, cfg).items()}
    if mtp:                                             # a multi-token-prediction head (models.mtp)
        from subquad.models.hf.mtp_names import pack_mtp

        tensors.update(pack_mtp(fmt, model.mtp, mtp, cfg))
    return model_type, opts, tensors


def _format_for(model, model_type: str | None) -> tuple[str, dict]:
    """(the model type to write ``model`` as - see ``save_pretrained`` - and the model's layer options);
    ValueError when that type, or every type, cannot hold its structure."""
    cfg = model.config
    opts = layer_options(model)
    def holds(f):                                   # plain: no option the format would drop (Format.plain)
        return (f.plain(cfg, opts) and f.matches(cfg, opts) and (f.any_mamba2 or plain_mamba2(cfg, opts))
                and (f.any_block or not cfg.parallel) and (f.shared_blocks or cfg.shared is None)
                and (f.hyper_connections or cfg.hyper is None))

    if model_type is not None and (model_type not in MAPPINGS or not holds(MAPPINGS[model_type])):
        raise ValueError(f"this model (pattern {cfg.pattern!r}, mlp={cfg.mlp}, moe={cfg.moe}) cannot be written as "
                         f"model_type {model_type!r}; supported: {', '.join(sorted(MAPPINGS))}")
    source = getattr(model, "hf_source", None) or {"config": {}, "files": {}}
    if model_type is None and source["config"].get("model_type") in MAPPINGS \
            and holds(MAPPINGS[source["config"]["model_type"]]):
        model_type = source["config"]["model_type"]                # what it was read as
    if model_type is None:
        model_type = next((name for name, f in MAPPINGS.items() if holds(f)), None)
    if model_type is None:
        raise ValueError(f"no Hugging Face model type has this structure (pattern {cfg.pattern!r}, mlp={cfg.mlp}, "
                         f"moe={cfg.moe}, options {cfg.mixer_options}){_nearest(cfg, opts)}; supported: "
                         f"{', '.join(sorted(MAPPINGS))}; model_type='subquad' writes any model in subquad's own "
                         "format")
    return model_type, opts


IGNORED = ("context_length", "eos_token_ids", "mixer_options")     # not what decides a type (or too long to say)


def _nearest(cfg, opts) -> str:
    """"; nearest: TYPE, which needs FIELD=VALUE (this model: VALUE), ..." for the types of the same mixers whose
    config, written and read back, differs from ``cfg`` in the fewest fields (at most 5), or ""."""
    import dataclasses

    mixers = set(cfg.pattern.replace("*", ",").split(","))
    found = []
    for name, f in MAPPINGS.items():
        try:
            back = f.config(f.to_config(cfg, opts))
        except Exception:                      # a type that cannot even describe it
            continue
        if set(back.pattern.replace("*", ",").split(",")) != mixers:
            continue
        diffs = [(k.name, getattr(back, k.name), getattr(cfg, k.name)) for k in dataclasses.fields(cfg)
                 if k.name not in IGNORED and getattr(back, k.name) != getattr(cfg, k.name)
                 and not (k.name == "mlp_size" and getattr(cfg, k.name) is None)
                 and not (k.name == "pattern" and back.layers == cfg.layers)      # 'a,a' is 'a' over 2 layers
                 and not (k.name == "n_kv_heads" and (back.n_kv_heads or back.n_heads) == (cfg.n_kv_heads
                                                                                           or cfg.n_heads))]
        diffs += [(f"{m}.{key}", want, opts.get(m, {}).get(key)) for m, o in back.mixer_options.items()
                  for key, want in o.items() if m in opts and key in opts[m] and opts[m][key] != want]
        if 0 < len(diffs) <= 5:
            found.append((len(diffs), name, diffs))
    if not found:
        return ""
    n, name, diffs = min(found)
    return f"; nearest: {name}, which needs " + ", ".join(f"{k}={want!r} (this model: {have!r})"
                                                         for k, want, have in diffs)


PLAIN = "subquad"     # a folder of any subquad model: its own config, its own parameter names


def hf_type(model) -> str | None:
    """The Hugging Face model type ``save_pretrained`` would write this model as, or None when no type has its
    structure."""
    try:
        return _format_for(model, None)[0]
    except ValueError:
        return None


def save_plain(model, path, tokenizer=None) -> None:
    """Write any subquad model as a folder ``from_pretrained`` reads: config.json ``{"model_type": "subquad",
    "config": ModelConfig}``, model.safetensors under subquad's parameter names, generation_config.json and
    the tokenizer. transformers has no such type: ``save_pretrained`` writes one for models of its types."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_weights(path, {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, {"format": "pt"})
    cfg = model.config
    _write(path / "config.json", json.dumps({"model_type": PLAIN, "config": cfg.to_dict()}, indent=1).encode())
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids or []) == 1 else cfg.eos_token_ids
    _write(path / "generation_config.json", json.dumps({"eos_token_id": eos} if eos else {}, indent=1).encode())
    if tokenizer is not None:
        _write(path / "tokenizer.json", tokenizer.to_str().encode())


def _write_weights(path: Path, tensors: dict, metadata: dict) -> None:
    """model.safetensors written whole (a temporary file, then a rename); then a sharded set an earlier save left
    in the folder - model.safetensors.index.json and the shards it names (``model-NNNNN-of-NNNNN.safetensors``)
    - removed: the folder holds one set of weights, not two that transformers and other readers could choose
    between differently (an export over a sharded folder once loaded the old weights here)."""
    from subquad.tensorfile import save_file

    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return
    try:
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        shards = set()
    for name in shards:
        if isinstance(name, str) and re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name):
            (path / name).unlink(missing_ok=True)
    index.unlink()


def _write(file: Path, data: bytes) -> None:
    """Write a file whole or not at all (a temporary file, then a rename)."""
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, file)


def save_quantized(model, path, tokenizer=None) -> None:
    """Write a quantised model as a folder ``from_pretrained`` reads back into the same quantised model:
    config.json ``{"model_type": "subquad", "config": ModelConfig, "quantization": {"kind", "group_size"}}``,
    model.safetensors of its state dict under subquad's names (int8: ``q`` int8 and ``scale``; int4: ``q``
    (``pair_k``'s CPU-independent nibbles), ``scale`` and ``zero`` bfloat16; bf16: ``w``; the rest float32),
    generation_config.json and the tokenizer files of the folder it was read from (or ``tokenizer``)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_weights(path, {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                   {"format": "pt", "quantization": model.quantized})
    cfg = model.config
    quantization = {"kind": model.quantized, "group_size": getattr(model, "quant_group_size", None)}
    _write(path / "config.json", json.dumps({"model_type": PLAIN, "config": cfg.to_dict(),
                                             "quantization": quantization}, indent=1).encode())
    files = dict((getattr(model, "hf_source", None) or {}).get("files", {}))
    if "generation_config.json" not in files:
        eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids or []) == 1 else cfg.eos_token_ids
        files["generation_config.json"] = json.dumps({"eos_token_id": eos} if eos else {}, indent=1).encode()
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer.to_str().encode()
    for name, data in files.items():
        _write(path / name, data)
