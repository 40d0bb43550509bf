"""KDA (the gated delta rule with a per-channel decay) at the op level: subquad's chunk form against
transformers' own torch fallback (``chunk_kimi_delta_attention`` in ``modeling_kimi_linear``), forward and
forward + backward, float32, B = 1, H = 4, K = V = 128 (Kimi Linear's head size), T = 4,096 and 16,384;
the outputs are compared before timing. The same inputs for both: q, k L2-normalised beforehand
(transformers' ``use_qk_l2norm_in_kernel`` off), log-decays in [-1, 0) per channel, beta in (0, 1).

    python benchmarks/bench_kda.py                # ~5 minutes
    python benchmarks/bench_kda.py --quick        # T = 256, 512
Writes results/kda.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import OUT, machine_line, timeit  # noqa: E402
from subquad.ops import gated_delta_rule  # noqa: E402


def inputs(T, H=4, K=128, grad=False):
    g = torch.Generator().manual_seed(T)
    q, k = (F.normalize(torch.randn(1, T, H, K, generator=g), dim=-1) for _ in range(2))
    x = {"q": q, "k": k, "v": torch.randn(1, T, H, K, generator=g), "g": -torch.rand(1, T, H, K, generator=g),
         "beta": torch.rand(1, T, H, generator=g)}
    return {n: t.requires_grad_(grad) for n, t in x.items()}


def ours(x):
    return gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True)


def theirs(x):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    return chunk_kimi_delta_attention(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], output_final_state=True)


def fwd_bwd(fn, x):
    def step():
        o, S = fn(x)
        (o.square().mean() + S.square().mean()).backward()
        for t in x.values():
            t.grad = None
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_line()
    print(machine, flush=True)
    rows = []
    for T in ((256, 512) if args.quick else (4096, 16384)):
        x = inputs(T)
        with torch.no_grad():
            o1, s1 = ours(x)
            o2, s2 = theirs(x)
        err = max(((o1 - o2).abs().max() / o2.abs().max()).item(), ((s1 - s2).abs().max() / s2.abs().max()).item())
        row = {"T": T, "max_rel_diff": err}
        with torch.no_grad():
            row["fwd_subquad_s"] = timeit(lambda: ours(x), args.repeats)
            row["fwd_transformers_s"] = timeit(lambda: theirs(x), args.repeats)
        xg = inputs(T, grad=True)
        row["fwdbwd_subquad_s"] = timeit(fwd_bwd(ours, xg), args.repeats)
        row["fwdbwd_transformers_s"] = timeit(fwd_bwd(theirs, xg), args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
    md = [f"{machine}. KDA op, float32, B=1, H=4, K=V=128; median of {args.repeats}.", "",
          "| T | forward: subquad | transformers | ratio | fwd+bwd: subquad | transformers | ratio | max rel. diff |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['T']:,} | {r['fwd_subquad_s'] * 1e3:,.0f} ms | {r['fwd_transformers_s'] * 1e3:,.0f} ms | "
                  f"{r['fwd_transformers_s'] / r['fwd_subquad_s']:.2f}x | {r['fwdbwd_subquad_s'] * 1e3:,.0f} ms | "
                  f"{r['fwdbwd_transformers_s'] * 1e3:,.0f} ms | "
                  f"{r['fwdbwd_transformers_s'] / r['fwdbwd_subquad_s']:.2f}x | {r['max_rel_diff']:.1e} |")
    suffix = "_quick" if args.quick else ""
    (args.out / f"kda{suffix}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    (args.out / f"kda{suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
