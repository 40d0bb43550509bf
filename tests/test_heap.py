"""The C heap's settings (``subquad.heap``): freed memory kept for the next tensor once subquad is imported, and
handed back by ``release_freed``. Each in a fresh process, so the heap's state is known."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)


def _run(code, **env):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT, **env})
    return out.stdout.split()


def test_a_step_s_tensors_reuse_the_pages_the_last_step_freed():
    """One 48 MB tensor written and freed, sixteen times, then forty of 1.5 MB eight times: in the last three
    rounds the kept heap faults none of their pages in again (the first few may: a 64-byte aligned request does
    not fit the block the last one freed until freed neighbours join it, and a small allocation carved from the
    head of a freed block leaves it too short - up to 8 rounds of the big one, depending on what the imports left
    in the heap's bins; it settles after). An mmap threshold of 32 MB, glibc's largest,
    faulted the 48 MB one in every time. The control: glibc's starting mmap threshold (128 KB) set by the user -
    kept, not overridden - maps and unmaps every block, so every round faults all their pages (glibc's own
    dynamic threshold does that or not depending on what else sits in the heap)."""
    code = r"""
import resource, torch, subquad
from subquad.heap import _glibc
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
small, big = [], []
for r in range(16):                                          # first: not carved from the small ones' free space
    before = faults()
    block = torch.ones(12 << 20)                             # 48 MB: over glibc's largest mmap threshold
    del block
    big.append(faults() - before)
for r in range(8):
    before = faults()
    blocks = [torch.ones(3 << 17) for _ in range(40)]        # 1.5 MB each, every page written
    del blocks
    small.append(faults() - before)
print(_glibc() is not None, max(small[5:]), max(big[13:]))
"""
    glibc, *kept = _run(code, THP_MEM_ALLOC_ENABLE="0")          # (huge pages would fault 2 MB at a time)
    _, *mapped = _run(code, MALLOC_MMAP_THRESHOLD_="131072", THP_MEM_ALLOC_ENABLE="0")
    if glibc == "True":
        assert max(map(int, kept)) < 200, kept            # 40 x 384 = 15,360 pages a round; 12,288 the big one's
        assert min(map(int, mapped)) > 10000, mapped
    else:
        assert kept == mapped


def test_keep_freed_reports_what_it_did():
    code = "import subquad; from subquad.heap import _glibc, keep_freed; print(_glibc() is not None, keep_freed())"
    glibc, made = _run(code)
    assert made == glibc
    assert _run(code, SUBQUAD_KEEP_FREED="0")[1] == "False"
    assert _run(code, GLIBC_TUNABLES="glibc.malloc.trim_threshold=65536")[1] == "False"     # the user's kept


def test_release_freed_returns_the_heaps_free_pages():
    """After many frees of a few MB each (kept in the heap: above), resident memory falls by most of what was
    freed once ``release_freed`` runs. On a C library without ``malloc_trim`` it must do nothing."""
    code = r"""
import re, torch, subquad
from subquad.heap import _glibc, release_freed
rss = lambda: int(re.search(r'VmRSS:\s+(\d+)', open('/proc/self/status').read())[1]) // 1024
keep, blocks = [], [torch.ones(3 << 20, dtype=torch.uint8) for _ in range(40)]
for i, b in enumerate(blocks):
    if i % 8 == 7:
        keep.append(b.clone()[:1])                              # small live blocks between the freed ones
del blocks, b
before = rss(); release_freed(); after = rss()
print(_glibc() is not None, before, after)
"""
    glibc, before, after = _run(code)
    if glibc == "True":
        assert int(before) - int(after) >= 60, (before, after)      # 120 MB freed, most of it held before
    else:
        assert int(after) <= int(before)
