"""Decayed / gated linear attention and the Mamba-2 block against their recurrent forms and the peers.

Ops at B=1, H=8, K=V=64, float32, 2 threads, T = 1K, 4K, 16K: subquad's retention,
simple_gla and gla (chunk and recurrent) against flash-linear-attention's pure-PyTorch
references (naive_chunk_simple_gla; naive_recurrent_gla, as it has no chunked one).
The Mamba-2 block (d_model 512, d_state 64, headdim 64, expand 2) against transformers'
Mamba2Mixer torch path. Writes results/gla.{json,md}.

    python benchmarks/bench_gla.py            # ~10 minutes
    python benchmarks/bench_gla.py --quick    # seconds
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import parse_args, fla_file, matmul_gflops, ratio, run_cases, speed_tables, target_lines  # noqa: E402
from subquad.layers import Mamba2  # noqa: E402
from subquad.ops import gla, retention, simple_gla  # noqa: E402

H, K, V = 8, 64, 64


def op_cases(peers):
    def inputs(gshape):
        def make(T):
            q, k = torch.randn(1, T, H, K) * 0.5, torch.randn(1, T, H, K) * 0.5
            v = torch.randn(1, T, H, V)
            shape = {"H": (H,), "BTH": (1, T, H), "BTHK": (1, T, H, K)}[gshape]
            g = torch.nn.functional.logsigmoid(torch.randn(shape) + 3)   # decays near 1, as trained models have
            return [q, k, v, g]
        return make

    big, mid = 1 << 14, 1 << 12
    cases = {
        "retention chunk": (inputs("H"), lambda q, k, v, g: retention(q, k, v, g)[0], big, big),
        "retention recurrent": (inputs("H"), lambda q, k, v, g: retention(q, k, v, g, mode="recurrent")[0], mid, 1024),
        "simple_gla chunk": (inputs("BTH"), lambda q, k, v, g: simple_gla(q, k, v, g)[0], big, big),
        "simple_gla recurrent": (inputs("BTH"), lambda q, k, v, g: simple_gla(q, k, v, g, mode="recurrent")[0], mid, 1024),
        "gla chunk": (inputs("BTHK"), lambda q, k, v, g: gla(q, k, v, g)[0], big, big),
        "gla recurrent": (inputs("BTHK"), lambda q, k, v, g: gla(q, k, v, g, mode="recurrent")[0], mid, 1024),
    }
    if peers.get("sgla"):
        sg = peers["sgla"].naive_chunk_simple_gla
        cases["fla naive_chunk_simple_gla (retention)"] = (
            inputs("H"), lambda q, k, v, g: sg(q, k, v, g.view(1, 1, H).expand(1, q.shape[1], H))[0], big, big)
        cases["fla naive_chunk_simple_gla"] = (inputs("BTH"), lambda q, k, v, g: sg(q, k, v, g)[0], big, big)
    if peers.get("gla"):
        rg = peers["gla"].naive_recurrent_gla
        cases["fla naive_recurrent_gla"] = (inputs("BTHK"), lambda q, k, v, g: rg(q, k, v, g)[0], big, mid)
    return cases


PROJ = "in_proj + out_proj alone (both blocks pay these)"


def mamba_cases():
    d_model, d_state, headdim = 512, 64, 64
    torch.manual_seed(0)
    ours = Mamba2(d_model, d_state=d_state, head_dim=headdim)

    def make(T):
        return [torch.randn(1, T, d_model)]

    def projections(x):
        """Only the block's two projections, in the pieces the block runs: the floor both blocks pay."""
        return torch.cat([ours.out_proj(ours.in_proj(p)[..., :ours.d_inner]) for p in x.split(ours.piece_size, 1)], 1)

    cases = {"Mamba2 block (subquad)": (make, lambda x: ours(x)[0], 1 << 14, 1 << 14),
             PROJ: (make, projections, 1 << 14, 1 << 14)}
    try:
        from transformers import Mamba2Config
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

        cfg = Mamba2Config(hidden_size=d_model, state_size=d_state, head_dim=headdim, expand=2,
                           num_heads=2 * d_model // headdim, n_groups=1, num_hidden_layers=1)
        theirs = Mamba2Mixer(cfg, layer_idx=0)
        cases["transformers Mamba2Mixer (torch path)"] = (make, lambda x: theirs(x), 1 << 14, 1 << 14)
    except Exception as e:
        print(f"  (transformers' Mamba2Mixer not available: {type(e).__name__}: {e})")
    return cases


def main(argv=None):
    args = parse_args(__doc__, argv)
    lengths, repeats, budget = ([256, 512], 1, 2.0) if args.quick else ([1024, 4096, 16384], 3, 30.0)
    peers = {"sgla": fla_file("ops/simple_gla/naive.py"), "gla": fla_file("ops/decay/naive.py")}
    res = {"matmul_gflops": matmul_gflops(repeats=3)}
    print("ops ...", flush=True)
    res["ops"] = run_cases(op_cases(peers), lengths, repeats, budget)
    print("Mamba-2 block ...", flush=True)
    res["mamba2"] = run_cases(mamba_cases(), lengths, repeats, budget)

    T = max(lengths)
    tg = []
    for key in ("fwd", "fwdbwd"):
        for ours, theirs, target in (
            ("retention chunk", "fla naive_chunk_simple_gla (retention)", 2.5),
            ("simple_gla chunk", "fla naive_chunk_simple_gla", 2.5),
            ("gla chunk", "fla naive_recurrent_gla", 5.0),
        ):
            r = ratio(res["ops"], T, ours, theirs, key)
            if r is not None:
                tg.append({"what": f"{ours} vs {theirs}, {key}, T={T:,}", "value": f"{r:.1f}x",
                           "target": f">= {target}x", "met": r >= target})
        r = ratio(res["mamba2"], T, "Mamba2 block (subquad)", "transformers Mamba2Mixer (torch path)", key)
        if r is not None:
            tg.append({"what": f"Mamba2 block vs transformers Mamba2Mixer, {key}, T={T:,}", "value": f"{r:.1f}x",
                       "target": ">= 3x", "met": r >= 3})
    res["targets"] = tg
    bound = [f"- with everything but the two projections free, the Mamba-2 block could be at most "
             f"{r:.1f}x transformers' {key} at T={T:,} in this run"
             for key in ("fwd", "fwdbwd")
             if (r := ratio(res["mamba2"], T, PROJ, "transformers Mamba2Mixer (torch path)", key)) is not None]
    md = [f"fp32 matmul 2048²: **{res['matmul_gflops']:.0f} GFLOP/s** in this run.", ""]
    md += speed_tables(res["ops"], "ops, B=1, H=8, K=V=64, float32")
    md += speed_tables(res["mamba2"], "Mamba-2 block, B=1, d_model 512, d_state 64, headdim 64, expand 2, float32")
    md += ["**Targets (ratios in this run)**", ""] + target_lines(tg) + bound
    suffix = args.suffix
    (args.out / f"gla{suffix}.json").write_text(json.dumps(res, indent=2))
    (args.out / f"gla{suffix}.md").write_text("\n".join(md) + "\n")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
