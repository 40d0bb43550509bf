"""Linear attention against softmax attention and the peers, on this machine.

Forward and forward+backward, B=1, H=8, K=V=64, float32, 2 threads, of:
  subquad linear_attention chunk / recurrent / parallel (unnormalised, as the peers),
  subquad chunk normalised, the textbook cumsum formulation (the seeds' code),
  causal softmax through SDPA, flash-linear-attention's naive_chunk_linear_attn,
  fast-transformers' compiled causal_dot_product;
then decode time per token at contexts 1K..64K: recurrent linear attention
against softmax with a KV cache. Sizes that would not fit or take too long are
skipped and marked "skip". Writes results/linear_attention.{json,md,png}.

    python benchmarks/bench_linear_attention.py            # ~10 minutes
    python benchmarks/bench_linear_attention.py --quick    # seconds (smoke test)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (OUT, fla_file, fmt_ms, matmul_gflops, ratio, run_cases, speed_tables,  # noqa: E402
                               target_lines, timeit)
from subquad.ops import KVCache, linear_attention  # noqa: E402
from subquad.ops.linear import linear_attention_step  # noqa: E402
from subquad.ops.softmax import softmax_attention_step  # noqa: E402

H, K, V = 8, 64, 64


def cumsum_linear_attention(q, k, v):
    """The textbook formulation (the seeds' code): a (B, T, H, K, V) tensor of outer products."""
    kv = torch.cumsum(torch.einsum("bthk,bthv->bthkv", k, v), dim=1)
    return torch.einsum("bthk,bthkv->bthv", q * K**-0.5, kv)


def sdpa_causal(q, k, v):  # inputs pre-transposed to (B, H, T, D), SDPA's layout
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def useful_flops(T, C):
    """Causal half of the intra-chunk products + Q S + K^T V, per head: T (C (K + V) + 4 K V)."""
    return H * T * (C * (K + V) + 4 * K * V)


def build(peers):
    """name -> (make_inputs(T), fn(*inputs), max T forward, max T fwd+bwd)."""
    def bthd(T):
        return [torch.rand(1, T, H, K), torch.rand(1, T, H, K), torch.randn(1, T, H, V)]

    def bhtd(T):
        return [x.transpose(1, 2).contiguous() for x in bthd(T)]

    cases = {
        "chunk (subquad)": (bthd, lambda q, k, v: linear_attention(q, k, v, normalize=False, mode="chunk")[0], 1 << 16, 1 << 16),
        "chunk normalised": (bthd, lambda q, k, v: linear_attention(q, k, v, normalize=True, mode="chunk")[0], 1 << 16, 1 << 16),
        "recurrent": (bthd, lambda q, k, v: linear_attention(q, k, v, normalize=False, mode="recurrent")[0], 1 << 14, 1 << 11),
        "parallel": (bthd, lambda q, k, v: linear_attention(q, k, v, normalize=False, mode="parallel")[0], 1 << 13, 1 << 12),
        "textbook cumsum": (bthd, cumsum_linear_attention, 1 << 13, 1 << 12),
        "softmax SDPA": (bhtd, sdpa_causal, 1 << 15, 1 << 14),
    }
    if peers.get("fla"):
        fn = peers["fla"].naive_chunk_linear_attn
        cases["fla naive_chunk"] = (bthd, lambda q, k, v: fn(q, k, v, normalize=False), 1 << 16, 1 << 14)
    if peers.get("ft"):
        cdp = peers["ft"]
        cases["fast-transformers C++"] = (bhtd, lambda q, k, v: cdp(q * K**-0.5, k, v), 1 << 16, 1 << 16)
    return cases


def load_peers():
    peers = {"fla": fla_file("ops/linear/naive.py")}
    try:
        from fast_transformers.causal_product import causal_dot_product
        peers["ft"] = causal_dot_product
    except Exception as e:
        print(f"  (fast-transformers not available: {type(e).__name__}; `make bench-deps` builds it)")
        peers["ft"] = None
    return peers


def run_speed(lengths, repeats, budget):
    peers = load_peers()
    return run_cases(build(peers), lengths, repeats, budget), {k: v is not None for k, v in peers.items()}


@torch.no_grad()
def run_decode(contexts, steps):
    rows = []
    g = torch.Generator().manual_seed(0)
    for L in contexts:
        S = torch.randn(1, H, K, V, generator=g)
        z = torch.rand(1, H, K, generator=g) * L
        q1, k1, v1 = (torch.rand(1, H, K, generator=g) for _ in range(3))
        t_lin = timeit(lambda: linear_attention_step(q1, k1, v1, (S, z)), steps)  # normalised; a new state each step
        cache = KVCache(torch.randn(1, L, H, K, generator=g), torch.randn(1, L, H, V, generator=g))
        cache.append(torch.randn(1, 1, H, K), torch.randn(1, 1, H, V))  # room to grow: amortised appends
        qt, kt, vt = torch.randn(1, H, K), torch.randn(1, H, K), torch.randn(1, H, V)

        def soft_step():
            softmax_attention_step(qt, kt, vt, cache, scale=K**-0.5)
            cache._len -= 1; cache.seen -= 1  # keep the context at L: measure, don't grow
        t_soft = timeit(soft_step, steps)
        rows.append({"context": L, "linear_recurrent_s": t_lin, "softmax_kv_cache_s": t_soft,
                     "linear_state_bytes": S.nbytes, "kv_cache_bytes": 2 * L * H * K * 4})
        print(f"  decode at {L:>6}: linear {fmt_ms(t_lin):>8}  softmax+KV cache {fmt_ms(t_soft):>8}", flush=True)
    return rows


def markdown(res) -> str:
    out = [f"fp32 matmul 2048²: **{res['matmul_gflops']:.0f} GFLOP/s** in this run.", ""]
    out += speed_tables(res["speed"], "B=1, H=8, K=V=64, float32")
    out += ["**Chunk efficiency** (useful FLOPs: causal half of the intra-chunk products, Q S and K^T V)", "",
            "| T | chunk fwd | useful GFLOP/s | of fp32 matmul rate |", "|---|---|---|---|"]
    for e in res["efficiency"]:
        out.append(f"| {e['T']:,} | {fmt_ms(e['fwd'])} | {e['gflops']:.0f} | {e['fraction']:.0%} |")
    out += ["", "**Decode, time per token** (one token against a context of L)", "",
            "| context | linear recurrent | softmax + KV cache | state bytes | KV cache bytes |", "|---|---|---|---|---|"]
    for d in res["decode"]:
        out.append(f"| {d['context']:,} | {fmt_ms(d['linear_recurrent_s'])} | {fmt_ms(d['softmax_kv_cache_s'])} | "
                   f"{d['linear_state_bytes']:,} | {d['kv_cache_bytes']:,} |")
    out += ["", "**Targets (ratios in this run)**", ""] + target_lines(res["targets"])
    return "\n".join(out)


def targets(res):
    rows = res["speed"]
    out = []

    def add(what, value, target, ok):
        if value is not None:
            out.append({"what": what, "value": f"{value:.1f}x", "target": target, "met": bool(ok(value))})

    def r(T, a, b, key):
        return ratio(rows, T, a, b, key)

    ch = "chunk (subquad)"
    add("chunk fwd vs SDPA at T=16,384", r(16384, ch, "softmax SDPA", "fwd"), ">= 40x", lambda x: x >= 40)
    add("chunk fwd vs fla naive_chunk at T=16,384", r(16384, ch, "fla naive_chunk", "fwd"), ">= 5x", lambda x: x >= 5)
    add("chunk fwd vs fast-transformers at T=16,384", r(16384, ch, "fast-transformers C++", "fwd"), ">= 1.5x", lambda x: x >= 1.5)
    add("chunk fwd+bwd vs SDPA at T=8,192", r(8192, ch, "softmax SDPA", "fwdbwd"), ">= 15x", lambda x: x >= 15)
    small = [T for T in sorted({row["T"] for row in rows}) if T >= 256]
    for key in ("fwd", "fwdbwd"):
        rs = [r(T, ch, "softmax SDPA", key) for T in small]
        rs = [x for x in rs if x is not None]
        if rs:
            out.append({"what": f"chunk beats SDPA ({key}) at every T >= 256 measured", "value": f"min {min(rs):.1f}x",
                        "target": "> 1x", "met": min(rs) > 1})
    for e in res["efficiency"]:
        if e["T"] >= 8192:
            out.append({"what": f"chunk useful GFLOP/s at T={e['T']:,}", "value": f"{e['fraction']:.0%} of matmul rate",
                        "target": ">= 60%", "met": e["fraction"] >= 0.6})
    d = res["decode"]
    if d:
        lin = [x["linear_recurrent_s"] for x in d]
        soft = [x["softmax_kv_cache_s"] for x in d]
        out.append({"what": "recurrent decode max/min over contexts", "value": f"{max(lin) / min(lin):.2f}",
                    "target": "<= 1.2", "met": max(lin) / min(lin) <= 1.2})
        out.append({"what": "softmax decode last/first context", "value": f"{soft[-1] / soft[0]:.1f}x",
                    "target": "grows", "met": soft[-1] / soft[0] > 2})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: a smoke test")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    if args.quick:
        lengths, contexts, repeats, budget, steps = [256, 512], [1024, 2048], 1, 2.0, 3
    else:
        lengths, contexts, repeats, budget, steps = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536], \
            [1024, 4096, 16384, 65536], 5, 25.0, 200
    print("matmul rate ...", flush=True)
    res = {"matmul_gflops": matmul_gflops(repeats=3 if args.quick else 10)}
    print(f"  {res['matmul_gflops']:.0f} GFLOP/s\nspeed ...", flush=True)
    res["speed"], res["peers"] = run_speed(lengths, repeats, budget)
    res["efficiency"] = [{"T": r["T"], "fwd": r["fwd"], "gflops": useful_flops(r["T"], 64) / r["fwd"] / 1e9,
                          "fraction": useful_flops(r["T"], 64) / r["fwd"] / 1e9 / res["matmul_gflops"]}
                         for r in res["speed"] if r["impl"] == "chunk (subquad)" and r["fwd"]]
    print("decode ...", flush=True)
    res["decode"] = run_decode(contexts, steps)
    res["targets"] = targets(res)
    res["env"] = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads()}
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (args.out / f"linear_attention{suffix}.json").write_text(json.dumps(res, indent=2))
    md = markdown(res)
    (args.out / f"linear_attention{suffix}.md").write_text(md + "\n")
    plot(res, args.out / f"linear_attention{suffix}.png")
    print("\n" + md)


def plot(res, path):
    from subquad.bench import plots  # noqa: F401  (sets the Agg backend)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, key, title in ((axes[0], "fwd", "forward"), (axes[1], "fwdbwd", "forward + backward")):
        impls = list(dict.fromkeys(r["impl"] for r in res["speed"]))
        for i in impls:
            pts = [(r["T"], r[key]) for r in res["speed"] if r["impl"] == i and r[key]]
            if pts:
                ax.loglog(*zip(*pts), "o-", label=i)
        ax.set_xlabel("T"); ax.set_ylabel("seconds"); ax.set_title(f"{title}, B=1 H=8 K=V=64 fp32")
        ax.grid(True, which="both", alpha=0.3); ax.legend(fontsize=7)
    d = res["decode"]
    axes[2].loglog([x["context"] for x in d], [x["linear_recurrent_s"] for x in d], "s-", color="tab:red", label="linear (state)")
    axes[2].loglog([x["context"] for x in d], [x["softmax_kv_cache_s"] for x in d], "o-", color="tab:blue", label="softmax (KV cache)")
    axes[2].set_xlabel("context"); axes[2].set_ylabel("seconds per token"); axes[2].set_title("decode")
    axes[2].grid(True, which="both", alpha=0.3); axes[2].legend()
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)


if __name__ == "__main__":
    main()
