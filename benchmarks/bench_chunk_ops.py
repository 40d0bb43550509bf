"""The chunk ops alone: forward useful FLOP/s against this machine's matmul rate (issue 21).

B = 1, H = 8, K = V = 64 (Mamba-2's SSD: P = 64 per head, N = 64 shared; Mamba's scan: 512 channels,
N = 16), float32, no gradient (the inference / prefill path), each op's default chunk size, T = 16,384 by
default. Useful FLOPs are the chunk algorithm's matmuls with the causal half of each intra-chunk
product, per token and head (C the chunk size):

    linear attention, retention, simple GLA, GLA, SSD:  C (K + V) + 4 K V          (Q K^T, A V; Q S; K^T V)
    delta rule, gated delta rule, KDA:                   that + C K + C (K + V) + 2 K V
                                                         (K K^T; the WY products T K, T V; W S)
    Mamba's selective scan (no matmul form):             9 N per channel (decay, input, state update, read)

so a row's "% of matmul" is how close the op comes to running at the speed of one big matmul. The matmul
rate (2048^2 float32) is measured in the same run, with the same threads, and so is the rate of the
batched 64 x 64 x 64 products a chunk form is made of, 64 at a time (in cache) and 2,048 at a time
(streaming from memory): the first shows what the products could reach, the second what they reach when
every operand comes from memory.

    python benchmarks/bench_chunk_ops.py                     # T = 16,384, every op: a minute or two
    python benchmarks/bench_chunk_ops.py --lengths 4096,16384 --threads 1
    python benchmarks/bench_chunk_ops.py --quick             # tiny, seconds (tests)
Writes results/chunk_ops.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import OUT, machine_line, matmul_gflops, timeit  # noqa: E402
from subquad import ops  # noqa: E402

H, K, V = 8, 64, 64


def _qkv(T, g):
    q, k = (F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1) for _ in range(2))
    return q, k, torch.randn(1, T, H, V, generator=g)


def cases(T):
    """name -> (inputs, run, useful FLOPs): the op's chunk form under no_grad."""
    g = torch.Generator().manual_seed(0)
    C = 64
    base = H * T * (C * (K + V) + 4 * K * V)
    delta = base + H * T * (C * K + C * (K + V) + 2 * K * V)
    q, k, v = _qkv(T, g)
    gh = F.logsigmoid(torch.randn(1, T, H, generator=g) + 3)            # decays near 1, as trained models have
    gk = F.logsigmoid(torch.randn(1, T, H, K, generator=g) + 3) / 16
    beta = torch.rand(1, T, H, generator=g)
    ret_g = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32)))
    dt = F.softplus(torch.randn(1, T, H, generator=g) - 2)
    Bm, Cm = torch.randn(1, T, 64, generator=g), torch.randn(1, T, 64, generator=g)
    Dm, N = H * V, 16
    xs, dts = torch.randn(1, T, Dm, generator=g), F.softplus(torch.randn(1, T, Dm, generator=g) - 2)
    As = -torch.exp(torch.randn(Dm, N, generator=g) * 0.5)
    Bs, Cs = torch.randn(1, T, N, generator=g), torch.randn(1, T, N, generator=g)
    return {
        "linear_attention": (lambda: ops.linear_attention(q, k, v, normalize=False), base),
        "retention": (lambda: ops.retention(q, k, v, ret_g), base),
        "simple_gla": (lambda: ops.simple_gla(q, k, v, gh), base),
        "gla": (lambda: ops.gla(q, k, v, gk), base),
        "ssd (Mamba-2)": (lambda: ops.ssd(v, dt, -torch.ones(H), Bm, Cm), base),
        "delta_rule": (lambda: ops.delta_rule(q, k, v, beta), delta),
        "gated_delta_rule": (lambda: ops.gated_delta_rule(q, k, v, gh, beta), delta),
        "kda (gated_delta_rule, g per key)": (lambda: ops.gated_delta_rule(q, k, v, gk, beta), delta),
        "selective_scan (Mamba)": (lambda: ops.selective_scan(xs, dts, As, Bs, Cs), 9 * N * Dm * T),
    }


def bmm_gflops(n=2048, c=64, repeats=5):
    a, b = torch.randn(n, c, c), torch.randn(n, c, c)
    return 2 * n * c ** 3 / timeit(lambda: torch.bmm(a, b), repeats) / 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="16384")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--ops", default=None, help="comma-separated subset of the op names")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    threads = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        return _run(a)
    finally:
        torch.set_num_threads(threads)       # a caller (the tests) keeps its own


def _run(a):
    lengths = [256] if a.quick else [int(x) for x in a.lengths.split(",")]
    rate = matmul_gflops(512 if a.quick else 2048)
    small, stream = bmm_gflops(64), bmm_gflops(256 if a.quick else 2048)
    line = machine_line(rate) + f"; batched 64³ products {small:.0f} GFLOP/s in cache, {stream:.0f} streaming"
    print(line, flush=True)
    rows = []
    for T in lengths:
        for name, (run, flops) in cases(T).items():
            if a.ops and not any(o.strip() and o.strip() in name for o in a.ops.split(",")):
                continue
            with torch.no_grad():
                s = timeit(run, repeats=1 if a.quick else a.repeats)
            r = {"op": name, "T": T, "ms": s * 1e3, "gflop": flops / 1e9, "gflops": flops / s / 1e9,
                 "of_matmul": flops / s / 1e9 / rate}
            rows.append(r)
            print(f"  T={T:>6} {name:<36} {r['ms']:8.1f} ms  {r['gflop']:6.2f} GFLOP  {r['gflops']:6.1f} GFLOP/s  "
                  f"{100 * r['of_matmul']:5.1f}% of matmul", flush=True)
    md = [line, "", "| op | T | ms | useful GFLOP | GFLOP/s | % of matmul |", "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['op']} | {r['T']:,} | {r['ms']:.1f} | {r['gflop']:.2f} | {r['gflops']:.1f} | "
           f"{100 * r['of_matmul']:.0f}% |" for r in rows]
    stem = "chunk_ops_quick" if a.quick else "chunk_ops"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{stem}.json").write_text(json.dumps({"machine": line, "matmul_gflops": rate, "bmm_gflops": [small, stream],
                                                    "rows": rows}, indent=1))
    (a.out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return rows


if __name__ == "__main__":
    main()
