"""Saving and loading a model's decoding state (safetensors), to continue generating later."""

from __future__ import annotations

import json
import os
from pathlib import Path


from subquad.ops import KVCache


def state_to_tensors(state) -> tuple[dict, dict]:
    tensors, meta = {}, {}
    for i, s in enumerate(state):
        if isinstance(s, KVCache):
            tensors[f"{i}.k"], tensors[f"{i}.v"] = s.k.contiguous(), s.v.contiguous()
            meta[str(i)] = {"kind": "kv", "seen": s.seen, "window": s.window}
        else:
            for key, t in s.items():
                tensors[f"{i}.{key}"] = t.contiguous()
            meta[str(i)] = {"kind": "dict", "keys": list(s)}
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
        if m["kind"] == "kv":
            state.append(KVCache(tensors[f"{i}.k"], tensors[f"{i}.v"], window=m["window"], seen=m["seen"]))
        else:
            state.append({key: tensors[f"{i}.{key}"] for key in m["keys"]})
    return state, extra
