"""Language models per mixer: training throughput of micro, and generation cost against context.

1. Training tokens/s of micro (d_model 128, 4 layers, 4 heads of 32, context 256,
   batch 16, AdamW) for every mixer and the Jamba-like hybrid.
2. Generation: time per token and state bytes at contexts 1K .. 64K per mixer.
   The state at context L is built directly (a KV cache of L random keys and
   values for softmax layers; the fixed-size state for the rest) - decode cost
   depends on the state's size, not its values - then 32 tokens are decoded
   from it, the contexts interleaved token by token, and the median token time
   is reported.

Writes results/models.{json,md,png}.

    python benchmarks/bench_models.py            # ~5 minutes
    python benchmarks/bench_models.py --quick
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import parse_args, fmt_ms, target_lines  # noqa: E402
from subquad.models import LanguageModel, jamba, micro  # noqa: E402
from subquad.ops import KVCache  # noqa: E402

MIXERS = ["softmax", "swa", "linear", "performer", "taylor", "retention", "gla", "mamba2", "deltanet",
          "gated_deltanet"]


def config(name):
    return jamba() if name == "jamba (hybrid)" else micro(pattern=name)


def train_rate(name, steps, batch=16):
    torch.manual_seed(0)
    model = LanguageModel(config(name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    T = model.config.context_length
    x = torch.randint(0, model.config.vocab_size, (batch, T + 1))

    def step():
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, model.config.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    step(); step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * T * steps / (time.perf_counter() - t)


def state_at(model, L):
    """The decoding state a model holds after L tokens (random values, the right sizes)."""
    g = torch.Generator().manual_seed(0)
    state = []
    for block in model.blocks:
        m = block.mixer
        if hasattr(m, "n_kv_heads"):     # softmax attention: a KV cache (the last W with a window)
            n = L if m.window is None else min(L, m.window)
            k = torch.randn(1, n, m.n_kv_heads, m.head_dim, generator=g)
            state.append(KVCache(k, torch.randn_like(k), window=m.window, seen=L))
        else:
            s = m.empty_state(1)
            for t in s.values():
                if t.is_floating_point():
                    t.normal_(generator=g).mul_(0.1)
            state.append(s)
    return state


@torch.no_grad()
def decode_rates(name, contexts, tokens=32):
    """Median time per token and state bytes at each context. The contexts are interleaved token by
    token, so all of them decode under the same conditions of this shared machine (one context after
    another, a slowdown mid-run read as growth with context)."""
    torch.manual_seed(0)
    model = LanguageModel(config(name)).eval()
    tok = torch.tensor([[1]])
    states, nbytes = {}, {}
    for L in contexts:
        state = state_at(model, L)
        nbytes[L] = model.state_bytes(state)
        _, states[L] = model.prefill(tok, state)          # one warm-up token
    times = {L: [] for L in contexts}
    for _ in range(tokens):                                # the median token: robust to hiccups
        for L in contexts:
            t = time.perf_counter()
            _, states[L] = model.prefill(tok, states[L])
            times[L].append(time.perf_counter() - t)
    return {L: {"s": sorted(times[L])[tokens // 2], "bytes": nbytes[L]} for L in contexts}


def main(argv=None):
    args = parse_args(__doc__, argv)
    names = MIXERS + ["jamba (hybrid)"]
    steps, contexts = (2, [1024, 4096]) if args.quick else (10, [1024, 4096, 16384, 65536])
    res = {"train": {}, "decode": {}}
    print("training throughput, micro, batch 16 x 256 ...", flush=True)
    for n in names:
        res["train"][n] = train_rate(n, steps)
        print(f"  {n:<16} {res['train'][n]:>9,.0f} tokens/s", flush=True)
    print("decode time per token against context ...", flush=True)
    for n in names:
        res["decode"][n] = decode_rates(n, contexts)
        for L, r in res["decode"][n].items():
            print(f"  {n:<16} L={L:>6}: {fmt_ms(r['s']):>9}/token, state {r['bytes']:>12,} B", flush=True)

    soft = res["train"]["softmax"]
    tg = [{"what": f"{n} training tokens/s vs softmax (micro, context 256)", "value": f"{res['train'][n] / soft:.2f}x",
           "target": ">= 0.9x", "met": res["train"][n] / soft >= 0.9} for n in MIXERS if n != "softmax"]
    for n in names:
        ts = [res["decode"][n][L]["s"] for L in contexts]
        if n in ("softmax", "jamba (hybrid)"):
            tg.append({"what": f"{n} decode time grows with context", "value": f"{ts[-1] / ts[0]:.1f}x from "
                       f"{contexts[0]:,} to {contexts[-1]:,}", "target": "grows", "met": ts[-1] / ts[0] > 1.5})
        else:
            tg.append({"what": f"{n} decode max/min over {contexts[0]:,}..{contexts[-1]:,}",
                       "value": f"{max(ts) / min(ts):.2f}", "target": "<= 1.2", "met": max(ts) / min(ts) <= 1.2})
    res["targets"] = tg

    md = ["**Training throughput** (micro: d_model 128, 4 layers, 4 heads of 32, context 256, batch 16, AdamW, "
          "float32)", "", "| mixer | tokens/s | vs softmax |", "|---|---|---|"]
    md += [f"| {n} | {r:,.0f} | {r / soft:.2f}x |" for n, r in res["train"].items()]
    md += ["", "**Generation: time per token / state bytes** (micro's shape, batch 1)", "",
           "| mixer | " + " | ".join(f"L={L:,}" for L in contexts) + " |", "|---|" + "---|" * len(contexts)]
    for n in names:
        md.append(f"| {n} | " + " | ".join(f"{fmt_ms(res['decode'][n][L]['s'])} / {res['decode'][n][L]['bytes']:,} B"
                                          for L in contexts) + " |")
    md += ["", "**Targets (this run)**", ""] + target_lines(tg)
    suffix = args.suffix
    (args.out / f"models{suffix}.json").write_text(json.dumps(res, indent=2, default=str))
    (args.out / f"models{suffix}.md").write_text("\n".join(md) + "\n")
    plot(res, contexts, args.out / f"models{suffix}.png")
    print("\n" + "\n".join(md))


def plot(res, contexts, path):
    from subquad.bench import plots  # noqa: F401  (Agg backend)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for n, d in res["decode"].items():
        axes[0].loglog(contexts, [d[L]["s"] for L in contexts], "o-", label=n)
        axes[1].loglog(contexts, [d[L]["bytes"] for L in contexts], "o-", label=n)
    axes[0].set_title("decode: seconds per token"); axes[1].set_title("decode state: bytes")
    for ax in axes:
        ax.set_xlabel("context (tokens)"); ax.grid(True, which="both", alpha=0.3); ax.legend(fontsize=7)
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)


if __name__ == "__main__":
    main()
