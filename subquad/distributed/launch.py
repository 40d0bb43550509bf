"""Launching data-parallel runs: ``subquad train --nproc N`` re-runs itself under torchrun."""

from __future__ import annotations

import os
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


def launch(nproc: int, argv: list[str]) -> int:
    """``torchrun --standalone --nproc-per-node N -m subquad <argv>``; returns its exit code."""
    from torch.distributed.run import main as torchrun

    try:
        torchrun(["--standalone", "--nproc-per-node", str(nproc), "-m", "subquad", *argv])
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # torchrun raises ChildFailedError when a rank fails
        print(f"error: a rank of the distributed run failed: {e}")
        return 1
    return 0
