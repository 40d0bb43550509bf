"""Fixed-state layers run long inputs in pieces with the state carried: whole sequence against pieces.

Every fixed-state layer at d_model 512, 8 heads (Mamba-2: headdim 64, d_state 64), B=1, float32,
T = 16,384: forward (no gradient) and forward+backward with ``piece_size = None`` (one piece) and
with the layer's default ``piece_size``. Same result either way (tests/layers); this measures time.
Writes results/pieces.{json,md}.

    python benchmarks/bench_pieces.py            # ~5 minutes
    python benchmarks/bench_pieces.py --quick    # seconds
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import parse_args, ratio, run_cases, speed_tables  # noqa: E402
from subquad.layers import Mamba2, build_mixer  # noqa: E402

LAYERS = {
    "Mamba2": lambda: Mamba2(512, d_state=64, head_dim=64),
    "Mamba": lambda: build_mixer("mamba", 512, 8),
    "MultiScaleRetention": lambda: build_mixer("retention", 512, 8),
    "GatedLinearAttention": lambda: build_mixer("gla", 512, 8),
    "DeltaNet": lambda: build_mixer("deltanet", 512, 8),
    "GatedDeltaNet": lambda: build_mixer("gated_deltanet", 512, 8),
    "LinearAttention": lambda: build_mixer("linear", 512, 8),
}


def cases(T):
    out = {}
    for name, make_layer in LAYERS.items():
        torch.manual_seed(0)
        layer = make_layer()
        default = layer.piece_size
        for label, piece in (("whole", None), (f"pieces of {default:,}", default)):
            def fn(x, layer=layer, piece=piece):
                layer.piece_size = piece
                return layer(x)[0]
            out[f"{name}, {label}"] = (lambda T: [torch.randn(1, T, 512)], fn, T, T)
    return out


def main(argv=None):
    args = parse_args(__doc__, argv)
    T, repeats, budget = (512, 1, 2.0) if args.quick else (1 << 14, 3, 30.0)
    rows = run_cases(cases(T), [T], repeats, budget)
    md = speed_tables(rows, f"B=1, T={T:,}, d_model 512, float32; interleaved rounds")
    md += ["**Pieces against one piece (ratio in this run)**", ""]
    res = {"rows": rows, "speedup": {}}
    for name, make_layer in LAYERS.items():
        piece = make_layer().piece_size
        for key in ("fwd", "fwdbwd"):
            r = ratio(rows, T, f"{name}, pieces of {piece:,}", f"{name}, whole", key)
            res["speedup"][f"{name} {key}"] = r
            md.append(f"- {name} {key}: {r:.2f}x")
    (args.out / f"pieces{args.suffix}.json").write_text(json.dumps(res, indent=2))
    (args.out / f"pieces{args.suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
