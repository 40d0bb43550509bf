"""Variable-length batches: packed (cu_seqlens) against padded, and what packing changes in training.

Part 1 - every mixer layer (d_model 256, 4 heads, float32, B = 16 sequences with lengths drawn
uniformly from 64-4,096, seed 0): useful tokens/s (real tokens only) of
  packed  - one row of sum(L) tokens with cu_seqlens,
  padded  - a (16, max L) batch right-padded (the padding computed and thrown away),
  equal   - an unpacked (16, mean L) batch of equal lengths and the same total work,
forward (no gradient) and forward + backward, in interleaved rounds.
Targets: packed >= 1.5x padded for every fixed-state mixer; packed within 10% of equal.

Part 2 - training the micro model (pattern "gla,softmax,gla,softmax") on the stdlib corpus with and
without --pack, same seed and steps: tokens/s and held-out loss, evaluated both packed and as the
concatenated stream.

    python benchmarks/bench_varlen.py            # ~20 minutes
    python benchmarks/bench_varlen.py --quick    # a minute
    python benchmarks/bench_varlen.py --layers-only   # part 1 again, part 2 kept from the last run
Writes results/varlen.{json,md,png}.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_line, parse_args  # noqa: E402
from subquad.layers import build_mixer  # noqa: E402

MIXERS = ["softmax", "swa", "linear", "retention", "gla", "mamba", "mamba2", "deltanet", "gated_deltanet"]
FIXED = [m for m in MIXERS if m != "softmax"]


def lengths(n, lo, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def layer_rows(args):
    n, lo, hi, D = (4, 16, 256, 64) if args.quick else (16, 64, 4096, 256)
    Ls = lengths(n, lo, hi)
    useful = sum(Ls)
    cu = torch.tensor([0] + torch.tensor(Ls).cumsum(0).tolist())
    mean = -(-useful // n)
    rounds = 1 if args.quick else 5
    rows = []
    for name in MIXERS:
        torch.manual_seed(0)
        layer = build_mixer(name, D, 4)
        inputs = {"packed": (torch.randn(1, useful, D), cu), "padded": (torch.randn(n, max(Ls), D), None),
                  "equal": (torch.randn(n, mean, D), None)}
        times = {(k, how): [] for k in inputs for how in ("fwd", "fwdbwd")}
        for _ in range(rounds):
            for how in ("fwd", "fwdbwd"):
                for k, (x, c) in inputs.items():
                    def run(x=x, c=c, how=how):
                        if how == "fwd":
                            with torch.no_grad():
                                layer(x, cu_seqlens=c)
                        else:
                            xx = x.clone().requires_grad_(True)
                            layer(xx, cu_seqlens=c)[0].sum().backward()
                    run()                                          # warm
                    t = time.perf_counter()
                    run()
                    times[(k, how)].append(time.perf_counter() - t)
        for how in ("fwd", "fwdbwd"):
            best = {k: min(times[(k, how)]) for k in inputs}
            rate = {k: useful / best[k] if k != "equal" else n * mean / best[k] for k in inputs}
            rows.append({"mixer": name, "how": how, **{f"{k}_tok_s": round(r) for k, r in rate.items()},
                         "packed_vs_padded": rate["packed"] / rate["padded"],
                         "packed_vs_equal": rate["packed"] / rate["equal"]})
            print(f"  {name:<15} {how:<6} packed {rate['packed']:>9,.0f}  padded {rate['padded']:>9,.0f}  "
                  f"equal {rate['equal']:>9,.0f} tok/s  packed/padded {rows[-1]['packed_vs_padded']:.2f}  "
                  f"packed/equal {rows[-1]['packed_vs_equal']:.2f}", flush=True)
    return {"lengths": Ls, "d_model": D, "rows": rows}


def training(args):
    from subquad.data.dataset import prepare
    from subquad.models import micro
    from subquad.train import TrainConfig, Trainer
    from subquad.train.trainer import evaluate

    steps = 12 if args.quick else 400
    data = prepare(None, vocab_size=4096, log=lambda m: None)
    out = {}
    for pack in (False, True):
        torch.manual_seed(0)
        from subquad.models import LanguageModel
        cfg = micro(vocab_size=4096, pattern="gla,softmax,gla,softmax")
        model = LanguageModel(cfg)
        tcfg = TrainConfig(steps=steps, batch_size=16, seed=0, eval_every=steps, ckpt_every=steps,
                           warmup=min(50, steps // 10 + 1), pack=pack)
        with tempfile.TemporaryDirectory() as d:
            tr = Trainer(model, data, tcfg, Path(d) / "run", progress=False)
            t = time.perf_counter()
            tr.fit()
            secs = time.perf_counter() - t
        evals = {how: evaluate(model, data.heldout, cfg.context_length, 16, 16, eot=data.eot if how == "packed"
                               else None) for how in ("packed", "stream")}
        out["pack" if pack else "stream"] = {"tok_s": steps * 16 * cfg.context_length / secs, "seconds": secs,
                                             "heldout_packed": evals["packed"], "heldout_stream": evals["stream"]}
        print(f"  trained {'packed' if pack else 'stream'}: {out['pack' if pack else 'stream']}", flush=True)
    out["steps"], out["documents"] = steps, data.documents()
    return out


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, how in zip(axes, ("fwd", "fwdbwd")):
        rows = [r for r in res["layers"]["rows"] if r["how"] == how]
        xs = range(len(rows))
        for j, (k, c) in enumerate((("packed", "tab:blue"), ("padded", "tab:red"), ("equal", "tab:gray"))):
            ax.bar([x + (j - 1) * 0.27 for x in xs], [r[f"{k}_tok_s"] for r in rows], 0.27, label=k, color=c)
        ax.set_xticks(list(xs), [r["mixer"] for r in rows], rotation=45, ha="right")
        ax.set_title({"fwd": "forward", "fwdbwd": "forward + backward"}[how])
    axes[0].set_ylabel("useful tokens / s")
    axes[0].legend()
    fig.suptitle("16 sequences of 64-4,096 tokens: packed (cu_seqlens) vs padded vs equal lengths")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--layers-only"]
    args = parse_args(__doc__, argv)
    machine = machine_line()
    print(machine, flush=True)
    res = {"machine": machine, "layers": layer_rows(args)}
    prev = args.out / f"varlen{args.suffix}.json"
    if "--layers-only" in sys.argv and prev.exists():        # keep the training part of the last full run
        res["training"] = json.loads(prev.read_text())["training"]
    else:
        res["training"] = training(args)
    L = res["layers"]
    md = [f"{machine}. Lengths {L['lengths']} (sum {sum(L['lengths']):,}), d_model {L['d_model']}, 4 heads, "
          "float32; useful tokens/s, the best of the rounds.", "",
          "| mixer | pass | packed | padded | equal lengths | packed / padded | packed / equal |",
          "|---|---|---:|---:|---:|---:|---:|"]
    for r in L["rows"]:
        md.append(f"| {r['mixer']} | {r['how']} | {r['packed_tok_s']:,} | {r['padded_tok_s']:,} | "
                  f"{r['equal_tok_s']:,} | {r['packed_vs_padded']:.2f} | {r['packed_vs_equal']:.2f} |")
    fixed = [r for r in L["rows"] if r["mixer"] in FIXED]
    md += ["", f"- packed >= 1.5x padded for every fixed-state mixer: worst {min(r['packed_vs_padded'] for r in fixed):.2f}x"
               f" - **{'met' if all(r['packed_vs_padded'] >= 1.5 for r in fixed) else 'not met'}**",
           f"- packed within 10% of equal lengths: worst {min(r['packed_vs_equal'] for r in L['rows']):.2f} - "
           f"**{'met' if all(r['packed_vs_equal'] >= 0.9 for r in L['rows']) else 'not met'}**", ""]
    tr = res["training"]
    md += [f"Training micro (gla,softmax,gla,softmax), {tr['steps']} steps x 16 x 256 tokens, stdlib corpus "
           f"({tr['documents']:,} documents), seed 0:", "",
           "| training | tokens/s | held-out loss, packed eval | held-out loss, stream eval |", "|---|---:|---:|---:|"]
    for k in ("stream", "pack"):
        t = tr[k]
        md.append(f"| {'--pack' if k == 'pack' else '--no-pack (stream)'} | {t['tok_s']:,.0f} | "
                  f"{t['heldout_packed']:.4f} | {t['heldout_stream']:.4f} |")
    out = args.out
    (out / f"varlen{args.suffix}.json").write_text(json.dumps(res, indent=2))
    (out / f"varlen{args.suffix}.md").write_text("\n".join(md) + "\n")
    plot(res, out / f"varlen{args.suffix}.png")
    print("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
