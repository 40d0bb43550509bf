"""GGUF files of a mamba-130m-shape model (random weights): what ``save_gguf`` writes and ``from_pretrained``
reads back - file size, load time and peak memory of a fresh process that loads it, the logits' distance from
the float32 model, and the eager decoding step (batch 1) of each loaded model against float32 and subquad's own
int8 (``quantize="int8"``, fbgemm per channel). A GGUF's quantised matrices load as ``Int8Linear`` per block,
whose product dequantises (no kernel takes per-block scales): the step measures what that costs.

    python benchmarks/bench_gguf.py                      # ~2 minutes on 2 threads (quiet machine)
    python benchmarks/bench_gguf.py --threads 1 --repeats 3

(llama.cpp's load of these files and its logits belong here too, with llama-cpp-python built: not run - see
benchmarks/RESULTS.md "GGUF in and out".)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cpu_model

# peak resident memory from VmHWM: ru_maxrss of a child counts the parent's pages at the fork
LOAD = """
import sys, time, torch
sys.path.insert(0, {root!r})
torch.set_num_threads(1)
t = time.perf_counter()
from subquad.models import from_pretrained
m, _ = from_pretrained({path!r})
hwm = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
print(time.perf_counter() - t, int(hwm.split()[1]) / 1024)
"""


def steps(m, repeats):
    """Best ms per token of 16 eager steps after a 3-token prefill."""
    best = float("inf")
    with torch.no_grad():
        s0 = m.prefill(torch.tensor([[1, 2, 3]]))[1]
        for _ in range(repeats):
            s, t = s0, time.perf_counter()
            for i in range(16):
                _, s = m.step(torch.tensor([i]), s)
            best = min(best, (time.perf_counter() - t) / 16 * 1e3)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--outtypes", default="f32,q8_0,q4_0")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import copy
    import warnings

    from subquad.models import LanguageModel, ModelConfig, from_pretrained
    from subquad.models.gguf import save_gguf
    from subquad.models.quant import quantize

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False)
    base = LanguageModel(cfg).eval()
    ids = torch.randint(0, 50280, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = base(ids)
    rows = [("float32 (in memory)", None, None, steps(base, args.repeats), 0.0),
            ("int8 quantize= (in memory)", None, None, steps(quantize(copy.deepcopy(base), "int8"), args.repeats),
             None)]
    root = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory() as d:
        for outtype in args.outtypes.split(","):
            path = Path(d) / f"m.{outtype}.gguf"
            t = time.perf_counter()
            save_gguf(base, path, outtype)
            write_s = time.perf_counter() - t
            out = subprocess.run([sys.executable, "-c", LOAD.format(root=root, path=str(path))], capture_output=True,
                                 text=True, check=True).stdout.split()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m, _ = from_pretrained(path)
            with torch.no_grad():
                err = ((m(ids) - want).abs().max() / want.abs().max()).item()
            rows.append((f"GGUF {outtype.upper()} ({path.stat().st_size / 2**20:.0f} MiB, written in {write_s:.1f} s)",
                         float(out[0]), float(out[1]), steps(m, args.repeats), err))
            del m
            kernel = {"q8_0": "int8", "q4_0": "int4"}.get(outtype)
            if kernel:                                  # the same file in subquad's kernels' forms (approximate)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    m, _ = from_pretrained(path, quantize=kernel)
                with torch.no_grad():
                    err = ((m(ids) - want).abs().max() / want.abs().max()).item()
                rows.append((f"GGUF {outtype.upper()}, quantize={kernel!r}", None, None, steps(m, args.repeats), err))
                del m
    print(f"CPU: {cpu_model()}; {args.threads} threads for the steps, 1 for the loads; under load (shared machine)")
    print("| model | load s (fresh process) | peak MB at load | decode ms/token (eager, batch 1) | "
          "max logit error / max logit |")
    print("|---|---:|---:|---:|---:|")
    for name, load_s, peak, ms, err in rows:
        print(f"| {name} | {'-' if load_s is None else f'{load_s:.2f}'} | {'-' if peak is None else f'{peak:.0f}'} | "
              f"{ms:.1f} | {'-' if err is None else f'{err:.1e}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
