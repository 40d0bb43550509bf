"""Fresh output tensors whose pages fault in 2 MiB at a time where the kernel allows.

A tensor of tens of MiB comes straight from mmap (glibc's threshold is at most 32 MiB), and its first
write page-faults once per 4 KiB page: 8.8 ms for the 32 MiB output of a 16K-token retention forward
here, a fifth of the whole call. ``madvise(MADV_HUGEPAGE)`` on the tensor's 2 MiB-aligned interior turns
those into one fault per 2 MiB (2.3 ms; see benchmarks/RESULTS.md). Only that tensor's pages are
advised, nothing process-wide changes, and the tensor is an ordinary one. Where it cannot apply (not
Linux, transparent huge pages off, a GPU tensor, a tensor under ``MIN_BYTES``) this is ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

HUGE = 2 << 20          # the huge page size advised for
MIN_BYTES = 8 << 20     # below this, glibc usually serves the tensor from memory already faulted in
MADV_HUGEPAGE = 14


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB blocks of ``t``'s storage (before it is written).
    True if the kernel took the advice; False where it was not asked or refused (harmless either way)."""
    nbytes = t.untyped_storage().nbytes()
    if _madvise is None or t.device.type != "cpu" or nbytes < MIN_BYTES:
        return False
    start = t.untyped_storage().data_ptr()
    lo, hi = -(-start // HUGE) * HUGE, (start + nbytes) // HUGE * HUGE
    return hi > lo and _madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def empty(*shape, dtype=None, device=None) -> torch.Tensor:
    """``torch.empty(*shape)``, advised to huge pages when large and on the CPU (see the module text)."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    advise_huge(t)
    return t
