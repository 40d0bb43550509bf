"""The float32 inference product: PyTorch's ``F.linear`` (MKL's GEMM on x86) against oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise`` on the same row-major weights: what ``subquad.layers.linear`` calls), and
oneDNN on weights packed in its own layout (``_reorder_linear_weight``: a second copy, not used), at mamba-130m's
matrices and a small one, for 1, 9 and 16 rows (a decoding step, a verification of 8 drafts, a batch of 16)
and a 2,048-token prefill.

    python benchmarks/bench_linear.py            # ~1 min
    python benchmarks/bench_linear.py --large    # the larger hybrids' matrices (50-220 MB), 1 and 16 rows
    python benchmarks/bench_linear.py --layouts  # the compiled step at mamba-130m's shape, wide matrices row-
                                                 # against column-major, 1 and 16 rows (~4 min: two compiles)

Median microseconds of interleaved rounds, 2 threads. The 9.4 MB in_proj fits in this CPU's L3 when called
alone (faster than in a model, where every layer's weights stream from memory); the 154 MB head does not.
Writes results/linear.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402

SHAPES = {"small (256 x 128)": (256, 128), "x_proj-like (512 x 512)": (512, 512),
          "in_proj (3072 x 768)": (3072, 768), "out_proj (768 x 1536)": (768, 1536),
          "head (50280 x 768)": (50280, 768)}
LARGE = {"Zamba in_proj (14848 x 3712)": (14848, 3712), "Zamba out_proj (3712 x 7424)": (3712, 7424),
         "MLP up (11008 x 4096)": (11008, 4096), "MLP down (4096 x 11008)": (4096, 11008),
         "attention (4096 x 4096)": (4096, 4096), "in_proj (8192 x 2048)": (8192, 2048),
         "qkv (6144 x 2048)": (6144, 2048)}


def timed(fns: dict, budget_s: float) -> dict:
    """Median seconds per call of each function, interleaved rounds within about ``budget_s`` seconds."""
    for f in fns.values():
        f()
    t = time.perf_counter()
    next(iter(fns.values()))()
    n = max(1, int(budget_s / 5 / len(fns) / max(time.perf_counter() - t, 1e-6)))
    out = {k: [] for k in fns}
    for _ in range(5):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(n):
                f()
            out[k].append((time.perf_counter() - t) / n)
    return {k: statistics.median(v) for k, v in out.items()}


def layouts(threads: int) -> str:
    """The compiled float32 step of two copies of a mamba-130m-shaped model, one with its wide matrices (and the
    tied head) column-major as ``decode_layout`` stored them for MKL, timed in turn in one process."""
    from subquad.layers.linear import ONEDNN
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.decode import compile_decode

    shape = dict(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False, norm_eps=1e-5)
    torch.manual_seed(0)
    row = LanguageModel(ModelConfig(**shape)).eval()
    col = LanguageModel(ModelConfig(**shape)).eval()
    col.load_state_dict(row.state_dict())
    for m in col.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.shape[0] >= 2 * m.weight.shape[1]:
            m.weight = torch.nn.Parameter(m.weight.detach().T.contiguous().T)
    col.embed.weight = torch.nn.Parameter(col.embed.weight.detach().T.contiguous().T)
    models = {"row-major": compile_decode(row), "column-major": compile_decode(col)}
    lines = [f"compiled step, products through {'oneDNN' if ONEDNN else 'MKL'}", "",
             "| rows | row-major ms | column-major ms |", "|---:|---:|---:|"]
    with torch.no_grad():
        for B in (1, 16):
            st = {k: m.prefill(torch.randint(0, 100, (B, 5)))[1] for k, m in models.items()}
            tok = torch.tensor([3] * B)
            for k, m in models.items():
                for _ in range(3):
                    m.step(tok, st[k])                     # compiled (or loaded) here
            ts = {k: [] for k in models}
            for _ in range(5):
                for k, m in models.items():
                    s, t = st[k], time.perf_counter()
                    for _ in range(16):
                        _, s = m.step(tok, s)
                    ts[k].append((time.perf_counter() - t) / 16 * 1e3)
            ms = {k: statistics.median(v) for k, v in ts.items()}
            lines.append(f"| {B} | {ms['row-major']:.2f} | {ms['column-major']:.2f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="two shapes, one and nine rows")
    ap.add_argument("--large", action="store_true", help="the larger hybrids' matrices, one and 16 rows")
    ap.add_argument("--layouts", action="store_true", help="the compiled step, row- against column-major")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.layouts:
        print(f"{layouts(a.threads)}\n\n{machine_line(matmul_gflops())}")
        return
    shapes = dict(list(SHAPES.items())[:2]) if a.quick else LARGE if a.large else SHAPES
    rows = (1, 9) if a.quick else (1, 16) if a.large else (1, 9, 16, 2048)
    lines = ["| matrix | rows | F.linear (MKL) us | oneDNN us | oneDNN packed us | MKL / oneDNN |",
             "|---|---:|---:|---:|---:|---:|"]
    results = []
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, generator=g)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            for m in rows:
                if m == 2048 and n > 10000:
                    continue                                   # the head over a prefill: seconds per call
                x = torch.randn(m, k, generator=g)
                t = timed({"aten": lambda: F.linear(x, w),
                           "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                           "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")},
                          budget_s=1.0 if m < 2048 else 3.0)
                us = {key: 1e6 * v for key, v in t.items()}
                results.append({"matrix": name, "rows": m, **us})
                lines.append(f"| {name} | {m} | {us['aten']:.1f} | {us['onednn']:.1f} | {us['packed']:.1f} | "
                             f"{us['aten'] / us['onednn']:.2f} |")
                print(lines[-1], flush=True)
    machine = machine_line(matmul_gflops())
    text = "\n".join([f"float32, {a.threads} threads; {machine}", ""] + lines)
    print(text)
    if not a.quick and not a.large:
        (OUT / "linear.json").write_text(json.dumps({"rows": results, "machine": machine}, indent=1))
        (OUT / "linear.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
