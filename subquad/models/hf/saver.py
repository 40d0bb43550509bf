"""Writing a subquad ``LanguageModel`` as a Hugging Face model folder (``save_pretrained``): the first format
(``registry.MAPPINGS``) whose structure the model has, its config and its tensors under the checkpoint's
names - a folder that ``from_pretrained`` and transformers read back."""

from __future__ import annotations

import json
import os
from pathlib import Path

from subquad.models.hf.common import layer_options
from subquad.models.hf.registry import MAPPINGS


def save_pretrained(model, path) -> None:
    """Write ``model`` as a Hugging Face folder (config.json, model.safetensors). The model must have the
    structure of a supported type."""
    from safetensors.torch import save_file

    if getattr(model, "quantized", None):
        raise ValueError(f"a quantised model ({model.quantized}) is not saved: save the float model it came from")
    cfg = model.config
    opts = layer_options(model)
    fmt = next((f for f in MAPPINGS.values() if f.plain(cfg, opts) and f.matches(cfg, opts)), None)
    if fmt is None:
        raise ValueError(f"no Hugging Face model type has this structure (pattern {cfg.pattern!r}, mlp={cfg.mlp}, "
                         f"moe={cfg.moe}, options {cfg.mixer_options}); supported: {', '.join(sorted(MAPPINGS))}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    own = model.state_dict()
    tensors = {}
    for ours, theirs in fmt.names(cfg, {k: v.shape for k, v in own.items()}).items():
        t = own[ours].detach().cpu()
        if isinstance(theirs, tuple):                       # stacked experts: one tensor each
            tensors.update({name: part.contiguous() for name, part in zip(theirs, t.unbind(0))})
        else:
            tensors[theirs] = t.contiguous()
    tensors = {n: t.contiguous() for n, t in fmt.pack(tensors, cfg).items()}
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")
    conf = fmt.to_config(cfg, opts)
    if cfg.eos_token_ids:
        conf["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids
    (path / "config.json").write_text(json.dumps(conf, indent=1))
