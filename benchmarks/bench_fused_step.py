"""The eager decoding step with the fused C kernels (``subquad.kernels``: Mamba-1's and Mamba-2's step between
in_proj and out_proj in one call) against the same step op by op (``SUBQUAD_KERNELS=0``), and the compiled step
(``compile_decode``, which keeps inductor's own fusion) beside them: ms per step at batch 1 and 16, random
weights, float32, 2 threads, the rounds interleaved in one process.

    python benchmarks/bench_fused_step.py                      # mamba-130m's shape and a Mamba-2 one (~4 min)
    python benchmarks/bench_fused_step.py --no-compile         # eager rows only (~1 min)

Shapes: ``mamba`` mamba-130m (d_model 768, 24 layers, vocab 50,280); ``mamba2`` mamba2-130m (768, 24 layers,
d_state 128, head_dim 64); ``gdn`` 12 Gated DeltaNet layers of Qwen3.5-0.8B's widths (d_model 1,024, 8 value heads
of 128 over 4 key heads; ``--shapes gdn``). Writes results/fused_step.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402

SHAPES = {"mamba": dict(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False, norm_eps=1e-5),
          "mamba2": dict(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba2", mlp=False, norm_eps=1e-5,
                         mixer_options={"mamba2": {"d_state": 128, "head_dim": 64}}),
          "gdn": dict(vocab_size=50280, d_model=1024, n_layers=12, pattern="gated_deltanet", mlp=False, n_heads=8,
                      norm_eps=1e-6, mixer_options={"gated_deltanet": {"head_dim": 128, "n_key_heads": 4}})}


def steps(model, batch: int, kernels: str, n: int, state):
    """ms per step of ``n`` steps from ``state`` with SUBQUAD_KERNELS=``kernels``."""
    os.environ["SUBQUAD_KERNELS"] = kernels
    tok = torch.full((batch,), 7)
    s = state
    for _ in range(2):
        _, s = model.step(tok, s)
    t = time.perf_counter()
    for _ in range(n):
        _, s = model.step(tok, s)
    return (time.perf_counter() - t) / n * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="mamba,mamba2")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.decode import compile_decode, decode_layout

    lines = ["| shape | batch | eager op by op ms | eager fused ms | fused / op by op | compiled ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in a.shapes.split(","):
        torch.manual_seed(0)
        model = decode_layout(LanguageModel(ModelConfig(**SHAPES[name])).eval())
        compiled = None
        if not a.no_compile:
            torch.manual_seed(0)
            compiled = compile_decode(decode_layout(LanguageModel(ModelConfig(**SHAPES[name])).eval()))
        with torch.no_grad():
            for batch in (int(b) for b in a.batches.split(",")):
                _, state = model.prefill(torch.randint(0, 50000, (batch, 16)))
                ms = {"0": [], "1": [], "c": []}
                n = 16 if batch == 1 else 6
                if compiled is not None:
                    steps(compiled, batch, "1", 1, state)                 # compiled here
                for _ in range(a.rounds):
                    for k in ("0", "1"):
                        ms[k].append(steps(model, batch, k, n, state))
                    if compiled is not None:
                        ms["c"].append(steps(compiled, batch, "1", n, state))
                m = {k: statistics.median(v) if v else float("nan") for k, v in ms.items()}
                lines.append(f"| {name} | {batch} | {m['0']:.2f} | {m['1']:.2f} | {m['1'] / m['0']:.2f} | "
                             f"{m['c']:.2f} |")
                print(lines[-1], flush=True)
    os.environ.pop("SUBQUAD_KERNELS")
    text = "\n".join([f"float32, {a.threads} threads; {machine_line(matmul_gflops())}", ""] + lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "fused_step.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
