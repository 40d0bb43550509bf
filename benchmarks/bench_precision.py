"""Training throughput per mixer: eager float32, torch.compile (inductor) float32, bfloat16 autocast.

For every mixer name usable in a pattern and the jamba preset's hybrid pattern: a language model of
micro's shape (d_model 128, 4 layers, heads of 32, SwiGLU) trained with AdamW, tokens/s of the median
step after warm-up (compilation happens in the two warm-up steps and is reported apart, with the
first step's loss against eager's: the same weights and batch). Two settings:

    micro     context 256, batch 16
    long      context 4,096, batch 1 (--context sets it)

No speed target: the point is what each setting costs or gains on this machine, whose bf16 support
(avx512_bf16 / amx_bf16 flags) is printed beside the table.

    python benchmarks/bench_precision.py                  # ~30-40 minutes on 2 cores (inductor compiles C++)
    python benchmarks/bench_precision.py --quick          # two mixers, tiny sizes
    python benchmarks/bench_precision.py --settings micro --mixers linear,mamba2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import OUT, matmul_gflops  # noqa: E402
from subquad.layers import MIXERS  # noqa: E402
from subquad.models import LanguageModel, micro  # noqa: E402
from subquad.models.presets import jamba  # noqa: E402

NAMES = sorted(MIXERS) + ["jamba"]
SETTINGS = {"micro": (256, 16), "long": (4096, 1)}


def cpu_info() -> dict:
    model = platform.processor()
    flags = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("Flags"):
                flags = line
    except OSError:
        pass
    bf16 = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags.split()]
    return {"cpu": model, "bf16_flags": bf16 or ["none"], "torch": torch.__version__,
            "matmul_gflops_fp32": round(matmul_gflops(), 1)}


def build(name, context):
    cfg = jamba(context_length=context) if name == "jamba" else micro(pattern=name, context_length=context)
    torch.manual_seed(0)
    return LanguageModel(cfg)


def rate(name, context, batch, how, steps, warmup):
    """(tokens/s of the median step, seconds of the warm-up steps) for how in eager | compiled | bf16."""
    model = build(name, context)
    run = torch.compile(model) if how == "compiled" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    V = model.config.vocab_size
    x = torch.randint(0, V, (batch, context + 1), generator=torch.Generator().manual_seed(1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "bf16"):
            logits = run(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, V), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    t0 = time.perf_counter()
    first = [step() for _ in range(warmup)][0]          # the first loss: the same weights and batch for every how
    warm = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return batch * context / statistics.median(times), warm, first


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--mixers", default=",".join(NAMES))
    p.add_argument("--settings", default="micro,long")
    p.add_argument("--context", type=int, default=4096, help="context of the long setting")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hows", default="eager,compiled,bf16", help="which columns to measure (eager is needed "
                   "for the ratios)")
    p.add_argument("--append", action="store_true", help="add rows to the existing results file")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    SETTINGS["long"] = (args.context, 1)
    names = args.mixers.split(",")
    settings = args.settings.split(",")
    if args.quick:
        names, settings, args.steps = names[:2] if args.mixers == ",".join(NAMES) else names, ["micro"], 2
        SETTINGS["micro"] = (64, 2)
    info = cpu_info()
    print(f"CPU: {info['cpu']}, bf16 flags: {', '.join(info['bf16_flags'])}, "
          f"fp32 matmul {info['matmul_gflops_fp32']} GFLOP/s, torch {info['torch']}", flush=True)
    rows = []
    prev = args.out / f"precision{'_quick' if args.quick else ''}.json"
    if args.append and prev.exists():
        rows = json.loads(prev.read_text())["rows"]
    for setting in settings:
        context, batch = SETTINGS[setting]
        for name in names:
            row = {"setting": setting, "context": context, "batch": batch, "mixer": name}
            for how in args.hows.split(","):
                torch._dynamo.reset()
                try:
                    tps, warm, first = rate(name, context, batch, how, args.steps, warmup=2)
                    row[how], row[how + "_warmup_s"], row[how + "_loss"] = round(tps), round(warm, 1), first
                except Exception as e:                      # report, do not hide: a failure is a result
                    row[how], row[how + "_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            _write(rows, info, args)                     # after every row: a long run killed midway keeps its rows
            fmt = lambda x: "—" if x is None else f"{x:,}"   # noqa: E731
            print(f"{setting:5s} {name:15s} eager {fmt(row.get('eager')):>8} tok/s   compiled "
                  f"{fmt(row.get('compiled')):>8} ({row.get('compiled_warmup_s', '—')} s warm-up)   "
                  f"bf16 {fmt(row.get('bf16')):>8}", flush=True)
    print("\n".join(_write(rows, info, args)))
def _write(rows, info, args):
    suffix = "_quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"precision{suffix}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    lines = [f"CPU: {info['cpu']}; bf16 instructions: {', '.join(info['bf16_flags'])}; fp32 matmul "
             f"{info['matmul_gflops_fp32']} GFLOP/s; torch {info['torch']}", "",
             "| setting | mixer | eager fp32 tok/s | compiled fp32 | compiled / eager | compile time | "
             "first loss, compiled vs eager | bf16 autocast | bf16 / eager | first loss, bf16 vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e, c, b = r["eager"], r.get("compiled"), r.get("bf16")
        ratio = lambda x: f"{x / e:.2f}x" if x and e else "—"   # noqa: E731
        def rel(how):
            a, ref = r.get(how + "_loss"), r.get("eager_loss")
            return f"{abs(a - ref) / abs(ref):.1e}" if a is not None and ref else "—"
        def cell(how):
            x = r.get(how)
            return f"{x:,}" if x is not None else "failed" if how + "_error" in r else "not run"
        warm = f"{r['compiled_warmup_s']} s" if "compiled_warmup_s" in r else "—"
        lines.append(f"| {r['setting']} (T={r['context']}, B={r['batch']}) | {r['mixer']} | {cell('eager')} | "
                     f"{cell('compiled')} | {ratio(c)} | {warm} | {rel('compiled')} | {cell('bf16')} | {ratio(b)} "
                     f"| {rel('bf16')} |")
    (args.out / f"precision{suffix}.md").write_text("\n".join(lines) + "\n")
    _plot(rows, args.out / f"precision{suffix}.png")
    return lines


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({r["setting"] for r in rows}, key=list(SETTINGS).index)
    fig, axes = plt.subplots(1, len(settings), figsize=(7 * len(settings), 4.5), squeeze=False)
    for ax, s in zip(axes[0], settings):
        rs = [r for r in rows if r["setting"] == s]
        xs = range(len(rs))
        for i, (how, color) in enumerate((("eager", "C0"), ("compiled", "C1"), ("bf16", "C2"))):
            ax.bar([x + (i - 1) * 0.27 for x in xs], [r.get(how) or 0 for r in rs], 0.27, label=how, color=color)
        ax.set_xticks(list(xs), [r["mixer"] for r in rs], rotation=45, ha="right")
        ax.set_ylabel("training tokens/s")
        ax.set_title(f"{s}: T={rs[0]['context']}, batch {rs[0]['batch']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
