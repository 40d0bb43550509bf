"""The ``subquad`` command: thin - parse arguments, call the library, print."""

from __future__ import annotations

import argparse
import sys


def _contexts(text: str) -> list[int]:
    try:
        vals = [int(float(x.replace("_", ""))) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--context takes comma-separated token counts, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"--context needs positive token counts, got {text!r}")
    return vals


def _positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def cmd_memory(args) -> int:
    from subquad.bench import memory
    from subquad.bench.table import fmt_bytes, render

    rows = memory.analytic(args.context, args.head_dim, args.dtype)
    print(f"Memory per layer and head, head dim d = {args.head_dim}, {args.dtype}")
    print(render([{"context": f"{r['context']:,}", "KV cache 2Td (numbers)": f"{r['kv_numbers']:,}",
                   "state d²+d (numbers)": f"{r['state_numbers']:,}",
                   "KV cache": f"{r['kv_bytes']:,} B ({fmt_bytes(r['kv_bytes'])})",
                   "state": f"{r['state_bytes']:,} B ({fmt_bytes(r['state_bytes'])})", "ratio": f"{r['ratio']:,.0f}x"} for r in rows]))
    measured_ctx = [T for T in args.context if T <= args.measure_max] or [min(args.context)]
    print(f"\nMeasured from the tensors the ops keep (B=1, one head), T <= {args.measure_max:,}:")
    print(render([{"context": f"{m['context']:,}", "KV cache (KVCache.nbytes)": f"{m['kv_cache_bytes']:,} B",
                   "state (S + z)": f"{m['state_bytes']:,} B", "state dtype": m["state_dtype"]}
                  for m in memory.measure(measured_ctx, args.head_dim, args.dtype)]))
    if args.flops:
        print("\nOperations of the attention product (per head): softmax N²d against linear Nd²")
        print(render([{"N": f"{r['context']:,}", "softmax N²d": f"{r['softmax_flops']:.2e}",
                       "linear Nd²": f"{r['linear_flops']:.2e}", "ratio": f"{r['ratio']:,.0f}x"}
                      for r in memory.flops(args.context, args.head_dim)]))
    return 0


def cmd_workshop(args) -> int:
    from subquad.bench import workshop

    workshop.run(out=args.out, head_dim=args.head_dim, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="subquad", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("memory", help="KV cache against linear state, per layer and head")
    m.add_argument("--context", type=_contexts, default=[1024, 4096, 16384, 65536, 131072, 262144, 1048576],
                   help="comma-separated context lengths (default 1K..1M)")
    m.add_argument("--head-dim", type=_positive, default=32, help="head dimension d (default 32)")
    m.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    m.add_argument("--flops", action="store_true", help="also print N^2 d against N d^2")
    m.add_argument("--measure-max", type=_positive, default=16384,
                   help="measure allocated bytes at contexts up to this length (default 16384)")
    m.set_defaults(fn=cmd_memory)

    w = sub.add_parser("workshop", help="the plate, reproduced: forms agree, memory, (training runs)")
    w.add_argument("--out", default="runs/workshop", help="output folder (default runs/workshop)")
    w.add_argument("--head-dim", type=_positive, default=32)
    w.add_argument("--seed", type=int, default=0)
    w.set_defaults(fn=cmd_workshop)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
