"""Launching processes: ``subquad train --nproc N`` re-runs itself under torchrun; ``run_local`` runs a
function on W local processes (gloo, file rendezvous) and returns what each returned (tests, checks)."""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist


def init_from_env(timeout_s: float = 60.0):
    """Join the process group torchrun describes (WORLD_SIZE > 1); returns (rank, world)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def launch(nproc: int, argv: list[str], nnodes: int = 1, rdzv_endpoint: str | None = None) -> int:
    """``torchrun --standalone --nproc-per-node N -m subquad <argv>``; on several machines (``nnodes`` > 1),
    torchrun's c10d rendezvous at ``rdzv_endpoint`` (HOST:PORT) in place of --standalone. Returns its exit
    code."""
    from torch.distributed.run import main as torchrun

    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT, where the machines meet")
    where = (["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
             if nnodes > 1 or rdzv_endpoint else ["--standalone"])
    try:
        torchrun([*where, "--nproc-per-node", str(nproc), "-m", "subquad", *argv])
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # torchrun raises ChildFailedError when a rank fails
        print(f"error: a rank of the distributed run failed: {e}")
        return 1
    return 0


def _local_worker(rank, world, init_file, out_dir, fn, args, timeout_s):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Done: leave without interpreter finalization, where gloo's worker threads can still be torn down and
    # abort the process ("terminate called without an active exception", SIGABRT) - a known shutdown race
    # in torch.distributed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(world: int, fn, *args, timeout_s: float = 60.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` local processes (spawned: ``fn`` and ``args`` must pickle, a
    function by its module); returns their results in rank order."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "rendezvous")
        mp.spawn(_local_worker, args=(world, init_file, d, fn, args, timeout_s), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
