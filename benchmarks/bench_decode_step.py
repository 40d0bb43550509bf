"""One decoding step per op: the token loop (what a call of fewer than ``SHORT`` tokens without a
gradient runs; 16 for Mamba's scan) against the batched no-gradient chunk path it replaced, at T = 1 .. 16.

Shapes of the language models' micro preset (B=1, 4 heads of 32; Mamba-2: 8 heads of 32, N 16;
Mamba: d_inner 256, N 16), float32, interleaved rounds. Writes results/decode_step.{json,md}.

    python benchmarks/bench_decode_step.py            # ~20 seconds
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import parse_args, run_cases, speed_tables  # noqa: E402
from subquad.ops.common.routes import SHORT  # noqa: E402
from subquad.ops.delta.chunk import chunk_delta  # noqa: E402
from subquad.ops.delta.recurrent import recurrent_delta  # noqa: E402
from subquad.ops.decay.chunk import chunk_engine  # noqa: E402
from subquad.ops.decay.recurrent import recurrent_decay_attention  # noqa: E402
from subquad.ops.decay.ssd import ssd_inference  # noqa: E402
from subquad.ops.mamba import SHORT_SCAN  # noqa: E402
from subquad.ops.mamba.chunk import chunk_scan  # noqa: E402
from subquad.ops.mamba.recurrent import recurrent_scan  # noqa: E402


def cases():
    H, K = 4, 32

    def attn(T):
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, T, H, K, generator=g) for _ in range(3))
        k = torch.nn.functional.normalize(k, dim=-1)
        return [q, k, v, -torch.rand(1, T, H, generator=g) * 0.1, torch.rand(1, T, H, generator=g),
                torch.randn(1, H, K, K, generator=g)]

    def ssd(T):
        g = torch.Generator().manual_seed(T)
        Hs, P, N = 8, 32, 16
        x = torch.randn(1, T, Hs, P, generator=g)
        dt = torch.rand(1, T, Hs, generator=g) * 0.1
        return [x, dt, -torch.rand(Hs, generator=g) - 0.1, torch.randn(1, T, N, generator=g),
                torch.randn(1, T, N, generator=g), torch.randn(1, Hs, N, P, generator=g)]

    def scan(T):
        g = torch.Generator().manual_seed(T)
        Dm, N = 256, 16
        return [torch.randn(1, T, Dm, generator=g), torch.rand(1, T, Dm, generator=g) * 0.1,
                -torch.rand(Dm, N, generator=g), torch.randn(1, T, N, generator=g),
                torch.randn(1, T, N, generator=g), torch.randn(1, Dm, N, generator=g)]

    def expand(x, dt, A, Bm, Cm, h0):
        Hs = x.shape[2]
        return Cm.unsqueeze(2).expand(-1, -1, Hs, -1), Bm.unsqueeze(2).expand(-1, -1, Hs, -1) * dt.unsqueeze(-1), \
            x, dt * A, h0

    big = 1 << 10
    return {
        "simple_gla: token loop": (attn, lambda q, k, v, g, b, S: recurrent_decay_attention(
            q, k, v, g, scale=0.2, initial_state=S)[0], big, 0),
        "simple_gla: chunk path": (attn, lambda q, k, v, g, b, S: chunk_engine(
            q, k, v, g, scale=0.2, chunk_size=64, initial_state=S)[0], big, 0),
        "gated delta rule: token loop": (attn, lambda q, k, v, g, b, S: recurrent_delta(
            q, k, v, g, b, scale=0.2, initial_state=S)[0], big, 0),
        "gated delta rule: chunk path": (attn, lambda q, k, v, g, b, S: chunk_delta(
            q, k, v, g, b, scale=0.2, chunk_size=64, initial_state=S)[0], big, 0),
        "Mamba-2 SSD: token loop": (ssd, lambda *a: (lambda q, k, v, g, h0: recurrent_decay_attention(
            q, k, v, g, scale=1.0, initial_state=h0)[0])(*expand(*a)), big, 0),
        "Mamba-2 SSD: chunk path": (ssd, lambda x, dt, A, Bm, Cm, h0: ssd_inference(
            x, dt, A, Bm, Cm, initial_state=h0)[0], big, 0),
        "Mamba scan: token loop": (scan, lambda x, dt, A, Bm, Cm, h0: recurrent_scan(
            x, dt, A, Bm, Cm, initial_state=h0)[0], big, 0),
        "Mamba scan: chunk path": (scan, lambda x, dt, A, Bm, Cm, h0: chunk_scan(
            x, dt, A, Bm, Cm, chunk_size=64, initial_state=h0)[0], big, 0),
    }


def main(argv=None):
    args = parse_args(__doc__, argv)
    lengths, repeats = ([1, 2], 3) if args.quick else ([1, 2, 4, 8, 16], 100)
    with torch.no_grad():
        rows = run_cases(cases(), lengths, repeats, budget=5.0)
    get = {(r["T"], r["impl"]): r["fwd"] for r in rows}
    lines = []
    for op in ("simple_gla", "gated delta rule", "Mamba-2 SSD", "Mamba scan"):
        r = get[(1, f"{op}: chunk path")] / get[(1, f"{op}: token loop")]
        lines.append(f"- {op}: the token loop {r:.1f}x faster than the chunk path at T = 1")
    md = speed_tables(rows, "one call without a gradient, float32; interleaved rounds")
    md = md[:md.index(next(x for x in md if x.startswith("**Forward + backward**")))]   # forward only
    if (16, "Mamba scan: chunk path") in get:
        r = get[(16, "Mamba scan: chunk path")] / get[(16, "Mamba scan: token loop")]
        lines.append(f"- Mamba scan: the token loop {r:.1f}x faster than the chunk path at T = 16")
    md += ["", f"**The token loop against the chunk path** (calls under {SHORT} tokens take the loop; "
           f"under {SHORT_SCAN} for Mamba's scan)", ""] + lines
    (args.out / f"decode_step{args.suffix}.json").write_text(json.dumps({"rows": rows}, indent=2))
    (args.out / f"decode_step{args.suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
