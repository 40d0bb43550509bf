"""A model's decoding state (``ModelState``), and saving and loading it (safetensors) to continue generating later."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from subquad.ops import KVCache


class ModelState(list):
    """Per-layer decoding states, plus ``pos``: how many tokens the model has consumed - an int, or (B,)
    per row when the rows are sequences of different lengths (after a packed prefill)."""

    def __init__(self, layers=(), pos: int = 0):
        super().__init__(layers)
        self.pos = pos


def state_to_tensors(state, contiguous: bool = True) -> tuple[dict, dict]:
    """Per-layer state dicts -> (flat tensors "layer.key[.k|.v]", metadata for ``load_state``); a KV cache gives its
    kept entries, not its spare room. ``contiguous=False``: the tensors as views, nothing copied (``live_bytes``)."""
    own = (lambda t: t.contiguous()) if contiguous else (lambda t: t)
    tensors, meta = {}, {}
    for i, s in enumerate(state):
        parts = {}
        for key, t in s.items():
            if isinstance(t, KVCache):
                tensors[f"{i}.{key}.k"], tensors[f"{i}.{key}.v"] = own(t.k), own(t.v)
                parts[key] = {"kind": "kv", "seen": t.seen, "window": t.window, "ragged": t.ragged}
                if t.ragged:                      # a batch of sequences of different lengths, left-padded
                    tensors[f"{i}.{key}.pad"], tensors[f"{i}.{key}.row_seen"] = t.pad, t.row_seen
            else:
                tensors[f"{i}.{key}"] = own(t)
                parts[key] = {"kind": "tensor"}
        meta[str(i)] = {"kind": "dict", "parts": parts}
    return tensors, meta


def live_bytes(state) -> int:
    """Bytes of what a decoding state (a list of layer dicts, or one layer's dict) has read: ``state_to_tensors``'
    tensors, what ``save_state`` writes - a KV cache's kept entries, not its spare room - counted without copying."""
    layers = [state] if isinstance(state, dict) else state
    return sum(t.nelement() * t.element_size() for t in state_to_tensors(layers, contiguous=False)[0].values())


def save_state(path, state, extra: dict | None = None) -> None:
    """Write the per-layer state atomically (temporary file, then rename) into an existing folder."""
    from subquad.tensorfile import save_file

    if not isinstance(state, (list, tuple)) or not all(isinstance(layer, dict) for layer in state):
        got = type(state).__name__ if not isinstance(state, (list, tuple)) else \
            f"a {type(state).__name__} holding {sorted({type(x).__name__ for x in state})}"
        raise ValueError(f"save_state's state must be a decoding state (a list of one dict per layer, as prefill and "
                         f"generate return), got {got}")
    if not Path(path).parent.is_dir():
        raise ValueError(f"save_state's path {path}: the folder {Path(path).parent} does not exist")
    tensors, meta = state_to_tensors(state)
    pos = getattr(state, "pos", 0)
    if isinstance(pos, torch.Tensor):                # per row: sequences of different lengths
        tensors["pos"], pos = pos.contiguous(), "tensor"
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"layers": json.dumps(meta), "extra": json.dumps(extra or {}),
                                           "pos": str(pos)})
    os.replace(tmp, path)


class _NotAState(Exception):
    """A safetensors file without a state's metadata (``load_state``)."""


def load_state(path):
    """Returns (state, extra)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise ValueError(f"state file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            if "layers" not in (f.metadata() or {}):
                raise _NotAState
            meta = json.loads(f.metadata()["layers"])
            extra = json.loads(f.metadata().get("extra", "{}"))
            pos = f.metadata().get("pos", "0")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            pos = tensors.pop("pos") if pos == "tensor" else int(pos)
    except _NotAState:
        raise ValueError(f"{path} is a safetensors file but not a saved decoding state (its metadata has no 'layers': "
                         "a model's weights? save_state writes states)") from None
    except Exception as e:
        raise ValueError(f"state file {path} is truncated or corrupted: {e}") from None
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
                ragged = part.get("ragged", False)
                layer[key] = KVCache(tensors[f"{i}.{key}.k"], tensors[f"{i}.{key}.v"], window=part["window"],
                                     seen=part["seen"], pad=tensors[f"{i}.{key}.pad"] if ragged else None,
                                     row_seen=tensors[f"{i}.{key}.row_seen"] if ragged else None)
            else:
                layer[key] = tensors[f"{i}.{key}"]
        state.append(layer)
    return state, extra


def check_rows(state, model, rows: int, what: str = "state") -> None:
    """ValueError naming ``what`` where a state passed in cannot be this model's for ``rows`` rows: not a list of
    one dict per layer, a layer's entries not the model's (another model's state), or a batch of other rows.
    Cheap (no tensor is read): the layers' entry names are found once per model; ``check_fits`` checks the rest."""
    keys = getattr(model, "_state_keys", None)
    if keys is None:
        with torch.no_grad():
            keys = model._state_keys = [set(layer) for layer in model.empty_state(1)]
    if not isinstance(state, (list, tuple)) or len(state) != len(keys):
        got = f"{len(state)} layers" if isinstance(state, (list, tuple)) else type(state).__name__
        raise ValueError(f"{what}: a decoding state is a list of one dict per layer ({len(keys)} here), got {got}")
    for i, (layer, want) in enumerate(zip(state, keys)):
        if not isinstance(layer, dict) or set(layer) != want:
            got = sorted(layer) if isinstance(layer, dict) else type(layer).__name__
            raise ValueError(f"{what}: layer {i} holds {got}; this model's holds {sorted(want)} (another model's "
                             "state?)")
        for key, t in layer.items():
            n = t.k.shape[0] if isinstance(t, KVCache) else t.shape[0] if isinstance(t, torch.Tensor) else None
            if n is not None and n != rows:
                raise ValueError(f"{what}: layer {i}'s {key!r} holds {n} rows; the input has {rows}")


def check_fits(state, model, what: str = "state") -> None:
    """ValueError naming ``what`` and the first difference where ``state`` (from ``load_state``, say) is not a
    decoding state of ``model``'s structure: its layers, each layer's entries, their shapes past the batch (a
    KV cache's heads and key and value sizes; its length is the tokens it holds) and dtypes."""
    want = model.empty_state(1)
    if len(state) != len(want):
        raise ValueError(f"{what}: it holds {len(state)} layers; this model has {len(want)}: it was saved from "
                         f"another model")
    for i, (got, ref) in enumerate(zip(state, want)):
        if set(got) != set(ref):
            raise ValueError(f"{what}: layer {i} holds {sorted(got)}; this model's holds {sorted(ref)}: it was "
                             f"saved from another model")
        for key, r in ref.items():
            g = got[key]
            if isinstance(r, KVCache) != isinstance(g, KVCache):
                raise ValueError(f"{what}: layer {i}'s {key!r} is not this model's kind of state")
            pairs = ([(g.k.shape[2:], r.k.shape[2:]), (g.v.shape[2:], r.v.shape[2:])] if isinstance(r, KVCache)
                     else [(g.shape[1:], r.shape[1:])])
            for a, b in pairs:
                if a != b:
                    raise ValueError(f"{what}: layer {i}'s {key!r} is (batch, {', '.join(map(str, a))}); this "
                                     f"model's is (batch, {', '.join(map(str, b))}): it was saved from another model")
            dtypes = (g.k.dtype, r.k.dtype) if isinstance(r, KVCache) else (g.dtype, r.dtype)
            if dtypes[0] != dtypes[1]:
                raise ValueError(f"{what}: layer {i}'s {key!r} is {dtypes[0]}; this model's states are {dtypes[1]}")

