"""The delta rule and the gated delta rule: chunk (WY) against recurrent and the peers.

B=1, H=8, K=V=64, float32, 2 threads, T = 1K, 4K, 16K, L2-normalised keys:
subquad's delta_rule / gated_delta_rule (chunk 64 and recurrent) against
flash-linear-attention's `delta_rule_chunkwise` (chunk 32 and 64; its best counts)
and `naive_chunk_gated_delta_rule`, and transformers' `torch_chunk_gated_delta_rule`
(Qwen3-Next's torch path). Writes results/delta_rule.{json,md}.

    python benchmarks/bench_delta_rule.py            # ~10 minutes
    python benchmarks/bench_delta_rule.py --quick
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import parse_args, fla_file, ratio, run_cases, speed_tables, target_lines  # noqa: E402
from subquad.ops import delta_rule, gated_delta_rule  # noqa: E402

H, K, V = 8, 64, 64


def make(T):
    q, k = (F.normalize(torch.randn(1, T, H, K), dim=-1) for _ in range(2))
    v = torch.randn(1, T, H, V)
    beta = torch.rand(1, T, H)
    g = F.logsigmoid(torch.randn(1, T, H) + 3)
    return [q, k, v, beta, g]


def cases(peers):
    big, mid = 1 << 14, 1 << 12
    c = {
        "delta_rule chunk": (make, lambda q, k, v, b, g: delta_rule(q, k, v, b)[0], big, big),
        "delta_rule recurrent": (make, lambda q, k, v, b, g: delta_rule(q, k, v, b, mode="recurrent")[0], mid, 1024),
        "gated_delta_rule chunk": (make, lambda q, k, v, b, g: gated_delta_rule(q, k, v, g, b)[0], big, big),
        "gated_delta_rule recurrent": (make, lambda q, k, v, b, g: gated_delta_rule(q, k, v, g, b, mode="recurrent")[0],
                                       mid, 1024),
    }
    if peers.get("fla_delta"):
        f = peers["fla_delta"].delta_rule_chunkwise

        def fla_delta(C):
            return lambda q, k, v, b, g: f(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           b.transpose(1, 2), chunk_size=C)[0]
        c["fla delta_rule_chunkwise C=32"] = (make, fla_delta(32), big, big)
        c["fla delta_rule_chunkwise C=64"] = (make, fla_delta(64), big, big)
    if peers.get("fla_gated"):
        fg = peers["fla_gated"].naive_chunk_gated_delta_rule
        c["fla naive_chunk_gated_delta_rule"] = (make, lambda q, k, v, b, g: fg(q, k, v, g, b)[0], big, big)
    if peers.get("hf"):
        fh = peers["hf"]
        c["transformers torch_chunk_gated_delta_rule"] = (make, lambda q, k, v, b, g: fh(q, k, v, g, b)[0], big, big)
    return c


def load_peers():
    peers = {"fla_delta": fla_file("ops/delta/naive.py"), "fla_gated": fla_file("ops/gated_delta_rule/naive.py")}
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
        peers["hf"] = torch_chunk_gated_delta_rule
    except Exception as e:
        print(f"  (transformers' Qwen3-Next torch path not available: {type(e).__name__}: {e})")
    return peers


def main(argv=None):
    args = parse_args(__doc__, argv)
    lengths, repeats, budget = ([256, 512], 1, 2.0) if args.quick else ([1024, 4096, 16384], 3, 30.0)
    rows = run_cases(cases(load_peers()), lengths, repeats, budget)
    tg = []
    for T in lengths[-2:]:
        for key in ("fwd", "fwdbwd"):
            best = [ratio(rows, T, "delta_rule chunk", f"fla delta_rule_chunkwise C={C}", key) for C in (32, 64)]
            best = [b for b in best if b is not None]
            if best:
                r = min(best)       # against fla at its best chunk size (the faster one)
                tg.append({"what": f"delta_rule chunk vs fla delta_rule_chunkwise (best C), {key}, T={T:,}",
                           "value": f"{r:.1f}x", "target": ">= 2x", "met": r >= 2})
            peers = [ratio(rows, T, "gated_delta_rule chunk", n, key)
                     for n in ("fla naive_chunk_gated_delta_rule", "transformers torch_chunk_gated_delta_rule")]
            peers = [x for x in peers if x is not None]
            if peers:
                r = min(peers)
                tg.append({"what": f"gated_delta_rule chunk vs the faster of fla / transformers, {key}, T={T:,}",
                           "value": f"{r:.1f}x", "target": ">= 2x", "met": r >= 2})
    md = speed_tables(rows, "B=1, H=8, K=V=64, float32, L2-normalised keys") + ["**Targets (this run)**", ""]
    md += target_lines(tg)
    suffix = args.suffix
    (args.out / f"delta_rule{suffix}.json").write_text(json.dumps({"rows": rows, "targets": tg}, indent=2))
    (args.out / f"delta_rule{suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
