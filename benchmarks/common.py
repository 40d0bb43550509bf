"""Shared helpers for benchmark scripts: timing, the machine's matmul rate, loading peers."""

from __future__ import annotations

import gc
import importlib.util
import statistics
import time
from pathlib import Path

import torch

OUT = Path(__file__).parent / "results"


def timeit(fn, repeats: int = 5, warmup: int = 1, budget_s: float = 20.0) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (fewer if one run is slow)."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    gc.collect()
    return statistics.median(times)


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / timeit(lambda: a @ b, repeats) / 1e9


def load_file(path: Path, name: str):
    """Import one file by path (flash-linear-attention's naive references need only torch and einops)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fla_file(rel: str):
    """A file of the installed flash-linear-attention package, without importing fla (which needs triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        return None
    try:
        return load_file(path, "fla_" + rel.replace("/", "_").removesuffix(".py"))
    except Exception as e:  # a peer that does not load is skipped, and said so
        print(f"  (could not load fla {rel}: {e})")
        return None


def fmt_ms(s) -> str:
    return "—" if s is None else (f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs")
