"""A Mamba block's decoding step in one C call against the same block through its modules, in one process: a
random model at mamba-130m's shape (Mamba-1, or ``--pattern mamba2``), float32 / int8 / int4 (or read back from a
GGUF file: q8_0, q4_0), 1 to 16 rows;
rounds alternate the two (the one call refused by making ``fused_block`` return None), so a noisy host moves
both alike.

    python benchmarks/bench_block_call.py                       # ~3 minutes; writes results/block_call.md
    python benchmarks/bench_block_call.py --quantize int8 --rows 1,2,4,8
    python benchmarks/bench_block_call.py --quantize q8_0 --rows 1      # the model read back from a Q8_0 GGUF

ms per step (median of ``--rounds``), and one call / modules. The modules' products are the library's (oneDNN /
fbgemm / torch's int4 kernel) or the C kernels where ``models.quant`` takes them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pattern", default="mamba", choices=["mamba", "mamba2"])
    ap.add_argument("--quantize", default="f32,int8,int4")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from subquad.layers.mamba import Mamba
    from subquad.layers.mamba2 import Mamba2
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.quant import quantize

    cls = Mamba if a.pattern == "mamba" else Mamba2
    own = cls.fused_block
    lines = [f"{a.pattern}, mamba-130m's shape (random weights), {a.threads} threads, {a.tokens} steps x "
             f"{a.rounds} rounds; {machine_line(matmul_gflops())}", "",
             "| precision | rows | one call ms | modules ms | one call / modules |", "|---|---:|---:|---:|---:|"]
    for q in a.quantize.split(","):
        torch.manual_seed(0)
        m = LanguageModel(ModelConfig(vocab_size=50280, d_model=768, n_layers=24, pattern=a.pattern, mlp=False,
                                      norm_eps=1e-5)).eval()
        if q in ("q8_0", "q4_0"):                       # saved as a GGUF file and read back (models.gguf)
            import tempfile

            from subquad.models import from_pretrained
            from subquad.models.gguf import save_gguf

            with tempfile.TemporaryDirectory() as tmp:
                save_gguf(m, Path(tmp) / "m.gguf", q)
                m = from_pretrained(Path(tmp) / "m.gguf")[0].eval()
        elif q != "f32":
            quantize(m, q)
        for B in map(int, a.rows.split(",")):
            res = {"one call": [], "modules": []}
            with torch.no_grad():
                _, st = m.prefill(torch.randint(0, 50280, (B, 4)))
                for _ in range(a.rounds):
                    for mode in res:
                        cls.fused_block = own if mode == "one call" else (lambda *x: None)
                        tok, s = torch.full((B,), 5), st
                        for _ in range(2):
                            m.step(tok, s)
                        t = time.perf_counter()
                        for _ in range(a.tokens):
                            logits, s = m.step(tok, s)
                            tok = logits.argmax(-1)
                        res[mode].append((time.perf_counter() - t) / a.tokens * 1e3)
            cls.fused_block = own
            one, mods = (statistics.median(res[k]) for k in ("one call", "modules"))
            lines.append(f"| {q} | {B} | {one:.2f} | {mods:.2f} | {one / mods:.2f} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    OUT.mkdir(exist_ok=True)
    (OUT / f"block_call{'' if a.pattern == 'mamba' else '_mamba2'}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
