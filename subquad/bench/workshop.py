"""The workshop: the plate "Beyond Quadratic Attention", reproduced on this machine.

First half (this file, under a minute):
  1. linear attention (elu+1) computed in parallel and recurrently over 32 random
     tokens in float64, and the largest difference (the plate: 4.4e-16);
  2. memory per layer and head of a KV cache against a linear state, d = 32;
  3. a PNG (memory against context, log-log) and a JSON of every number in --out.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from subquad.bench import memory, plots
from subquad.bench.table import fmt_bytes, render


def parallel_vs_recurrent(T: int = 32, head_dim: int = 32, seed: int = 0) -> float:
    """Largest |parallel - recurrent| of normalised elu+1 linear attention, float64, one head."""
    from subquad.ops import feature_map, linear_attention

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, 1, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    phi = feature_map("elu+1")
    o_par, _ = linear_attention(phi(q), phi(k), v, mode="parallel")
    o_rec, _ = linear_attention(phi(q), phi(k), v, mode="recurrent")
    return (o_par - o_rec).abs().max().item()


def run(out: str | Path = "runs/workshop", head_dim: int = 32, contexts=None, seed: int = 0) -> dict:
    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    contexts = contexts or [1024, 4096, 16384, 65536, 131072, 262144, 1048576]

    diff = parallel_vs_recurrent(32, head_dim, seed)
    print(f"[1/3] linear attention (elu+1), 32 random tokens, d={head_dim}, float64:")
    print(f"      max |parallel - recurrent| = {diff:.2e}   (the plate: 4.4e-16; rounding error)")

    rows = memory.analytic(contexts, head_dim, "float32")
    print(f"\n[2/3] memory per layer and head, d={head_dim} (numbers; bytes in float32):")
    print(render([{"context": f"{r['context']:,}", "KV cache 2Td": f"{r['kv_numbers']:,}",
                   "state d²+d": f"{r['state_numbers']:,}", "KV bytes": fmt_bytes(r["kv_bytes"]),
                   "state bytes": fmt_bytes(r["state_bytes"]), "KV/state": f"{r['ratio']:,.0f}x"} for r in rows]))
    measured = memory.measure([1024, 4096, 16384], head_dim, "float32")
    print("      measured from the tensors the ops keep:",
          ", ".join(f"T={m['context']:,}: KV {fmt_bytes(m['kv_cache_bytes'])}, state {fmt_bytes(m['state_bytes'])}"
                    for m in measured))

    png = out / "workshop.png"
    plots.workshop_figure(png, rows, head_dim, "float32")
    result = {
        "parallel_vs_recurrent_max_abs_diff": diff,
        "head_dim": head_dim,
        "memory_analytic": rows,
        "memory_measured": measured,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seconds": round(time.time() - t0, 2),
    }
    (out / "workshop.json").write_text(json.dumps(result, indent=2))
    print(f"\n[3/3] wrote {png} and {out / 'workshop.json'} ({result['seconds']} s)")
    return result
