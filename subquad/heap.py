"""The C heap under PyTorch's CPU tensors: freed memory kept for the next tensor, and handed back on demand.

PyTorch's CPU allocator takes every tensor from the C library's ``malloc`` and frees it at once. glibc returns a
freed block of 128 KB or more to the system (``munmap``, or trimming the heap's top), so the next tensor of that
size is faulted in again, a page at a time, each page zeroed by the kernel. A decoding step allocates and frees
its states, products and logits every step: at 16 rows that was 600-3,300 page faults a step and a fifth of a
hybrid's step time (benchmarks/RESULTS.md, "Freed memory kept for the next step").

``keep_freed()`` - called when subquad is imported - stops glibc mapping blocks of their own (``M_MMAP_MAX`` 0:
every block comes from the heap, whatever its size) and sets its trim threshold to 1 GiB (up to that much free
memory at the heap's top is kept), so a step's tensors reuse the pages the last step freed, as PyTorch's CUDA
caching allocator does - and so do a long prompt's activations: a mapped block (glibc's largest mmap threshold is
32 MB) was faulted in afresh at every use, 60-67 MB ones at LFM3's and Qwen4-Exp's shapes. Resident memory then
stays near its high-water mark instead of falling between steps; more than 1 GiB freed at the heap's top goes back.
``release_freed()`` hands the heap's free pages back (the loaders call it after each module).
``SUBQUAD_KEEP_FREED=0`` keeps glibc's defaults, and so does a setting the user made for glibc
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``). Another C
library: both do nothing. (Threads other than the main one allocate from arenas of at most 64 MB, which map a
larger block whatever ``M_MMAP_MAX`` says.)
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4                    # glibc's malloc.h
TRIM_THRESHOLD = 1 << 30


@functools.cache
def _glibc():
    """The process's glibc (``mallopt`` and ``malloc_trim``), or None (another C library)."""
    try:
        libc = ctypes.CDLL(None)
        for name in ("gnu_get_libc_version", "mallopt", "malloc_trim"):      # AttributeError where one is missing
            getattr(libc, name)
        return libc
    except (OSError, AttributeError):
        return None


def _user_set() -> bool:
    """Whether the user set glibc's mmap or trim settings (its environment variables or tunables): theirs are kept."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")) \
        or any(f"malloc.{k}" in tunables for k in ("mmap_threshold", "mmap_max", "trim_threshold"))


def keep_freed() -> bool:
    """The module doc's setting; True where it was made (glibc, not turned off)."""
    libc = _glibc()
    if libc is None or os.environ.get("SUBQUAD_KEEP_FREED", "1") == "0" or _user_set():
        return False
    mapped = libc.mallopt(M_MMAP_MAX, 0)                                 # mallopt: 1 where it took the value
    trimmed = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return mapped == 1 and trimmed == 1


def release_freed() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; nothing elsewhere).
    Loading a model module by module frees each module's file tensors and packing temporaries as it goes, but
    the heap keeps freed blocks (above), so the process's resident memory kept rising by what was freed (an int4
    folder at mamba-130m's shape: peak 1.34x its size on disk, 1.17x with this after each module;
    benchmarks/RESULTS.md)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
