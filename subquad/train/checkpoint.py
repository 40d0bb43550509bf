"""Checkpoints that a kill cannot break.

Each checkpoint is a folder ``ckpt/step_0000500/`` holding ``model.safetensors``,
``optim.safetensors`` and ``meta.json`` (step, configs, the data sampler's RNG
state and the sha256 of both tensor files). It is written under a temporary name
and renamed into place, then the one-line file ``ckpt/latest`` is replaced
atomically; a truncated or altered file fails its checksum with a clear error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch


class CheckpointError(ValueError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _optim_tensors(opt: torch.optim.Optimizer):
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": v.cpu().contiguous() for i, st in sd["state"].items() for k, v in st.items()
               if isinstance(v, torch.Tensor)}
    scalars = {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items() if not isinstance(v, torch.Tensor)}
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optim_state(tensors: dict, meta: dict) -> dict:
    state: dict = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        i, k = key.split(".", 1)
        state.setdefault(int(i), {})[k] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(run_dir, step: int, model, optimizer, meta: dict, keep: int = 2) -> Path:
    from safetensors.torch import save_file

    root = Path(run_dir) / "ckpt"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".step_{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
    otensors, ometa = _optim_tensors(optimizer)
    save_file(otensors, str(tmp / "optim.safetensors"))
    full = {**meta, "step": step, "optim": ometa,
            "sha256": {n: _sha256(tmp / n) for n in ("model.safetensors", "optim.safetensors")}}
    (tmp / "meta.json").write_text(json.dumps(full, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir) -> Path | None:
    root = Path(run_dir) / "ckpt"
    latest = root / "latest"
    if not latest.exists():
        return None
    path = root / latest.read_text().strip()
    return path if path.exists() else None


def load_checkpoint(path) -> tuple[dict, dict, dict]:
    """(model state dict, optimizer state dict, meta) from a checkpoint folder or a run folder."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / "ckpt").exists():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{path} has no complete checkpoint (ckpt/latest is missing)")
        path = found
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"{path} is not a checkpoint: meta.json is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: meta.json is corrupted ({e})") from None
    for name, want in meta["sha256"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        if _sha256(f) != want:
            raise CheckpointError(f"checkpoint {path}: {name} is truncated or corrupted (sha256 mismatch)")
    model_sd = load_file(str(path / "model.safetensors"))
    optim_sd = _optim_state(load_file(str(path / "optim.safetensors")), meta["optim"])
    return model_sd, optim_sd, meta
