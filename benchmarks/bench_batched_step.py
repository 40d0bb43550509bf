"""A decoding step at 1 and 16 rows, eager, float32 / int8 / int4 (issue 53's "batch 16 step <= 1.6x batch 1's"),
int8 with and without the AMX tiles (``SUBQUAD_AMX=0``: fbgemm's kernel and the block kernels' int8 rows as before),
at mamba-130m's shape and the Bamba-structured hybrid (``bench_llama_server.HYBRID``), random weights.

Each cell runs in a process of its own (a fresh model, ``--steps`` steps after a 128-token prompt and 4 warm-up
steps; the median step), the cells in ``--rounds`` rounds each running every cell once in turn, so a host whose
speed drifts moves them alike; the median of the rounds.

    python benchmarks/bench_batched_step.py                      # ~6 minutes on 2 cores
    python benchmarks/bench_batched_step.py --models mamba --rounds 5

Writes results/batched_step.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402

CELLS = {"float32": ("f32", "1"), "int8": ("int8", "1"), "int8 without AMX": ("int8", "0"), "int4": ("int4", "1")}


def cell(model: str, kind: str, rows: int, steps: int, threads: int) -> float:
    """Median ms of one step in this process (the child's work)."""
    import time

    import torch

    from benchmarks.bench_llama_server import HYBRID, SHAPE
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.quant import quantize

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    m = LanguageModel(ModelConfig(**(SHAPE if model == "mamba" else HYBRID))).eval()
    if kind != "f32":
        quantize(m, kind)
    with torch.no_grad():
        logits, state = m.prefill(torch.randint(0, 50000, (rows, 128)), logits="last")
        tok = logits.argmax(-1)
        for _ in range(4):
            logits, state = m.step(tok, state)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            logits, state = m.step(tok, state)
            times.append(time.perf_counter() - t)
            tok = logits.argmax(-1)
    return 1000 * statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mamba,hybrid")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)      # model kind rows: one cell, printed
    a = ap.parse_args(argv)
    if a.child:
        print(cell(a.child[0], a.child[1], int(a.child[2]), a.steps, a.threads))
        return
    models, names = a.models.split(","), a.cells.split(",")
    runs: dict = {}
    for r in range(a.rounds):
        for model in models:
            for name in names:
                kind, amx = CELLS[name]
                for rows in (1, a.rows):
                    env = {**os.environ, "SUBQUAD_AMX": amx}
                    out = subprocess.run([sys.executable, __file__, "--child", model, kind, str(rows), "--steps",
                                          str(a.steps), "--threads", str(a.threads)], env=env, check=True,
                                         capture_output=True, text=True).stdout
                    ms = float(out.strip().splitlines()[-1])
                    runs.setdefault(f"{model}|{name}|{rows}", []).append(ms)
                    print(f"round {r + 1}/{a.rounds} {model} {name} {rows} rows: {ms:.2f} ms", flush=True)
    machine = machine_line(matmul_gflops())
    med = {k: statistics.median(v) for k, v in runs.items()}
    lines = [f"Eager decoding steps, random weights, {a.threads} threads, median of {a.rounds} interleaved rounds "
             f"(each a process: {a.steps} steps after a 128-token prompt). {machine}", "",
             f"| model | weights | 1 row ms | {a.rows} rows ms | x 1 row | rounds ({a.rows} rows) |",
             "|---|---|---:|---:|---:|---|"]
    for model in models:
        for name in names:
            one, many = med[f"{model}|{name}|1"], med[f"{model}|{name}|{a.rows}"]
            lines.append(f"| {model} | {name} | {one:.2f} | {many:.2f} | {many / one:.2f} | "
                         + " / ".join(f"{x:.1f}" for x in runs[f"{model}|{name}|{a.rows}"]) + " |")
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "batched_step.md").write_text(text + "\n")
    (OUT / "batched_step.json").write_text(json.dumps({"machine": machine, "runs": runs, "median": med}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [med[f"{model}|{n}|1"] for n in names], 0.4, label="1 row")
        ax.bar([x + 0.2 for x in xs], [med[f"{model}|{n}|{a.rows}"] for n in names], 0.4, label=f"{a.rows} rows")
        ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
        ax.set_ylabel("ms per step")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.suptitle(machine, fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "batched_step.png", dpi=120)


if __name__ == "__main__":
    main()
