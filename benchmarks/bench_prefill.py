"""A model's prefill tokens/s: one long prompt, a batch of prompts of one length, and the same prompts packed in one
row (``cu_seqlens``, what the serving engine runs), at mamba-130m's shape or the Bamba-structured hybrid of
``bench_llama_server`` (random weights), per precision.

    python benchmarks/bench_prefill.py [--model mamba|hybrid] [--precisions f32,int8,bf16] [--rounds 3]
    python benchmarks/bench_prefill.py --tree /tmp/base ...     # another checkout's subquad (an A/B)

Rows (prompt shapes): 1 x 2,048, 1 x 512, 16 x 128 batched, 16 x 128 packed, 16 x 32 packed; each the fastest of
``--rounds`` calls of ``model.prefill(ids, logits="last")`` after two warm-ups, no gradient, 2 threads. Writes
results/prefill[_hybrid].{json,md} (not with ``--tree``: an A/B prints only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROWS = [("1 x 2048", 1, 2048, False), ("1 x 512", 1, 512, False), ("16 x 128 batched", 16, 128, False),
        ("16 x 128 packed", 16, 128, True), ("16 x 32 packed", 16, 32, True)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mamba", "hybrid"], default="mamba")
    ap.add_argument("--precisions", default="f32,int8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tree", default=None, help="import subquad from this checkout (default: this one)")
    a = ap.parse_args(argv)
    here = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(here))
    from benchmarks.bench_llama_server import HYBRID, SHAPE
    from benchmarks.common import OUT, machine_line, matmul_gflops
    if a.tree:
        sys.path.insert(0, str(Path(a.tree).resolve()))
        for name in [m for m in sys.modules if m == "subquad" or m.startswith("subquad.")]:
            del sys.modules[name]
    import torch

    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.quant import quantize

    torch.set_num_threads(2)
    rate = matmul_gflops()
    table = {}
    for prec in a.precisions.split(","):
        torch.manual_seed(0)
        model = LanguageModel(ModelConfig(**(SHAPE if a.model == "mamba" else HYBRID))).eval()
        if prec != "f32":
            quantize(model, prec)
        for name, rows, length, packed in ROWS:
            ids = torch.randint(0, 50000, (rows, length))
            kw = {}
            if packed:
                ids, kw = ids.reshape(1, -1), {"cu_seqlens": torch.arange(rows + 1) * length}
            with torch.no_grad():
                for _ in range(2):
                    model.prefill(ids, None, logits="last", **kw)
                best = float("inf")
                for _ in range(a.rounds):
                    t = time.perf_counter()
                    model.prefill(ids, None, logits="last", **kw)
                    best = min(best, time.perf_counter() - t)
            table.setdefault(name, {})[prec] = rows * length / best
            print(f"{prec} {name}: {rows * length / best:.0f} tokens/s", flush=True)
    precs = a.precisions.split(",")
    lines = [f"{a.model}'s shape, random weights, prefill tokens/s (fastest of {a.rounds}); "
             f"{machine_line(rate)}", "", "| prompts | " + " | ".join(precs) + " |",
             "|---|" + "---:|" * len(precs)]
    lines += [f"| {name} | " + " | ".join(f"{table[name][p]:.0f}" for p in precs) + " |" for name, *_ in ROWS]
    print("\n".join(lines))
    if not a.tree:
        stem = "prefill" if a.model == "mamba" else "prefill_hybrid"
        (OUT / f"{stem}.json").write_text(json.dumps(table, indent=1))
        (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
