"""``subquad memory``: the KV cache against the recurrent state, per layer and head, computed and measured."""

from __future__ import annotations

import argparse

from subquad.cli.common import check_folder_of, positive, token_count


def contexts(text: str) -> list[int]:
    """--context 1K,4K,1M (eval --lengths' spelling) or 1024,4096 -> token counts."""
    try:
        vals = [token_count(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--context takes comma-separated token counts (e.g. 1K,4K,1M): {e}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"--context needs positive token counts, got {text!r}")
    return vals


def add_parser(command) -> None:
    m = command("memory", "KV cache against linear state, per layer and head; each mixer's state (--mixers)")
    m.add_argument("--context", type=contexts, default=[1024, 4096, 16384, 65536, 131072, 262144, 1048576],
                   help="comma-separated context lengths, e.g. 1K,4K,1M (default: 1K..1M)")
    m.add_argument("--head-dim", type=positive, default=32, help="head dimension d")
    m.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"],
                   help="element type of cache and state")
    m.add_argument("--flops", action="store_true", help="also print N^2 d against N d^2")
    m.add_argument("--measure-max", type=positive, default=16384,
                   help="measure allocated bytes at contexts up to this length")
    m.add_argument("--mixers", type=mixer_names, default=None,
                   help="also measure each mixer's decoding state per layer at these contexts: comma-separated "
                        "names, or 'all' (at --d-model and --n-heads)")
    m.add_argument("--d-model", type=positive, default=768, help="with --mixers: the layers' width (mamba-130m's)")
    m.add_argument("--n-heads", type=positive, default=12, help="with --mixers: the layers' head count")
    m.add_argument("--out", help="with --mixers: also plot the states against context in this PNG")
    m.set_defaults(fn=run)


def mixer_names(text: str) -> list[str]:
    """--mixers all, or comma-separated names (checked against the table when measured)."""
    from subquad.layers import MIXERS

    if text.strip() == "all":
        return [n for n, e in MIXERS.items() if not e.encoder_only]
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"--mixers takes comma-separated mixer names or 'all', got {text!r}")
    return names


def run(args) -> int:
    from subquad.bench import memory
    from subquad.bench.table import fmt_bytes, render

    if args.out and not args.mixers:
        raise ValueError("memory: --out plots the mixers' states: give --mixers too")
    if args.mixers:
        memory.check_mixers(args.mixers)                 # before any table prints
    if args.out:
        check_folder_of("--out", args.out)
    rows = memory.analytic(args.context, args.head_dim, args.dtype)
    print(f"Memory per layer and head, head dim d = {args.head_dim}, {args.dtype}")
    print(render([{"context": f"{r['context']:,}", "KV cache 2Td (numbers)": f"{r['kv_numbers']:,}",
                   "state d²+d (numbers)": f"{r['state_numbers']:,}",
                   "KV cache": f"{r['kv_bytes']:,} B ({fmt_bytes(r['kv_bytes'])})",
                   "state": f"{r['state_bytes']:,} B ({fmt_bytes(r['state_bytes'])})",
                   "ratio": f"{r['ratio']:,.0f}x"} for r in rows]))
    measured = memory.measure(memory.measured_contexts(args.context, args.measure_max), args.head_dim, args.dtype)
    print("\n" + memory.measured_title(measured))
    print(render([{"context": f"{m['context']:,}", "KV cache (KVCache.nbytes)": f"{m['kv_cache_bytes']:,} B",
                   "state (S + z)": f"{m['state_bytes']:,} B", "state dtype": m["state_dtype"]}
                  for m in measured]))
    if args.mixers:
        states = memory.mixer_states(args.mixers, args.context, args.d_model, args.n_heads, args.dtype)
        soft = next((r for r in states if r["mixer"] == "softmax"), None) or \
            memory.mixer_states(["softmax"], args.context, args.d_model, args.n_heads, args.dtype)[0]
        longest = max(args.context)
        print(f"\nDecoding state per layer of each mixer (B=1, d_model {args.d_model}, {args.n_heads} heads, "
              f"{args.dtype} layers), measured from the state each returns after {memory.PROBE[0]} and "
              f"{memory.PROBE[1]} tokens (a KV cache grows the same bytes every token):")
        print(render([{"mixer": r["mixer"], "grows with context": r["grows"],
                       **{f"{T:,}": fmt_bytes(r["bytes"][T]) for T in args.context},
                       f"softmax's / this at {longest:,}": f"{soft['bytes'][longest] / r['bytes'][longest]:,.1f}x"}
                      for r in states]))
        if args.out:
            from subquad.bench.plots import mixer_states_figure

            mixer_states_figure(args.out, states, args.d_model, args.n_heads, args.dtype)
            print(f"wrote {args.out}")
    if args.flops:
        print("\nOperations of the attention product (per head): softmax N²d against linear Nd²")
        print(render([{"N": f"{r['context']:,}", "softmax N²d": f"{r['softmax_flops']:.2e}",
                       "linear Nd²": f"{r['linear_flops']:.2e}", "ratio": f"{r['ratio']:,.0f}x"}
                      for r in memory.flops(args.context, args.head_dim)]))
    return 0
