"""Training at length: tokens/s and model-FLOPs utilisation (MFU) per mixer.

A 4-layer model (heads of 64, SwiGLU MLPs, vocab 4,096) of each mixer usable in a pattern, plus the
jamba preset's pattern, trains at batch 1: forward + backward + AdamW step, the median of --steps timed
steps after one warm-up. MFU = useful FLOPs per token (``LanguageModel.flops_per_token``: 6 x matmul
weights plus each mixer's own sequence mixing, as its recurrent or exact form counts it) x tokens/s /
this machine's float32 matmul rate, measured in the same run (bf16 rows divide by the bf16 rate).

    python benchmarks/bench_training.py                                # the full grid: hours on 2 cores
    python benchmarks/bench_training.py --lengths 8192 --d-models 256  # the issue's headline cell, minutes
    python benchmarks/bench_training.py --quick                        # tiny, seconds (tests)
Options: --mixers a,b  --lengths 2048,8192,32768  --d-models 256,512  --dtypes float32,bf16
--compile (adds torch.compile rows)  --threads 1 (default 2)  --merge (add to the rows already in
results/training.json, replacing those of the same mixer, size, dtype, compile and threads)  --profile (one
profiled step per row: where its time goes, results/training_profile.md). Writes
results/training.{json,md,png}; every row keeps its threads and the matmul rates of its own run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402
from subquad.layers import MIXERS  # noqa: E402
from subquad.models import LanguageModel, ModelConfig  # noqa: E402
from subquad.models.presets import jamba  # noqa: E402

JAMBA = jamba().pattern


def bf16_gflops(n=1024, repeats=5):
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n ** 3 * repeats / (time.perf_counter() - t) / 1e9


def model_for(name, d_model, T, vocab):
    pattern = JAMBA if name == "jamba" else name
    n_layers = 8 if name == "jamba" else 4
    cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=max(1, d_model // 64),
                      n_kv_heads=max(1, d_model // 256) if name == "jamba" else None, pattern=pattern,
                      context_length=T)
    return LanguageModel(cfg)


def measure(name, d_model, T, dtype, compiled, steps, vocab, profile=False):
    torch.manual_seed(0)
    model = model_for(name, d_model, T, vocab)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, vocab, (1, T + 1))
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = run(x, targets=y)            # the trainer's loss: head + cross-entropy in chunks
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()                                                   # warm-up (and compilation)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    out = {"tokens_s": T / statistics.median(times), "flops_per_token": model.flops_per_token(T),
           "parameters": model.num_parameters()}
    if profile:
        out["profile"] = profile_step(step)
    return out


def profile_step(step, top=8):
    """One more step under torch.profiler: the ``top`` aten ops by own time, as {op: (ms, calls)}, and
    the step's total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ev = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
    ev.sort(key=lambda e: -e.self_cpu_time_total)
    return {"total_ms": total, "ops": {e.key[6:]: (e.self_cpu_time_total / 1e3, e.count) for e in ev[:top]}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--mixers", default=",".join(sorted(MIXERS)) + ",jamba")
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--d-models", default="256,512")
    p.add_argument("--dtypes", default="float32,bf16")
    p.add_argument("--compile", action="store_true", help="also torch.compile rows")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--merge", action="store_true", help="add to the rows already in the output")
    p.add_argument("--profile", action="store_true", help="also profile one step per row")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        _run(args)
    finally:
        torch.set_num_threads(threads)


KEY = ("mixer", "d_model", "T", "dtype", "compiled", "threads")


def _run(args):
    args.out.mkdir(parents=True, exist_ok=True)
    mixers = args.mixers.split(",")
    lengths = [128, 256] if args.quick else [int(v) for v in args.lengths.split(",")]
    d_models = [64] if args.quick else [int(v) for v in args.d_models.split(",")]
    vocab = 256 if args.quick else 4096
    steps = 1 if args.quick else args.steps
    machine = machine_line()
    # each dtype's matmul rate, measured only for the dtypes asked for (bf16 without AVX512-BF16 takes ~13 s)
    dtypes = args.dtypes.split(",")
    rate = {"float32": matmul_gflops(512 if args.quick else 2048) * 1e9}
    if "bf16" in dtypes:
        rate["bf16"] = bf16_gflops(256 if args.quick else 1024) * 1e9
    bf16_line = f"; bf16 matmul {rate['bf16'] / 1e9:.0f} GFLOP/s" if "bf16" in rate else ""
    print(machine + bf16_line, flush=True)
    suffix = "_quick" if args.quick else ""
    old = args.out / f"training{suffix}.json"
    rows = json.loads(old.read_text())["rows"] if args.merge and old.exists() else []
    for r in rows:
        r.setdefault("threads", 2)
    for d in d_models:
        for T in lengths:
            for dtype in dtypes:
                for compiled in ([False, True] if args.compile else [False]):
                    for name in mixers:
                        try:
                            r = measure(name, d, T, dtype, compiled, steps, vocab, args.profile)
                        except Exception as e:             # a row that fails is reported, not hidden
                            r = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                        r.update({"mixer": name, "d_model": d, "T": T, "dtype": dtype, "compiled": compiled,
                                  "threads": args.threads, "matmul_gflops": rate[dtype] / 1e9})
                        if "tokens_s" in r:
                            r["mfu"] = r["tokens_s"] * r["flops_per_token"] / rate[dtype]
                        rows = [x for x in rows if tuple(x.get(k) for k in KEY) != tuple(r[k] for k in KEY)] + [r]
                        print(json.dumps(r), flush=True)
    rows.sort(key=lambda r: (r["threads"], r["d_model"], r["T"], r["dtype"], r["compiled"]))
    md = [f"{machine} (the last run){bf16_line}. 4 layers (jamba: its preset's 8), "
          f"heads of 64, SwiGLU MLPs, vocab {vocab}, batch 1; forward + backward + AdamW, median of {steps} steps "
          "after a warm-up. MFU divides by the matmul rate (float32 or bf16) measured in each row's own run.", "",
          "| threads | d_model | T | dtype | compiled | mixer | tokens/s | x softmax | MFU |",
          "|---:|---:|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['threads']} | {r['d_model']} | {r['T']:,} | {r['dtype']} | {r['compiled']} | {r['mixer']} | "
        if "error" in r:
            md.append(head + f"{r['error']} | | |")
            continue
        soft = next((s for s in rows if s["mixer"] == "softmax" and "tokens_s" in s and
                     all(s[k] == r[k] for k in KEY[1:])), None)
        ratio = f"{r['tokens_s'] / soft['tokens_s']:.2f}" if soft else ""
        md.append(head + f"{r['tokens_s']:,.0f} | {ratio} | {r['mfu']:.0%} |")
    prof = [r for r in rows if "profile" in r]
    if prof:
        lines = ["Where one training step's time goes (torch.profiler, own time of the top aten ops; "
                 "ms and calls).", "", "| threads | d_model | T | dtype | mixer | step ms | top ops (ms, calls) |",
                 "|---:|---:|---:|---|---|---:|---|"]
        for r in prof:
            ops_ = ", ".join(f"{k} {ms:.0f} ({n})" for k, (ms, n) in r["profile"]["ops"].items())
            lines.append(f"| {r['threads']} | {r['d_model']} | {r['T']:,} | {r['dtype']} | {r['mixer']} | "
                         f"{r['profile']['total_ms']:.0f} | {ops_} |")
        (args.out / f"training_profile{suffix}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"training{suffix}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    (args.out / f"training{suffix}.md").write_text("\n".join(md) + "\n")
    plot(rows, args.out / f"training{suffix}.png")
    print("\n" + "\n".join(md))


def plot(rows, path):
    """tokens/s against T per mixer, log-log, one panel per (d_model, dtype, compiled)."""
    from subquad.bench import plots  # noqa: F401  (Agg backend)
    import matplotlib.pyplot as plt

    panels = sorted({(r["d_model"], r["dtype"], r["compiled"], r.get("threads", 2)) for r in rows if "tokens_s" in r})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.6), squeeze=False)
    for ax, key in zip(axes[0], panels):
        for name in dict.fromkeys(r["mixer"] for r in rows):
            pts = sorted((r["T"], r["tokens_s"]) for r in rows if "tokens_s" in r and r["mixer"] == name
                         and (r["d_model"], r["dtype"], r["compiled"], r.get("threads", 2)) == key)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("training tokens/s")
        ax.set_title(f"d_model {key[0]}, {key[1]}{', compiled' if key[2] else ''}, {key[3]} threads")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
