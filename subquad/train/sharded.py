"""Sharded checkpoints: every rank writes its own shards with ``torch.distributed.checkpoint`` (DCP).

    ckpt/step_0000500/.metadata            DCP's index of every shard (rank 0)
    ckpt/step_0000500/__R_0.distcp         rank R's shards of the weights and AdamW's moments
    ckpt/step_0000500/meta.json            as a full checkpoint's, with "format": "dcp" and every file's sha256

Nothing is gathered to one rank. The folder is made as a full checkpoint's is (``train.checkpoint``):
written under ``.step_N.tmp``, each rank hashing the files it wrote, rank 0 sealing ``meta.json`` with all
the hashes and renaming it into place, then ``ckpt/latest``; a kill leaves the previous checkpoint the
newest intact one, and a damaged shard fails its checksum.

DCP stores each tensor by name with its global shape, so a checkpoint loads on any number of processes
(``load_sharded``: 4 -> 2 -> 1, or FSDP or not), and a full (single-process) checkpoint loads into a
sharded model (``load_full_into``). ``train.checkpoint.load_checkpoint`` reads one whole, in one process
(``read_sharded``), for export, eval and a resume without FSDP.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from subquad.train.checkpoint import _publish, _seal, _sha256, _write_failed

FORMAT = "dcp"


def _state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_sharded(run_dir, step: int, model, optimizer, meta: dict, keep: int = 2) -> Path:
    """A collective of every rank: write ``ckpt/step_N`` as DCP shards (see the module doc); returns the
    folder. CheckpointWriteError (on every rank) when a rank's disk refuses a write."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    rank = dist.get_rank()
    root = Path(run_dir) / "ckpt"
    final, tmp = root / f"step_{step:07d}", root / f".step_{step:07d}.tmp"
    failed = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            failed = e
    state = _state(model, optimizer)                   # a collective under FSDP: every rank, before any exit
    failed = _agree(failed)
    if failed is None:
        try:
            dcp.save(state, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True))
            mine = {p.name: _sha256(p) for p in tmp.glob(f"__{rank}_*.distcp")}
            if rank == 0:
                mine[".metadata"] = _sha256(tmp / ".metadata")
        except Exception as e:                        # DCP gathers a rank's failure into every rank's error
            failed, mine = e, {}
        failed = _agree(failed)
    hashes = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, mine if failed is None else {})
    if rank == 0 and failed is None:
        try:
            _seal(tmp, final, {**meta, "step": step, "format": FORMAT},
                  {k: v for h in hashes for k, v in sorted(h.items())})
        except OSError as e:
            failed = e
    failed = _agree(failed)
    if failed is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        err = failed if isinstance(failed, OSError) else OSError(str(failed))
        raise _write_failed(run_dir, err, f"checkpoint of step {step}") from None
    out = _publish(run_dir, final, step, keep) if rank == 0 else final
    dist.barrier()
    return out


def _agree(failed):
    """Every rank learns whether any rank failed (the first failure, as an exception), so all take one path."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, None if failed is None else (type(failed).__name__, getattr(failed, "errno", None),
                                                               getattr(failed, "strerror", None) or str(failed)))
    first = next((s for s in seen if s is not None), None)
    if first is None:
        return None
    if failed is not None:
        return failed
    name, errno, text = first
    return OSError(errno, text) if errno is not None else OSError(text)


def load_sharded(path, model, optimizer) -> None:
    """Load the DCP checkpoint folder ``path`` into ``model`` and ``optimizer`` as they are now sharded (any
    number of processes; FSDP or a plain model). A collective when distributed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_full_into(model, optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load a full checkpoint's state dicts (``load_checkpoint``'s: the optimizer's keyed by parameter index)
    into a sharded ``model`` and ``optimizer``: every rank keeps its own shard of each tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_by_name(optim_sd, order),
                   options=StateDictOptions(full_state_dict=True))


def optim_by_name(osd: dict, order: list[str]) -> dict:
    """An optimizer state dict keyed by parameter index -> keyed by parameter name (``order``: the names in
    the optimizer's order), the form ``set_state_dict`` takes."""
    return {"state": {order[int(i)]: st for i, st in osd["state"].items()},
            "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in osd["param_groups"]]}
