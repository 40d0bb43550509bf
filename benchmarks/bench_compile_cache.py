"""The compiled decoding step across processes (``models.decode``'s cache): each case runs in two fresh
processes that share a fresh cache folder (``SUBQUAD_COMPILE_CACHE``, and inductor's ``TORCHINDUCTOR_CACHE_DIR``
as on one machine): the first compiles the step and saves it, the second loads it.

Cases, random weights at the real shapes, float32, ``decode_layout`` as ``from_pretrained`` applies it:
mamba-130m (Mamba-1, d_model 768, 24 layers, vocab 50,280; batch 1) and a hybrid (Mamba-2 x3 + softmax
attention, d_model 512, 8 layers, vocab 32,000; batch 2, a ragged KV cache). "first step" is the first
``model.step`` (compile or load, then the step), "step" the median of the next 32; "err" the loaded step's
logits against the eager step's, over their largest.

    python benchmarks/bench_compile_cache.py                  # ~5 minutes on 2 cores
    python benchmarks/bench_compile_cache.py --cases hybrid   # one case
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {   # name: (ModelConfig fields, batch)
    "mamba-130m": ({"vocab_size": 50280, "d_model": 768, "n_layers": 24, "n_heads": 1, "pattern": "mamba",
                    "mlp": False, "norm_eps": 1e-5, "context_length": 1 << 20,
                    "mixer_options": {"mamba": {"d_state": 16, "expand": 2, "conv_size": 4, "dt_rank": 48}}}, 1),
    "hybrid": ({"vocab_size": 32000, "d_model": 512, "n_layers": 8, "n_heads": 8, "context_length": 4096,
                "pattern": ",".join(["mamba2", "mamba2", "mamba2", "softmax"] * 2)}, 2),
}


def child(name: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.decode import compile_decode, decode_layout

    fields, batch = CASES[name]
    torch.manual_seed(0)
    model = decode_layout(LanguageModel(ModelConfig(**fields)).eval())
    eager = compile_decode(model, False)
    with torch.no_grad():
        logits, state = model.prefill(torch.randint(0, fields["vocab_size"], (batch, 16)))
        tok = logits[:, -1].argmax(-1)
        ref, _ = eager.step(tok, state)
        compile_decode(model)
        t = time.perf_counter()
        out, s = model.step(tok, state)
        first = time.perf_counter() - t
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        times = []
        for _ in range(32):
            tok = out.argmax(-1)
            t = time.perf_counter()
            out, s = model.step(tok, s)
            times.append(time.perf_counter() - t)
    step = model._decode_step
    return {"first_s": first, "step_ms": 1e3 * statistics.median(times), "err": err, "loaded": step.loaded,
                "compiled": step.compiled, "fallback": step.fallback}


def cpu_name() -> str:
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads)))
        return
    rows = []
    for name in args.cases.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "SUBQUAD_COMPILE_CACHE": f"{tmp}/decode", "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor",
                   "PYTHONPATH": str(ROOT)}
            runs = []
            for _ in range(2):
                load = Path("/proc/loadavg").read_text().split()[0] if os.path.exists("/proc/loadavg") else "?"
                out = subprocess.run([sys.executable, __file__, "--child", name, "--threads", str(args.threads)],
                                     env=env, capture_output=True, text=True, check=False)
                if out.returncode:
                    sys.exit(f"{name}: the process failed\n{out.stderr[-3000:]}")
                runs.append({**json.loads(out.stdout.strip().splitlines()[-1]), "load": load})
                print(name, runs[-1], file=sys.stderr, flush=True)
            rows.append((name, runs))
    print(f"{cpu_name()}, {args.threads} thread(s), torch {__import__('torch').__version__}")
    print("| case | cold first step (compiles) | warm first step (loads) | step ms cold / warm | loaded err | load avg |")
    print("|---|---|---|---|---|---|")
    for name, (a, b) in rows:
        how = "" if b["loaded"] and not b["compiled"] else f" (loaded {b['loaded']}, compiled {b['compiled']}, {b['fallback']})"
        print(f"| {name} | {a['first_s']:.1f} s | {b['first_s']:.1f} s{how} | {a['step_ms']:.2f} / {b['step_ms']:.2f} | "
              f"{b['err']:.1e} | {a['load']} / {b['load']} |")


if __name__ == "__main__":
    main()
