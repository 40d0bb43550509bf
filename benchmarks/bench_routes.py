"""Why each route of the ops stays: every no-gradient fast path against the differentiable chunk form
it shadows, both run without a gradient, in one process with interleaved rounds.

The delta rule and Mamba-2's SSD each have a differentiable chunk form (``chunk.py`` /
``ssd_chunkwise``) and a no-gradient path (``inference.py`` / ``ssd_inference``) that batches groups of
chunks in reused buffers (the decayed family has one engine for both, ``ops/decay/chunk.py``). A route
earns its place by being faster than the form it shadows; this measures by how much.
B = 1, H = 4, K = V = 64 (SSD: 8 heads of 64, N = 64), float32; the differentiable form runs in pieces
of 2,048 tokens as the op runs it. Writes results/routes.{json,md}.

    python benchmarks/bench_routes.py            # ~2 minutes
    python benchmarks/bench_routes.py --quick    # seconds
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_line, parse_args, ratio, run_cases  # noqa: E402
from subquad.ops.common.chunking import in_pieces  # noqa: E402
from subquad.ops.common.routes import PIECE  # noqa: E402
from subquad.ops.decay.ssd import ssd_chunkwise, ssd_inference  # noqa: E402
from subquad.ops.delta.chunk import _chunkwise as delta_chunkwise  # noqa: E402
from subquad.ops.delta.inference import delta_inference  # noqa: E402

B, H, K = 1, 4, 64


def qkv(T):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, generator=g) * 0.3 for _ in range(3))
    return q, F.normalize(k, dim=-1), v, g


def delta_inputs(T):
    q, k, v, g = qkv(T)
    return [q, k, v, -torch.rand(B, T, H, generator=g) * 0.1, torch.rand(B, T, H, generator=g)]


def ssd_inputs(T):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, 8, 64, generator=g), torch.rand(B, T, 8, generator=g) * 0.1,
            -torch.rand(8, generator=g) - 0.5, torch.randn(B, T, 64, generator=g), torch.randn(B, T, 64, generator=g)]


def cases():
    big = 1 << 20
    return {
        "gated delta rule: inference.py": (delta_inputs, lambda q, k, v, g, b: delta_inference(
            q, k, v, g, b, scale=0.125, chunk_size=64)[0], big, 0),
        "gated delta rule: chunk.py": (delta_inputs, lambda q, k, v, g, b: in_pieces(
            lambda a, c, d, e, f, s: delta_chunkwise(a, c, d, e, f, 0.125, 64, s), (q, k, v, g, b), PIECE,
            None)[0], big, 0),
        "SSD: ssd_inference": (ssd_inputs, lambda x, dt, A, Bm, Cm: ssd_inference(x, dt, A, Bm, Cm)[0], big, 0),
        "SSD: ssd_chunkwise": (ssd_inputs, lambda x, dt, A, Bm, Cm: in_pieces(
            lambda a, b, c, d, s: ssd_chunkwise(a, b, A, c, d, initial_state=s), (x, dt, Bm, Cm), PIECE,
            None)[0], big, 0),
    }


def main(argv=None):
    args = parse_args(__doc__, argv)
    lengths, repeats = ([256], 1) if args.quick else ([2048, 8192, 16384], 5)
    machine = machine_line()
    print(machine, flush=True)
    rows = run_cases(cases(), lengths, repeats, budget=30.0)
    pairs = [("gated delta rule", "inference.py", "chunk.py"), ("SSD", "ssd_inference", "ssd_chunkwise")]
    md = [f"Forward without a gradient, B = 1, float32; {machine}. Each cell: the no-gradient path's time, "
          "and how many times faster it is than the differentiable form it shadows.", "",
          "| engine | " + " | ".join(f"T={T:,}" for T in lengths) + " |", "|---|" + "---|" * len(lengths)]
    res = {"machine": machine, "rows": rows, "speedup": {}}
    get = {(r["T"], r["impl"]): r for r in rows}
    for family, fast, slow in pairs:
        cells = []
        for T in lengths:
            r = ratio(rows, T, f"{family}: {fast}", f"{family}: {slow}", "fwd")
            res["speedup"][f"{family} T={T}"] = r
            cells.append(f"{get[(T, f'{family}: {fast}')]['fwd'] * 1e3:.1f} ms, {r:.2f}x")
        md.append(f"| {family}: {fast} vs {slow} | " + " | ".join(cells) + " |")
    (args.out / f"routes{args.suffix}.json").write_text(json.dumps(res, indent=2))
    (args.out / f"routes{args.suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
