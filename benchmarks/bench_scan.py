"""Mamba's selective scan at prefill in one C call (``ops.mamba.fused_scan``) against the chunked form it replaces
there, in one process with rounds alternating (a noisy host moves both alike): the scan alone at mamba-130m's
width (D 1536, N 16) for a few batch shapes, then a whole random mamba-130m-shaped model's prefill (tokens/s).

    python benchmarks/bench_scan.py                 # ~2 minutes; writes results/scan.{md,png}
    python benchmarks/bench_scan.py --rounds 3 --shapes 16x128

ms per call (median of ``--rounds``); the chunked form runs by making ``fused_scan.usable`` refuse.
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


def _timed(fn, repeats=3):
    fn()
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return min(best)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x128,16x128,1x2048", help="prompts x tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from subquad.models import LanguageModel, ModelConfig
    from subquad.ops import selective_scan
    from subquad.ops.mamba import fused_scan

    own = fused_scan.usable
    forms = {"C kernel": own, "chunked": lambda *args, **kw: False}
    D, N = 1536, 16
    lines = [f"mamba-130m's width (D {D}, N {N}), float32, {a.threads} threads, {a.rounds} rounds alternating; "
             f"{machine_line(matmul_gflops())}", "",
             "| what | prompts x tokens | C kernel ms | chunked ms | chunked / C kernel |", "|---|---|---:|---:|---:|"]
    model = LanguageModel(ModelConfig(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False,
                                      norm_eps=1e-5)).eval()
    plot = []
    for shape in a.shapes.split(","):
        Bz, T = (int(v) for v in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        x, z = torch.randn(Bz, T, 2 * D, generator=g).chunk(2, -1)
        dt = torch.rand(Bz, T, D, generator=g) * 0.1
        A = -torch.rand(D, N, generator=g) * 5 - 0.5
        B, C = torch.randn(Bz, T, 2 * N, generator=g).chunk(2, -1)
        Dp = torch.randn(D, generator=g)
        ids = torch.randint(0, 50280, (Bz, T), generator=g)
        cases = {"scan": lambda: selective_scan(x, dt, A, B, C, D=Dp, z=z, output_final_state=True),
                 "model prefill": lambda: model.prefill(ids, logits="last")}
        for what, fn in cases.items():
            times = {k: [] for k in forms}
            for r in range(a.rounds):
                for name, usable in forms.items():
                    fused_scan.usable = usable
                    try:
                        with torch.no_grad():
                            times[name].append(_timed(fn, 1 if what == "model prefill" else 3))
                    finally:
                        fused_scan.usable = own
                    print(f"{what} {shape} round {r + 1}/{a.rounds} {name}: {times[name][-1] * 1e3:.1f} ms",
                          flush=True)
            k, c = (statistics.median(times[n]) * 1e3 for n in forms)
            extra = f" ({Bz * T / k * 1e3:.0f} vs {Bz * T / c * 1e3:.0f} tok/s)" if what == "model prefill" else ""
            lines.append(f"| {what}{extra} | {shape} | {k:.1f} | {c:.1f} | {c / k:.2f} |")
            plot.append((f"{what}\n{shape}", c / k))
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "scan.md").write_text(text + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([p[0] for p in plot], [p[1] for p in plot])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("chunked / C kernel (time)")
    ax.set_title("The selective scan at prefill: C kernel speed-up")
    fig.tight_layout()
    fig.savefig(OUT / "scan.png", dpi=100)


if __name__ == "__main__":
    main()
