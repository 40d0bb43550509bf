"""The Mamba block against the pure-PyTorch Mambas people use on CPU.

d_model 512, d_state 16, expand 2, B=1, float32, 2 threads, T = 1K, 4K, 16K:
subquad's `Mamba` (chunked "lanes" selective scan) against mambapy's `MambaBlock`
(its parallel scan) and transformers' `MambaMixer` (its sequential torch path),
forward and forward+backward, with peak memory measured by the torch profiler.
Writes results/mamba.{json,md}.

    python benchmarks/bench_mamba.py            # ~10 minutes
    python benchmarks/bench_mamba.py --quick
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import parse_args, ratio, run_cases, speed_tables, target_lines  # noqa: E402
from subquad.layers import Mamba  # noqa: E402

D_MODEL, D_STATE = 512, 16


def cases():
    torch.manual_seed(0)

    def make(T):
        return [torch.randn(1, T, D_MODEL)]

    ours = Mamba(D_MODEL, d_state=D_STATE)
    c = {"Mamba (subquad)": (make, lambda x: ours(x)[0], 1 << 14, 1 << 14)}
    try:
        from mambapy.mamba import MambaBlock, MambaConfig
        mp = MambaBlock(MambaConfig(d_model=D_MODEL, n_layers=1, d_state=D_STATE, pscan=True))
        c["mambapy MambaBlock (pscan)"] = (make, lambda x: mp(x), 1 << 14, 1 << 14)
    except Exception as e:
        print(f"  (mambapy not available: {type(e).__name__}: {e})")
    try:
        from transformers import MambaConfig as HFConfig
        from transformers.models.mamba.modeling_mamba import MambaMixer
        hf = MambaMixer(HFConfig(hidden_size=D_MODEL, state_size=D_STATE, expand=2, num_hidden_layers=1), layer_idx=0)
        c["transformers MambaMixer (torch path)"] = (make, lambda x: hf(x), 1 << 14, 1 << 10)   # its backward: ~1 min at 1K
    except Exception as e:
        print(f"  (transformers' MambaMixer not available: {type(e).__name__}: {e})")
    return c


def peak_memory(fn, T, backward):
    """Peak bytes allocated during one call, from the profiler's memory events."""
    x = torch.randn(1, T, D_MODEL, requires_grad=backward)
    with torch.profiler.profile(profile_memory=True) as prof:
        out = fn(x)
        if backward:
            out.sum().backward()
        del out
    cur = peak = 0        # self_ (not inclusive) usage: each allocation and free counted once
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage or 0
        peak = max(peak, cur)
    return peak


def main(argv=None):
    args = parse_args(__doc__, argv)
    lengths, repeats, budget = ([256, 512], 1, 2.0) if args.quick else ([1024, 4096, 16384], 3, 40.0)
    cs = cases()
    rows = run_cases(cs, lengths, repeats, budget)
    mem = {}
    Tm = 4096 if not args.quick else 512
    for name, (_, fn, _, max_b) in cs.items():
        mem[name] = {"fwd": peak_memory(lambda x: fn(x), Tm, False),
                     "fwdbwd": peak_memory(lambda x: fn(x), Tm, True) if Tm <= max_b else None}
        print(f"  peak memory at T={Tm}: {name}: fwd {mem[name]['fwd'] / 2**20:.0f} MiB, fwd+bwd "
              f"{(mem[name]['fwdbwd'] or 0) / 2**20:.0f} MiB", flush=True)
    tg = []
    peers = [n for n in cs if n != "Mamba (subquad)"]
    for T in lengths[-2:]:
        for key in ("fwd", "fwdbwd"):
            rs = {n: ratio(rows, T, "Mamba (subquad)", n, key) for n in peers}
            rs = {n: r for n, r in rs.items() if r is not None}
            if rs:
                n, r = min(rs.items(), key=lambda kv: kv[1])      # against the fastest peer
                tg.append({"what": f"Mamba vs the fastest peer ({n}), {key}, T={T:,}", "value": f"{r:.1f}x",
                           "target": ">= 3x", "met": r >= 3})
    md = speed_tables(rows, "Mamba block, d_model 512, d_state 16, expand 2, B=1, float32")
    md += [f"**Peak memory** at T={Tm:,} (torch profiler, bytes allocated during the call)", "",
           "| impl | forward | forward + backward |", "|---|---|---|"]
    md += [f"| {n} | {m['fwd'] / 2**20:.0f} MiB | " + (f"{m['fwdbwd'] / 2**20:.0f} MiB" if m["fwdbwd"] else "—") + " |"
           for n, m in mem.items()]
    md += ["", "**Targets (this run)**", ""] + target_lines(tg)
    suffix = args.suffix
    (args.out / f"mamba{suffix}.json").write_text(json.dumps({"rows": rows, "memory": mem, "targets": tg}, indent=2))
    (args.out / f"mamba{suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
