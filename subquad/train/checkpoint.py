"""Checkpoints that a kill cannot break.

Each checkpoint is a folder ``ckpt/step_0000500/`` holding ``model.safetensors``,
``optim.safetensors`` and ``meta.json`` (step, configs, the data sampler's RNG
state, the sha256 of both tensor files, and a sha256 of the meta itself). It is
written under a temporary name and renamed into place, then the one-line file
``ckpt/latest`` is replaced atomically; a truncated or altered file - the meta
included - fails its checksum with a clear error.

Finding the checkpoint to resume from never trusts ``latest`` alone: when it is
missing, dangling or names a checkpoint that fails its checksums, the newest
intact ``step_*`` folder (by step number) is used and the reason is reported.
Pruning keeps the ``keep`` newest by step number and never the one just written.
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


def write_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a kill leaves the old file or the new."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _meta_digest(meta: dict) -> str:
    """sha256 of the meta without its own digest, in a canonical JSON form."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


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
    full["meta_sha256"] = _meta_digest(full)
    (tmp / "meta.json").write_text(json.dumps(full, indent=1, allow_nan=False))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    write_atomic(root / "latest", final.name + "\n")
    steps = sorted((p for p in root.glob("step_*") if p.is_dir() and _step_of(p) >= 0), key=_step_of)
    for old in steps[:-keep]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def verify_checkpoint(path) -> dict:
    """The meta of the checkpoint folder ``path`` after checking every checksum; CheckpointError otherwise."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"{path} is not a checkpoint: meta.json is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: meta.json is corrupted ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), dict) or "meta_sha256" not in meta:
        raise CheckpointError(f"checkpoint {path}: meta.json has no checksums (edited, or written by an older "
                              "subquad); it cannot be trusted")
    if _meta_digest(meta) != meta["meta_sha256"]:
        raise CheckpointError(f"checkpoint {path}: meta.json was altered (its sha256 does not match)")
    for name, want in meta["sha256"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        if _sha256(f) != want:
            raise CheckpointError(f"checkpoint {path}: {name} is truncated or corrupted (sha256 mismatch)")
    return meta


def find_checkpoint(run_dir, log=None) -> Path | None:
    """The newest intact checkpoint of a run: ``ckpt/latest`` when it names one, else the newest intact
    ``step_*`` by step number (``log`` is told why). None when the run has no checkpoint folder at all;
    CheckpointError when it has some and none is intact."""
    root = Path(run_dir) / "ckpt"
    steps = sorted((p for p in root.glob("step_*") if p.is_dir() and _step_of(p) >= 0), key=_step_of,
                   reverse=True) if root.exists() else []
    named, why = None, None
    latest = root / "latest"
    if latest.exists():
        named = root / latest.read_text().strip()
        try:
            verify_checkpoint(named)
            return named
        except CheckpointError as e:
            why = str(e) if named.exists() else f"ckpt/latest names {named.name}, which does not exist"
    elif steps:
        why = "ckpt/latest is missing"
    problems = []
    for p in steps:
        if named is not None and p == named:
            continue
        try:
            verify_checkpoint(p)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if log is not None:
            log(f"{why}; resuming from {p.name}, the newest intact checkpoint")
        return p
    if why is None:
        return None
    raise CheckpointError(f"{Path(run_dir)} has no intact checkpoint: {'; '.join([why] + problems)}")


def latest_checkpoint(run_dir) -> Path | None:
    """The newest intact checkpoint of a run (see ``find_checkpoint``), or None when there is none."""
    try:
        return find_checkpoint(run_dir)
    except CheckpointError:
        return None


def has_checkpoints(run_dir) -> bool:
    """Whether a run folder holds any checkpoint, intact or not."""
    root = Path(run_dir) / "ckpt"
    return root.exists() and ((root / "latest").exists() or any(p.is_dir() for p in root.glob("step_*")))


def load_checkpoint(path, log=None) -> tuple[dict, dict, dict]:
    """(model state dict, optimizer state dict, meta) from a checkpoint folder, or from a run folder's
    newest intact checkpoint (``find_checkpoint``)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "ckpt").exists():
        found = find_checkpoint(path, log)              # verified on the way
        if found is None:
            raise CheckpointError(f"{path} has no checkpoint yet")
        path, meta = found, json.loads((found / "meta.json").read_text())
    else:
        meta = verify_checkpoint(path)
    model_sd = load_file(str(path / "model.safetensors"))
    optim_sd = _optim_state(load_file(str(path / "optim.safetensors")), meta["optim"])
    return model_sd, optim_sd, meta
