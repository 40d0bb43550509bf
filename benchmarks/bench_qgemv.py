"""The quantised products of a decoding step: the C kernels (``kernels/qgemv.c``: int8 with x kept float32,
int8q and int4 with x rounded to int8 per block of 32; int8 through AMX tiles with x rounded per row, where the CPU
has them) against the library kernels they replace - fbgemm's int8
``linear_dynamic`` (x rounded to 7-8 bits per call), torch's int4 ``_weight_int4pack_mm_for_cpu`` (x rounded to
bfloat16), the dequantised product a blocked (GGUF Q8_0) weight took - and the float32 product (the C kernel, oneDNN's which ``layers.linear`` takes, and ``F.linear``'s MKL), at
mamba-130m's matrices, 1 to 16 rows, 2 threads, rounds interleaved.

    python benchmarks/bench_qgemv.py                  # ~1 min; writes results/qgemv.{md,png}
    python benchmarks/bench_qgemv.py --from-memory    # each call another copy: weights read from memory
    python benchmarks/bench_qgemv.py --from-memory --kinds "float32 C,float32 oneDNN" --rows 1,2,3,4,8,12,16

us per call (median of the rounds) and the weights' read bound (bytes over ``--bandwidth`` GB/s); then the
float32 C kernel's rate against the matmul rate of the same run (issue 53's batch-16 target: >= 60%). Without
``--from-memory`` a matrix stays in the cache from one call to the next (the head excepted: 154 MB in float32);
a decoding step reads each of its matrices once, from memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402

MATRICES = {"in_proj 3072x768": (3072, 768), "out_proj 768x1536": (768, 1536), "head 50280x768": (50280, 768)}


def rotating(fn, copies: list):
    """``fn`` called with the next of ``copies`` each time."""
    i = [0]

    def call():
        i[0] = (i[0] + 1) % len(copies)
        return fn(*copies[i[0]])
    return call


def per_call(fn, budget_s: float) -> float:
    fn()
    n, t = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t
        if el > budget_s and n >= 3:
            return el / n * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bandwidth", type=float, default=27.4, help="GB/s for the read bound column")
    ap.add_argument("--from-memory", action="store_true",
                    help="copies of each matrix, > 256 MB of float32 in all, called in turn")
    ap.add_argument("--kinds", default="", help="comma-separated columns to time (default: every one)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import torch.nn.functional as F

    from subquad.kernels import qgemv
    from subquad.layers import linear
    from subquad.models import quant

    assert qgemv.INT8.available(), "the C kernels could not be built here"
    torch.manual_seed(0)
    results: dict[tuple, list] = {}
    cases = []
    for name, (N, K) in MATRICES.items():
        sets = []
        for _ in range(-(-(256 << 20) // (N * K * 4)) if a.from_memory else 1):
            w = torch.randn(N, K) * K ** -0.5
            l8, l4 = quant.Int8Linear(w), quant.Int4Linear(w, None, 128)
            blocks = quant.Int8Linear.from_blocks(l8.q, l8.scale[:, None].expand(N, K // 32).contiguous())  # Q8_0's
            q4 = (torch.randint(0, 256, (N, K // 2), dtype=torch.uint8), torch.rand(N, K // 32) * 0.02)  # Q4_0's
            sets.append((w, l8, l4, blocks, q4))
        layout = quant.LAYOUTS.get(sets[0][2].layout)
        for M in map(int, a.rows.split(",")):
            x = torch.randn(M, K)
            row = {
                "int8 C": lambda w, l8, l4, b, q4, x=x: qgemv.int8_gemv(x, l8.q, l8.scale, None, None),
                "int8q C": lambda w, l8, l4, b, q4, x=x: qgemv.int8q_gemv(x, l8.q, l8.scale, None),
                "int8 fbgemm": lambda w, l8, l4, b, q4, x=x: torch.ops.quantized.linear_dynamic(
                    x, quant._packed(l8.q, l8.scale, l8.key_id), quant.REDUCE_RANGE),
                "int8 blocks C": lambda w, l8, l4, b, q4, x=x: qgemv.int8_gemv(x, b.q, b.scale, None, None),
                "Q8_0 C": lambda w, l8, l4, b, q4, x=x: qgemv.int8q_gemv(x, b.q, b.scale, None),
                "Q4_0 C": lambda w, l8, l4, b, q4, x=x: qgemv.q4_0_gemv(x, *q4, None),
                "int8 blocks dequantised": lambda w, l8, l4, b, q4, x=x: F.linear(x, b.dequantized(torch.float32)),
                "float32 C": lambda w, l8, l4, b, q4, x=x: qgemv.f32_gemv(x, w, None),
                "float32 oneDNN": lambda w, l8, l4, b, q4, x=x: linear._onednn(x, w, None),
                "float32 MKL": lambda w, l8, l4, b, q4, x=x: F.linear(x, w),
            }
            if qgemv.packed_int8() and K % 64 == 0:          # tiles or VNNI's vectors (x rounded per row)
                row["int8 AMX" if qgemv.amx() else "int8 VNNI"] = lambda w, l8, l4, b, q4, x=x: qgemv.int8_amx(x, l8.q, l8.scale, None, l8.key_id)
            if layout:
                row["int4 C"] = lambda w, l8, l4, b, q4, x=x, N=N: qgemv.int4_gemv(x, l4.w, l4.scale_zero, None, N,
                                                                               *layout)
                row["int4 torch"] = lambda w, l8, l4, b, q4, x=x: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x.bfloat16(), l4.w, 128, l4.scale_zero).float()
            keep = set(a.kinds.split(",")) - {""} or set(row)
            unknown = keep - set(row) - {"int4 C", "int4 torch"}
            if unknown:
                ap.error(f"--kinds: unknown {sorted(unknown)}; known: {sorted(row)}")
            cases.append((name, N, K, M, {k: rotating(fn, sets) for k, fn in row.items() if k in keep}))
    budget = 0.15
    for r in range(a.rounds):
        for name, N, K, M, row in cases:
            for kind, fn in row.items():
                results.setdefault((name, M, kind), []).append(per_call(fn, budget * (3 if "head" in name else 1)))
        print(f"round {r + 1}/{a.rounds}", flush=True)
    kinds = list(cases[0][4])
    rate = matmul_gflops()
    machine = machine_line(rate)
    where = "each call another copy of the matrix (from memory)" if a.from_memory else "the same matrix each call"
    lines = [f"us per call, median of {a.rounds} rounds, {a.threads} threads, {where}; {machine}", "",
             "| matrix | rows | " + " | ".join(kinds) + " | float32 / int8 / int4 read bound |",
             "|---|---:|" + "---:|" * (len(kinds) + 1)]
    for name, N, K, M, row in cases:
        med = [statistics.median(results[(name, M, k)]) for k in kinds]
        bound = " / ".join(f"{N * K * b / a.bandwidth / 1e3:.0f}" for b in (4, 1, 0.5))
        lines.append(f"| {name} | {M} | " + " | ".join(f"{v:.0f}" for v in med) + f" | {bound} |")
    if "float32 C" in kinds:
        lines += ["", f"float32 C: GFLOP/s (2 M N K over the median time) and its share of this run's matmul rate "
                      f"({rate:.0f} GFLOP/s)", "", "| matrix | rows | GFLOP/s | share |", "|---|---:|---:|---:|"]
        for name, N, K, M, row in cases:
            g = 2 * M * N * K / statistics.median(results[(name, M, "float32 C")]) / 1e3     # us per call
            lines.append(f"| {name} | {M} | {g:.0f} | {g / rate:.0%} |")
    print("\n".join(lines))
    OUT.mkdir(exist_ok=True)
    stem = "qgemv_memory" if a.from_memory else "qgemv"
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MATRICES), figsize=(5 * len(MATRICES), 4))
    for ax, name in zip(axes, MATRICES):
        for k in kinds:
            ms = [M for n, _, _, M, _ in cases if n == name]
            ax.plot(ms, [statistics.median(results[(name, M, k)]) for M in ms], marker="o", label=k)
        ax.set(title=name, xlabel="rows", ylabel="us per call", xscale="log", yscale="log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}.png", dpi=90)


if __name__ == "__main__":
    main()
