"""A decoding step at 1 to 16 rows against one row (issue 53's batch-16 target: <= 1.6x one row's step, or in
float32 the products at >= 60% of the matmul rate, which ``bench_qgemv.py --from-memory`` gives), eagerly, the
path ``generate`` and ``serve`` take by default: a random model at mamba-130m's shape (Mamba-1, d_model 768, 24
layers, vocabulary 50,280), float32, int8 and int4 (``models.quant.quantize``) and read back from a GGUF file
of Q8_0 or Q4_0 blocks (``gguf-q8_0``, ``gguf-q4_0``: ``save_gguf``, then ``from_pretrained`` of the file), and int8
without the AMX tiles (``int8-noamx``: ``SUBQUAD_AMX=0``, fbgemm's kernel and the block calls' int8 rows as before);
``--model hybrid``: ``bench_llama_server.HYBRID`` (Bamba's structure at mamba2-130m's mixer shape). ms per
``model.step`` (median of three runs of ``--tokens`` steps after warm-up, in a ``kernels.steady`` span as
``generate`` decodes). One process per tree and precision,
rounds alternating.

    python benchmarks/bench_batch_step.py                                   # ~2 min; this checkout
    python benchmarks/bench_batch_step.py --trees /tmp/parent,. --rounds 2  # an A/B of two checkouts
    python benchmarks/bench_batch_step.py --precisions gguf-q8_0,gguf-q4_0  # a GGUF file's blocks
    python benchmarks/bench_batch_step.py --model hybrid --precisions f32,int8,int8-noamx --rows 1,16 --rounds 3

Writes results/batch_step.{md,png}.
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
from benchmarks.bench_llama_server import HYBRID, SHAPE  # noqa: E402
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402

CHILD = r'''
import json, statistics, sys, time, torch
tree, quantize, rows, tokens, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, tree)
torch.set_num_threads(threads)
from subquad.models import LanguageModel, ModelConfig
import contextlib, subquad.kernels
steady = getattr(subquad.kernels, "steady", contextlib.nullcontext)
torch.manual_seed(0)
model = LanguageModel(ModelConfig(**SHAPE)).eval()
if quantize.startswith("gguf-"):
    import tempfile
    from pathlib import Path
    from subquad.models import from_pretrained
    from subquad.models.gguf import save_gguf
    path = Path(tempfile.mkdtemp()) / "m.gguf"
    save_gguf(model, path, quantize[5:])
    model, _ = from_pretrained(path)
    path.unlink()
elif quantize != "f32":
    from subquad.models.quant import quantize as q
    q(model, quantize.split("-")[0])
out = {}
with torch.no_grad():
    for B in map(int, rows.split(",")):
        _, state = model.prefill(torch.tensor([[1, 2, 3, 4]] * B))
        tok = torch.tensor([5] * B)
        for _ in range(3):
            model.step(tok, state)
        runs = []
        for _ in range(3):
            with steady():                      # as generate decodes (a tree from before it: no span)
                s, t = state, time.perf_counter()
                for _ in range(tokens):
                    _, s = model.step(tok, s)
                runs.append((time.perf_counter() - t) * 1e3 / tokens)
        out[B] = statistics.median(runs)
print(json.dumps(out))
'''


PRECISIONS = ("f32", "int8", "int8-noamx", "int4", "bf16", "gguf-q8_0", "gguf-q4_0")


def child(tree: str, quantize: str, a) -> dict:
    code = "SHAPE = " + repr(SHAPE if a.model == "mamba" else HYBRID) + "\n" + CHILD
    env = {**os.environ, "SUBQUAD_AMX": "0"} if quantize == "int8-noamx" else None
    out = subprocess.run([sys.executable, "-c", code, str(Path(tree).resolve()), quantize, a.rows, str(a.tokens),
                          str(a.threads)], capture_output=True, text=True, check=True, env=env).stdout
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=str(Path(__file__).resolve().parent.parent),
                    help="comma-separated checkouts of subquad (default: this one)")
    ap.add_argument("--precisions", default="f32,int8,int4")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", choices=("mamba", "hybrid"), default="mamba")
    a = ap.parse_args(argv)
    trees, precisions = a.trees.split(","), a.precisions.split(",")
    for p in precisions:
        if p not in PRECISIONS:
            ap.error(f"--precisions: unknown {p!r} ({', '.join(PRECISIONS)})")
    runs: dict[tuple, list] = {}
    for r in range(a.rounds):
        for p in precisions:
            for tree in trees:
                for B, ms in child(tree, p, a).items():
                    runs.setdefault((tree, p, B), []).append(ms)
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    rows = list(map(int, a.rows.split(",")))
    machine = machine_line(matmul_gflops())
    what = "mamba-130m's shape" if a.model == "mamba" else "a Bamba-structured hybrid (bench_llama_server.HYBRID)"
    lines = [f"ms per eager step (median over {a.rounds} rounds), {what}, random weights; {machine}", "",
             "| tree | precision | " + " | ".join(f"{B} rows" for B in rows) + f" | {rows[-1]} / {rows[0]} |",
             "|---|---|" + "---:|" * (len(rows) + 1)]
    for tree in trees:
        for p in precisions:
            med = [statistics.median(runs[(tree, p, B)]) for B in rows]
            lines.append(f"| {tree} | {p} | " + " | ".join(f"{v:.2f}" for v in med) + f" | {med[-1] / med[0]:.2f} |")
    print("\n".join(lines))
    OUT.mkdir(exist_ok=True)
    stem = "batch_step" if a.model == "mamba" else "batch_step_hybrid"
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for tree in trees:
        for p in precisions:
            ax.plot(rows, [statistics.median(runs[(tree, p, B)]) for B in rows], marker="o",
                    label=f"{p} {Path(tree).name}" if len(trees) > 1 else p)
    ax.set(xlabel="rows", ylabel="ms per step", title=f"A decoding step's rows (eager, {a.model})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}.png", dpi=90)


if __name__ == "__main__":
    main()
