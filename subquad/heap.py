"""The C heap under PyTorch's CPU tensors: freed memory kept for the next tensor, and handed back on demand.

PyTorch's CPU allocator takes every tensor from the C library's ``malloc`` and frees it at once. glibc returns a
freed block of 128 KB or more to the system (``munmap``, or trimming the heap's top), so the next tensor of that
size is faulted in again, a page at a time, each page zeroed by the kernel. A decoding step allocates and frees
its states, products and logits every step: at 16 rows that was 600-3,300 page faults a step and a fifth of a
hybrid's step time (benchmarks/RESULTS.md, "Freed memory kept for the next step").

``keep_freed()`` - called when subquad is imported - sets glibc's mmap threshold to its largest value (32 MB:
blocks up to it come from the heap) and its trim threshold to 1 GiB (up to that much free memory at the heap's
top is kept), so a step's tensors reuse the pages the last step freed, as PyTorch's CUDA caching allocator does.
Resident memory then stays near its high-water mark instead of falling between steps; blocks over 32 MB (long
prompts' activations) are still mapped and unmapped each time. ``release_freed()`` hands the heap's free pages
back (the loaders call it after each module). ``SUBQUAD_KEEP_FREED=0`` keeps glibc's defaults, and a threshold the
user set for glibc (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) is kept. Another C
library: both do nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3              # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20                                 # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
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
    """Whether the user set either threshold for glibc (its environment variables or tunables): theirs is kept."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) \
        or "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables


def keep_freed() -> bool:
    """The module doc's setting; True where it was made (glibc, not turned off)."""
    libc = _glibc()
    if libc is None or os.environ.get("SUBQUAD_KEEP_FREED", "1") == "0" or _user_set():
        return False
    mapped = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)              # mallopt: 1 where it took the value
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
