"""Denormal floats flushed to zero while a model computes (``kernels/fpenv.c``).

An Intel core takes a microcode assist on every float operation whose operand or result is denormal (below
1.2e-38 in magnitude): a chunkwise recurrence with strong decays - random or trained gates, exp(-64 g) within a
chunk - fills its decay factors and states with them, and Qwen3.5's 2,048-token prefill ran at a third of its
speed on a Sapphire Rapids host (140 against 440 tokens/s; AMD cores pay far less: benchmarks/RESULTS.md).
``flush_denormals()`` sets FTZ and DAZ on the calling thread and on torch's OpenMP threads for the duration of a
``with`` block and restores them after, so the process keeps IEEE denormals outside subquad's calls (never
-ffast-math's process-wide flush, kernels/__init__.py). Values below 1.2e-38 then count as zero inside: far under
any tolerance the references are held to. A no-op while compiling (the eager call around a compiled graph sets
it), where the kernels are off or cannot be built, off x86, nested, or with ``SUBQUAD_FLUSH_DENORMALS=0``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import torch

from subquad.kernels import INT, Kernel

KERNEL = Kernel("ftz_set", [INT, INT, ctypes.POINTER(ctypes.c_int)], "fpenv")


def enabled() -> bool:
    return os.environ.get("SUBQUAD_FLUSH_DENORMALS", "1") != "0"


@contextlib.contextmanager
def flush_denormals():
    """The module doc's scope."""
    if torch.compiler.is_compiling() or not enabled() or not KERNEL.available():
        yield
        return
    was, threads = ctypes.c_int(), torch.get_num_threads()
    KERNEL(1, threads, ctypes.byref(was))
    try:
        yield
    finally:
        if not was.value:                               # it was off: off again, on every thread
            KERNEL(0, threads, ctypes.byref(ctypes.c_int()))
