"""Why each route of the ops stays: every no-gradient fast path against the differentiable chunk form
it shadows, both run without a gradient, in one process with interleaved rounds.

Mamba-2's SSD has a no-gradient path with B and C shared by the heads (``ssd_inference``) beside the
decayed family's chunk engine, which runs SSD with B and C copied to every head (``ops/decay/chunk.py``,
one engine for the family with and without a gradient).
A route earns its place by being faster than the form it shadows; this measures by how much.
B = 1, 8 heads of 64, N = 64, float32. (The delta family has one engine with and without a gradient,
``ops/delta/chunk.py``: no route to weigh here.) Writes results/routes.{json,md}.

    python benchmarks/bench_routes.py            # ~2 minutes
    python benchmarks/bench_routes.py --quick    # seconds
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_line, parse_args, ratio, run_cases  # noqa: E402
from subquad.ops.decay import _ssd_as_gla  # noqa: E402
from subquad.ops.decay.ssd import ssd_inference  # noqa: E402

B = 1


def ssd_inputs(T):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, T, 8, 64, generator=g), torch.rand(B, T, 8, generator=g) * 0.1,
            -torch.rand(8, generator=g) - 0.5, torch.randn(B, T, 64, generator=g), torch.randn(B, T, 64, generator=g)]


def cases():
    big = 1 << 20
    return {
        "SSD: ssd_inference": (ssd_inputs, lambda x, dt, A, Bm, Cm: ssd_inference(x, dt, A, Bm, Cm)[0], big, 0),
        "SSD: chunk engine": (ssd_inputs, lambda x, dt, A, Bm, Cm: _ssd_as_gla(
            x, dt, A, Bm, Cm, "chunk", 64, None)[0], big, 0),
    }


def main(argv=None):
    args = parse_args(__doc__, argv)
    lengths, repeats = ([256], 1) if args.quick else ([2048, 8192, 16384], 5)
    machine = machine_line()
    print(machine, flush=True)
    rows = run_cases(cases(), lengths, repeats, budget=30.0)
    pairs = [("SSD", "ssd_inference", "chunk engine")]
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
