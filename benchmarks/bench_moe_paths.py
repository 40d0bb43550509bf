"""A mixture-of-experts layer's three paths at a Qwen3-Next-like expert shape (d_model 1,024, 64 experts of 256,
top 8, float32, 2 threads): by index compiled (``MoE._gathered``, what a compiled step runs up to ``moe.GATHER``
* E choices), the routed loop as the op ``subquad::moe_experts`` compiled, and eager (``MoE.forward``); ms per
call by rows. Chooses ``moe.GATHER``.

    python benchmarks/bench_moe_paths.py            # ~2 minutes
"""
import time

import torch

from subquad.models.moe import MoE
torch.set_num_threads(2)
torch.manual_seed(0)
m = MoE(1024, 256, 64, top_k=8).eval()
def gathered_fn(x):
    p, w, idx = m.route(x); return m._gathered(x, w, idx)
def op_fn(x):
    p, w, idx = m.route(x)
    flat = idx.reshape(-1)
    counts = flat.new_zeros(m.experts).scatter_add_(0, flat, torch.ones_like(flat))
    return torch.ops.subquad.moe_experts(x, w.reshape(-1), flat, counts, m._op_key)
cg = torch.compile(gathered_fn, dynamic=True); co = torch.compile(op_fn, dynamic=True)
with torch.no_grad():
  for N in (1, 2, 4, 8, 16, 32, 64, 128):
    x = torch.randn(N, 1024)
    ref = m(x)
    for f, name in ((cg, 'gathered'), (co, 'op'), (m, 'eager')):
        y = f(x); assert (y - ref).abs().max() < 1e-4
        t = time.perf_counter(); n = 0
        while time.perf_counter() - t < 1: f(x); n += 1
        print(N, name, f'{1000*(time.perf_counter()-t)/n:.2f} ms', flush=True)
