"""Run a function on W local processes (gloo, file rendezvous) and collect what each returns."""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, init_file, out_dir, fn, args, timeout_s):
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
    # in torch.distributed (seen once in this suite's CI, after every result was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(world: int, fn, *args, timeout_s: float = 60.0):
    """fn(rank, world, *args) on ``world`` processes; returns the list of their results in rank order."""
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "rendezvous")
        mp.spawn(_worker, args=(world, init_file, d, fn, args, timeout_s), nprocs=world, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]
