"""exp's slow path on this CPU: the time of exp over 24,576 values (a Mamba layer's dt A at d_inner 1,536,
N 16) at arguments where the result is normal, subnormal or zero, and of ``exp_decay`` (subquad.ops.
common.expo: the argument raised to log(smallest normal) + 0.5 first) on the same values.

    python benchmarks/bench_exp.py        # seconds
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_line  # noqa: E402
from subquad.ops.common.expo import exp_decay  # noqa: E402


def us(fn, n=200):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main():
    torch.set_num_threads(2)
    print(machine_line())
    print("| dtype | argument | exp(x) us | exp_decay(x) us |\n|---|---:|---:|---:|")
    for dtype, args in ((torch.float32, (-1, -80, -87, -88, -95, -104, -200)),
                        (torch.float64, (-700, -708, -709, -745, -750))):
        for a in args:
            x = torch.full((1536, 16), float(a), dtype=dtype)
            print(f"| {str(dtype).removeprefix('torch.')} | {a} | {us(lambda: torch.exp(x)):.1f} | "
                  f"{us(lambda: exp_decay(x)):.1f} |")


if __name__ == "__main__":
    main()
