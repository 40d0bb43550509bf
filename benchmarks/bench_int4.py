"""int4 products against float32 and int8, per matrix, at mamba-130m's shapes: which kernel, which group size,
and from how many rows a prefill should dequantise instead (``models.quant.INT4_ROWS``).

Each path multiplies x (rows, K) by ``--matrices`` distinct weights in turn, so each weight is read from memory
as in decoding; microseconds per matrix, the best of ``--repeats`` rounds, every path in every round (on a
shared machine the best round is the least disturbed one, and the paths share the disturbance). Paths: float32 F.linear on the
column-major weight (``decode_layout``), int8 (fbgemm, ``Int8Linear``), int4 through torch's kernel
(``aten._weight_int4pack_mm_for_cpu``, bfloat16 activations) at group sizes 32 and 128, and int4 dequantised
then F.linear (the fallback; what a prefill runs).

    python benchmarks/bench_int4.py                          # ~1 minute on 2 threads
    python benchmarks/bench_int4.py --model                  # + a mamba-130m-shape model's eager step
    python benchmarks/bench_int4.py --load-memory            # peak memory loading its quantised folders
    python benchmarks/bench_int4.py --rows 1,4,16,64 --shape 3072x768 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from subquad.models import quant
from subquad.models.quant import Int4Linear, Int8Linear


def per_matrix(fn, mods, x):
    """Microseconds per matrix of one pass over ``mods``."""
    t = time.perf_counter()
    for m in mods:
        fn(m, x)
    return (time.perf_counter() - t) / len(mods) * 1e6


def model_steps(args):
    """ms per token of an eager decoding step (batch 1) of a model at mamba-130m's shape (random weights), float32
    against int8 and int4: the paths interleaved, the best of ``--repeats`` rounds of 16 steps each."""
    import copy

    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.quant import quantize

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False)
    base = LanguageModel(cfg).eval()
    models = {"float32": base, "int8": quantize(copy.deepcopy(base), "int8")}
    for gs in (32, 128):
        models[f"int4 g{gs}"] = quantize(copy.deepcopy(base), "int4", group_size=gs)
    best = dict.fromkeys(models, float("inf"))
    with torch.no_grad():
        states = {k: m.prefill(torch.tensor([[1, 2, 3]]))[1] for k, m in models.items()}
        for _ in range(args.repeats):
            for k, m in models.items():
                t = time.perf_counter()
                s = states[k]
                for i in range(16):
                    _, s = m.step(torch.tensor([i]), s)
                best[k] = min(best[k], (time.perf_counter() - t) / 16 * 1e3)
    print("| model step (eager, batch 1) | " + " | ".join(models) + " |")
    print("|---|" + "---:|" * len(models))
    print("| ms per token | " + " | ".join(f"{v:.1f}" for v in best.values()) + " |")


def load_memory(args):
    """Peak resident memory of a fresh process that loads a saved quantised folder (int8, int4) of a mamba-130m-shape
    model, against the folder's size and against loading its float32 folder: what streaming the tensors in
    module by module (``quant.load_quantized``) keeps it to."""
    import copy
    import subprocess
    import tempfile

    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.quant import quantize

    torch.manual_seed(0)
    base = LanguageModel(ModelConfig(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False)).eval()
    # VmHWM, not ru_maxrss: the child's ru_maxrss keeps the parent's high-water mark across fork and exec
    probe = ("import re, sys, torch; from subquad.models import from_pretrained; "
             "hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]); "
             "base = hwm(); m, _ = from_pretrained(sys.argv[1]); print(base, hwm())")
    root = str(Path(__file__).resolve().parent.parent)
    print("| folder | model.safetensors MB | peak RSS after import MB | peak RSS after loading MB | added MB |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("float32", "int8", "int4"):
            m = base if kind == "float32" else quantize(copy.deepcopy(base), kind)
            folder = Path(tmp) / kind
            m.save_pretrained(folder)
            out = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True,
                                 cwd=root, env={"PYTHONPATH": root, "OMP_NUM_THREADS": str(args.threads)}, check=True)
            before, after = (int(v) / 1024 for v in out.stdout.split())
            size = (folder / "model.safetensors").stat().st_size / 2 ** 20
            print(f"| {kind} | {size:.0f} | {before:.0f} | {after:.0f} | {after - before:.0f} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--shape", default="3072x768", help="N x K of each weight (out x in); mamba-130m's in_proj")
    p.add_argument("--matrices", type=int, default=24)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", action="store_true", help="also an eager decoding step of a mamba-130m-shape model")
    p.add_argument("--load-memory", action="store_true", help="only: peak memory loading quantised folders")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.load_memory:
        return load_memory(a)
    N, K = (int(v) for v in a.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(N, K, generator=g) * 0.02 for _ in range(a.matrices)]
    call = lambda m, x: m(x)
    paths = {"float32": ([w.T.contiguous().T for w in weights], lambda w, x: F.linear(x, w), 0),
             "int8 (fbgemm)": ([Int8Linear(w) for w in weights], call, 0)}
    for gs in (32, 128):                            # (path, modules, call, INT4_ROWS: which int4 path runs)
        mods = [Int4Linear(w, None, gs) for w in weights]
        paths[f"int4 g{gs} kernel"] = (mods, call, 1 << 30)
        paths[f"int4 g{gs} dequantise"] = (mods, call, 0)
    # the same kernel fed float32 x (and float32 scales): its scalar loop on x86 - why x goes in as bfloat16
    f32 = [(m.w, m.scale_zero.float()) for m in paths["int4 g128 kernel"][0]]
    paths["int4 g128 kernel, float32 x"] = (f32, lambda m, x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, m[0], 128, m[1]), 0)
    del weights
    rows = [int(r) for r in a.rows.split(",")]
    layout = quant._layout()
    print(f"{N} x {K}, {a.matrices} matrices, {torch.get_num_threads()} threads, int4 kernel layout {layout} "
          f"({quant.LAYOUTS.get(layout, 'none: dequantising only')}); microseconds per matrix\n")
    print("| path | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    saved = quant.INT4_ROWS
    best = {(name, r): float("inf") for name in paths for r in rows}
    xs = {r: torch.randn(r, K, generator=g) for r in rows}
    try:
        for _ in range(a.repeats):                  # rounds; in each, every path at every row count
            for name, (mods, fn, int4_rows) in paths.items():
                quant.INT4_ROWS = int4_rows
                for r in rows:
                    if name.endswith("float32 x") and r > 4:
                        continue                            # ~100x slower: a few rows tell
                    fn(mods[0], xs[r])
                    best[name, r] = min(best[name, r], per_matrix(fn, mods, xs[r]))
    finally:
        quant.INT4_ROWS = saved
    for name in paths:
        print(f"| {name} | " + " | ".join(f"{best[name, r]:.0f}" if best[name, r] < float("inf") else "-"
                                           for r in rows) + " |")
    mb = {"float32": 4 * N * K, "int8": N * K + 4 * N, "int4 g32": N * K / 2 + 4 * N * K / 32,
          "int4 g128": N * K / 2 + 4 * N * K / 128}
    print("\nbytes per matrix: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in mb.items()))
    if a.model:
        print()
        model_steps(a)


if __name__ == "__main__":
    main()
