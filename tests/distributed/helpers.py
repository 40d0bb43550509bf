"""Run a function on W local processes (gloo, file rendezvous) and collect what each returns.

``run`` is ``subquad.distributed.launch.run_local`` - its worker, rendezvous and results - on processes
forked from the tests' forkserver (tests/forked.py) instead of spawned interpreters; test_ring runs one case
through ``run_local`` itself."""

import os
import tempfile

import torch
import torch.multiprocessing as mp

from subquad.distributed.launch import _local_worker, run_local
from tests.forked import context

__all__ = ["run", "run_local"]


def run(world: int, fn, *args, timeout_s: float = 60.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` forked processes; their results in rank order."""
    context()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "rendezvous")
        mp.start_processes(_local_worker, args=(world, init_file, d, fn, args, timeout_s), nprocs=world, join=True,
                           start_method="forkserver")
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
