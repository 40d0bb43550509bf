"""Saving and loading a model's decoding state (safetensors), to continue generating later."""

from __future__ import annotations

import json
import os
from pathlib import Path


from subquad.ops import KVCache


def state_to_tensors(state) -> tuple[dict, dict]:
    """Per-layer state dicts -> (flat tensors "layer.key[.k|.v]", metadata for ``load_state``)."""
    tensors, meta = {}, {}
    for i, s in enumerate(state):
        parts = {}
        for key, t in s.items():
            if isinstance(t, KVCache):
                tensors[f"{i}.{key}.k"], tensors[f"{i}.{key}.v"] = t.k.contiguous(), t.v.contiguous()
                parts[key] = {"kind": "kv", "seen": t.seen, "window": t.window}
            else:
                tensors[f"{i}.{key}"] = t.contiguous()
                parts[key] = {"kind": "tensor"}
        meta[str(i)] = {"kind": "dict", "parts": parts}
    return tensors, meta


def save_state(path, state, extra: dict | None = None) -> None:
    """Write the per-layer state atomically (temporary file, then rename)."""
    from safetensors.torch import save_file

    tensors, meta = state_to_tensors(state)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"layers": json.dumps(meta), "extra": json.dumps(extra or {}),
                                           "pos": str(getattr(state, "pos", 0))})
    os.replace(tmp, path)


def load_state(path):
    """Returns (state, extra)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise ValueError(f"state file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["layers"])
            extra = json.loads(f.metadata().get("extra", "{}"))
            pos = int(f.metadata().get("pos", 0))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ValueError(f"state file {path} is truncated or corrupted: {e}") from None
    from subquad.models.lm import ModelState

    state = ModelState(pos=pos)
    for i in range(len(meta)):
        m = meta[str(i)]
        if m["kind"] == "kv":                   # written before every state was a dict: a bare KV cache
            m = {"parts": {"kv": {"kind": "kv", "seen": m["seen"], "window": m["window"]}}}
            tensors[f"{i}.kv.k"], tensors[f"{i}.kv.v"] = tensors[f"{i}.k"], tensors[f"{i}.v"]
        elif "parts" not in m:
            m = {"parts": {key: {"kind": "tensor"} for key in m["keys"]}}
        layer = {}
        for key, part in m["parts"].items():
            if part["kind"] == "kv":
                layer[key] = KVCache(tensors[f"{i}.{key}.k"], tensors[f"{i}.{key}.v"], window=part["window"],
                                     seen=part["seen"])
            else:
                layer[key] = tensors[f"{i}.{key}"]
        state.append(layer)
    return state, extra
