"""``LanguageModel.generate``'s time per token and memory growth over a generation, as a user calls it (grad mode
on, the default): a 3-layer ``mamba2,gla,softmax`` model (d_model 512, vocab 8,192, random weights), a 32-token
prompt, greedy, N new tokens after a 4-token warm-up. Generation keeps a fixed-size state (the KV cache aside), so
the resident memory should not grow with N; a generation that recorded autograd's graph grew ~0.7 MB a token and
ran at twice the time (benchmarks/RESULTS.md, "generate had lost its no_grad").

    python benchmarks/bench_generate.py                 # N = 64 and 256
    python benchmarks/bench_generate.py --tokens 1024

Each N in its own process (the peak RSS is a process's); prints the host's CPU and matmul rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, resource, sys, time
import torch
from subquad.models import LanguageModel, ModelConfig
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[2]))
n = int(sys.argv[1])
cfg = ModelConfig(vocab_size=8192, d_model=512, n_layers=3, n_heads=8, pattern="mamba2,gla,softmax",
                  context_length=4096)
model = LanguageModel(cfg).eval()
prompt = [list(range(1, 33))]
model.generate(prompt, 4, temperature=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
model.generate(prompt, n, temperature=0)
took = time.perf_counter() - start
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"tokens": n, "ms_per_token": 1e3 * took / n, "rss_growth_mb": grew / 1024}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if min(args.tokens) < 1 or args.threads < 1:
        ap.error(f"--tokens and --threads must be >= 1, got {args.tokens} and {args.threads}")
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    import torch

    from benchmarks.common import machine_line, matmul_gflops

    torch.set_num_threads(args.threads)
    print(machine_line(matmul_gflops()))
    print("| new tokens | ms per new token (the prompt's prefill included) | peak RSS growth over the warm-up |\n"
          "|---:|---:|---:|")
    for n in args.tokens:
        out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(args.threads)], capture_output=True,
                             text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
        if out.returncode != 0:
            sys.exit(f"bench_generate: the {n}-token run failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {n} | {r['ms_per_token']:.2f} | {r['rss_growth_mb']:.0f} MB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
