"""Checkpoints that a kill cannot break.

Each checkpoint is a folder ``ckpt/step_0000500/`` holding ``model.safetensors``,
``optim.safetensors`` and ``meta.json`` (step, configs, the data sampler's RNG
state, the sha256 of both tensor files, and a sha256 of the meta itself). It is
written under a temporary name and renamed into place, then the one-line file
``ckpt/latest`` is replaced atomically; a truncated or altered file - the meta
included - fails its checksum with a clear error.

The checkpoint to resume from is the newest intact ``step_*`` folder by step
number; ``latest`` is a hint. When it is missing, unreadable, names something
that is not a step folder of this run (``../../other/ckpt/step_20``), names an
older step than the newest intact one (a kill between the rename and ``latest``)
or names one that fails its checksums, the reason is reported with the step used.
A ``step_*`` that is a symlink is reported and never followed, nor pruned.
Pruning keeps the ``keep`` newest by step number and never the one just written;
step folders newer than the one just written belong to an abandoned timeline
(corrupt ones a resume passed over) and are removed.

A write that fails (a full disk, a read-only one) removes the partial folder and
raises ``CheckpointWriteError``: one line naming the cause and the last intact
checkpoint.

A sharded run (FSDP) writes the same folders with each rank's shards in place of
the two tensor files (``train.sharded``, meta "format": "dcp"); ``load_checkpoint``
reads either kind whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

from subquad.data.dataset import file_sha256 as _sha256   # one file hash for the package (kill tests hook _sha256)
from subquad.tensorfile import read_safetensors


class CheckpointError(ValueError):
    pass


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (its partial folder is removed); the message names the last
    intact checkpoint."""

    def __str__(self):
        return self.args[0]


_STEP_NAME = re.compile(r"step_\d+")


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


def _step_folders(root: Path) -> tuple[list[Path], list[Path]]:
    """(the real ``step_*`` folders under ``ckpt/`` by step number, the ``step_*`` symlinks). A symlink is
    never followed: it can point into another run (whose step it would resume as this run's) and pruning it
    would delete that run's checkpoint; the caller reports it instead."""
    found = [p for p in root.glob("step_*") if _step_of(p) >= 0]
    links = sorted((p for p in found if p.is_symlink()), key=_step_of)
    return sorted((p for p in found if p.is_dir() and not p.is_symlink()), key=_step_of), links


def _symlink_refused(path: Path) -> str:
    return f"{path} is a symlink (to {os.readlink(path)}); a checkpoint is read from a real folder, never followed"


def _save_tensors(tensors: dict, path: Path) -> None:
    """safetensors' writer, its I/O failures as the OSError they are (it reports them as a SafetensorError
    whose text ends '(os error N)')."""
    from safetensors import SafetensorError

    from subquad.tensorfile import save_file

    try:
        save_file(tensors, str(path))
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        n = int(code.group(1))
        raise OSError(n, os.strerror(n), str(path)) from None


def _write_failed(run_dir, e: OSError, partial: str) -> CheckpointWriteError:
    reason = e.strerror or str(e)
    last = latest_checkpoint(run_dir)
    where = (f"the last intact checkpoint is step {_step_of(last)} ({last})" if last is not None
             else "there is no checkpoint yet")
    return CheckpointWriteError(f"{reason[:1].lower() + reason[1:]}: {where}; the partial {partial} was removed")


def save_checkpoint(run_dir, step: int, model, optimizer, meta: dict, keep: int = 2) -> Path:
    """Write ``ckpt/step_N`` (through ``.step_N.tmp`` and a rename), point ``ckpt/latest`` at it, prune;
    and mark the run's ``config.json``, when there is one, as having checkpoints (a run whose checkpoints
    are later lost is then refused on resume instead of restarting silently). CheckpointWriteError when
    the disk refuses a write."""
    root = Path(run_dir) / "ckpt"
    final = root / f"step_{step:07d}"
    tmp = root / f".step_{step:07d}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _save_tensors({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                      tmp / "model.safetensors")
        otensors, ometa = _optim_tensors(optimizer)
        _save_tensors(otensors, tmp / "optim.safetensors")
        hashes = {n: _sha256(tmp / n) for n in ("model.safetensors", "optim.safetensors")}
        _seal(tmp, final, {**meta, "step": step, "optim": ometa}, hashes)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(run_dir, e, f"checkpoint of step {step}") from None
    return _publish(run_dir, final, step, keep)


def _seal(tmp: Path, final: Path, meta: dict, hashes: dict) -> None:
    """Write ``meta.json`` (with the files' sha256 and its own) into the finished ``tmp`` folder and rename it
    to ``final``."""
    full = {**meta, "sha256": hashes}
    full["meta_sha256"] = _meta_digest(full)
    with open(tmp / "meta.json", "w") as f:
        f.write(json.dumps(full, indent=1, allow_nan=False))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)


def _publish(run_dir, final: Path, step: int, keep: int) -> Path:
    """After the rename: point ``ckpt/latest`` at ``final``, mark the run as checkpointed, prune."""
    root = final.parent
    try:
        write_atomic(root / "latest", final.name + "\n")
        _mark_checkpointed(run_dir)
    except OSError as e:                      # the step is in place and found by scanning; latest is a hint
        (root / "latest.tmp").unlink(missing_ok=True)
        raise _write_failed(run_dir, e, "ckpt/latest.tmp") from None
    steps = _step_folders(root)[0]            # symlinks left alone: their targets are not this run's
    for p in steps:
        if _step_of(p) > step:               # an abandoned timeline: resume would otherwise pick it
            shutil.rmtree(p, ignore_errors=True)
    steps = [p for p in steps if _step_of(p) <= step]
    for old in steps[:-keep]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _mark_checkpointed(run_dir) -> None:
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return
    try:
        cfg = json.loads(path.read_text())
    except ValueError:
        return                                # not ours to repair here; resume reports it
    if isinstance(cfg, dict) and cfg.get("checkpointed") is not True:
        write_atomic(path, json.dumps({**cfg, "checkpointed": True}, indent=1))


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


def _read_latest(root: Path) -> tuple[str | None, str | None]:
    """(the step folder ``ckpt/latest`` names, or None; why it names none, or None when there is no file)."""
    latest = root / "latest"
    if not latest.exists():
        return None, "ckpt/latest is missing"
    try:
        text = latest.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"ckpt/latest is unreadable ({e.__class__.__name__}: not a step name)"
    if not _STEP_NAME.fullmatch(text):       # never followed out of the run ('../../other/ckpt/step_20')
        return None, f"ckpt/latest names {text[:80]!r}, which is not a step folder of this run; ignored"
    return text, None


def find_checkpoint(run_dir, log=None) -> Path | None:
    """The newest intact checkpoint of a run by step number; ``ckpt/latest`` is only a hint. When the one
    used is not the one ``latest`` names, or newer ones fail their checksums, ``log`` is told which step
    is used and why. None when the run has no checkpoint at all; CheckpointError when it has some and
    none is intact."""
    root = Path(run_dir) / "ckpt"
    if not root.exists():
        return None
    steps, links = _step_folders(root)
    steps.reverse()
    named, why = _read_latest(root)
    if named is None and why == "ckpt/latest is missing" and not steps and not links:
        return None
    if named is not None and (root / named).is_symlink():
        why = f"ckpt/latest names {named}, a symlink; not followed"
    elif named is not None and not (root / named).is_dir():
        why = f"ckpt/latest names {named}, which does not exist"
    problems = [_symlink_refused(p) for p in links]
    for p in steps:
        try:
            verify_checkpoint(p)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if named is not None and why is None and named != p.name and _step_of(root / named) < _step_of(p):
            why = (f"ckpt/latest names {named}, but {p.name} is newer and intact (a kill before ckpt/latest "
                   "was updated)")
        if log is not None and (why is not None or problems):
            log(f"{'; '.join(([why] if why else []) + problems)}; using {p.name}, the newest intact checkpoint")
        return p
    raise CheckpointError(f"{Path(run_dir)} has no intact checkpoint: "
                          f"{'; '.join(([why] if why else []) + problems) or 'ckpt/ holds no step folder'}")


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


def wrote_checkpoints(run_dir: Path, saved: dict | None = None) -> bool:
    """Whether a run wrote a checkpoint once: its config.json's mark (``saved``, else read from the folder), or
    for a run from before the mark, any metrics."""
    if saved is None:
        try:
            saved = json.loads((Path(run_dir) / "config.json").read_text())
        except (OSError, ValueError):
            return False
    if not isinstance(saved, dict):
        return False
    if "checkpointed" in saved:
        return saved["checkpointed"] is True
    metrics = Path(run_dir) / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0


def load_checkpoint(path, log=None) -> tuple[dict, dict, dict]:
    """(model state dict, optimizer state dict, meta) from a checkpoint folder, or from a run folder's
    newest intact checkpoint (``find_checkpoint``); a sharded one (``train.sharded``) is read whole. The
    meta's "path" is the folder used. The files are read without a memory map (``tensorfile``): resuming
    does not peak at twice the checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "ckpt").exists():
        found = find_checkpoint(path, log)              # verified on the way
        if found is None:
            raise CheckpointError(f"{path} has no checkpoint" + (
                ": it wrote some, but ckpt/ is empty now" if wrote_checkpoints(path) else " yet"))
        path, meta = found, json.loads((found / "meta.json").read_text())
    elif path.is_symlink():                            # as find_checkpoint: a step folder is never followed
        raise CheckpointError(_symlink_refused(path))
    else:
        meta = verify_checkpoint(path)
    if meta.get("format") == "dcp":                     # shards of a sharded run (train.sharded), read whole
        model_sd, optim_sd = read_sharded(path)
        return model_sd, optim_sd, {**meta, "path": str(path)}
    model_sd = read_safetensors(path / "model.safetensors")
    optim_sd = _optim_state(read_safetensors(path / "optim.safetensors"), meta["optim"])
    return model_sd, optim_sd, {**meta, "path": str(path)}


def optim_by_index(osd: dict) -> dict:
    """An optimizer state dict keyed by parameter name (DCP's form) -> keyed by index, the parameters numbered in
    the order the groups list them (the inverse of ``train.sharded.optim_by_name``)."""
    index = {n: i for i, n in enumerate(n for g in osd["param_groups"] for n in g["params"])}
    return {"state": {index[n]: st for n, st in osd["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]}


def read_sharded(path) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict keyed by index) of a DCP checkpoint folder, read whole in this
    process (no process group needed): what export and ``load_run`` use."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    try:                                   # no_dist: this process alone, inside a process group or not
        _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: its shards cannot be read ({type(e).__name__}: {e})") from None
    model_sd = {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    return model_sd, optim_by_index(state["optim"])
