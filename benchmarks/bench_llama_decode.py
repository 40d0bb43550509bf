"""Decoding one token at batch 1 against llama.cpp on the same weights (issue 53's anchor), measured in one run:
a random model at mamba-130m's shape (Mamba-1, d_model 768, 24 layers, vocab 50,280) saved as a Hugging Face
folder and as GGUF files (``save_gguf``: f32, q8_0 and q4_0), then

    llama.cpp   ``llama-bench -p 0 -n N`` on each GGUF (built natively from llama-cpp-python's vendored source:
                cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-bench)
    subquad     ``from_pretrained`` of the folder: eager float32 (with the fused C step, the default, and op by op:
                ``SUBQUAD_KERNELS=0``), ``compile_decode`` float32, eager and ``compile_decode``
                with ``quantize="int8"`` and with ``quantize="int4"`` (groups of 128, the default; against Q4_0,
                issue 51's target), eager ``quantize="bf16"`` against a BF16 file; N greedy ``model.step``
                calls after warm-up (the graph compiled first), in a ``kernels.steady`` span as ``generate``
                decodes

    python benchmarks/bench_llama_decode.py --llama-bench /path/to/build/bin/llama-bench
    python benchmarks/bench_llama_decode.py --llama-bench ... --interleave 3   # eager rows only, rounds alternating
    python benchmarks/bench_llama_decode.py --llama-bench ... --interleave 3 --model hybrid   # Bamba's structure
    SUBQUAD_ONEDNN=0 python benchmarks/bench_llama_decode.py ...     # the float32 products through MKL instead

and every step but the op-by-op one at ``--batch`` rows (default 16), ms per step and the ratio to one row.

``--interleave R``: only llama.cpp and subquad's eager step at each precision (f32 / BF16 / Q8_0 / Q4_0 against
float32 / bfloat16 / int8 / int4, and subquad reading the F16, BF16, Q8_0 and Q4_0 files themselves), R rounds
each running every row once in turn, so a host whose speed drifts moves both engines alike; the median of each
row and every round's ratio.
Writes results/llama_decode_interleaved.md (``--model hybrid``: llama_decode_hybrid_interleaved.md).

``--model hybrid``: ``bench_llama_server.HYBRID`` (Bamba's structure at mamba2-130m's mixer shape: Mamba-2 blocks
with a SwiGLU MLP each, softmax attention every sixth layer; llama.cpp runs it as ``granitehybrid``) instead of
mamba-130m's shape.

ms per token (median of ``--repeats`` runs for subquad; llama-bench's mean over its own repetitions), the read
bound (the bytes of the weights one token reads over the measured read bandwidth is not measured here: the
ratios are to llama.cpp in the same run). Writes results/llama_decode.{json,md} (``--model hybrid``:
llama_decode_hybrid.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
SHAPE = dict(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False, norm_eps=1e-5)


def llama_ms(bench: str, gguf: Path, tokens: int, threads: int) -> float:
    out = subprocess.run([bench, "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "3",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    row = json.loads(out)[0]
    return 1e3 / row["avg_ts"]


def subquad_ms(folder: Path, tokens: int, repeats: int, compiled: bool, quantize=None, batch: int = 1,
               kernels: str = "1") -> float:
    import os

    from subquad.kernels import steady
    from subquad.models import from_pretrained

    os.environ["SUBQUAD_KERNELS"] = kernels
    from subquad.models.decode import compile_decode

    model, _ = from_pretrained(folder, quantize=quantize)
    model.eval()
    if compiled:
        compile_decode(model)
    ids = torch.tensor([[1, 2, 3, 4]] * batch)
    runs = []
    with torch.no_grad():
        _, state = model.prefill(ids)
        tok = torch.tensor([5] * batch)
        for _ in range(3):                                   # warm-up: the graph compiled (or loaded) here
            logits, s = model.step(tok, state)
        for _ in range(repeats):
            with steady():                                   # as ``generate`` decodes: kept calls checked once
                s, t = state, time.perf_counter()
                for _ in range(tokens):
                    logits, s = model.step(tok, s)
                    tok = logits.argmax(-1)
                runs.append((time.perf_counter() - t) * 1e3 / tokens)
    return statistics.median(runs)


def what(model: str) -> str:
    return {"mamba": "mamba-130m's shape", "hybrid": "a Bamba-structured hybrid (bench_llama_server.HYBRID)"}[model]


def interleaved(a, folder: Path, tmp: Path):
    """``--interleave``'s rounds (module doc)."""
    pairs = (("f32", None), ("bf16", "bf16"), ("q8_0", "int8"), ("q4_0", "int4"), ("f16", "gguf f16"),
             ("bf16", "gguf bf16"), ("q8_0", "gguf q8_0"), ("q4_0", "gguf q4_0"))
    runs: dict[str, list] = {}
    for r in range(a.interleave):
        done = set()
        for outtype, q in pairs:
            if outtype not in done:                          # llama.cpp once per file, against each subquad row
                done.add(outtype)
                runs.setdefault(f"llama.cpp {outtype}", []).append(
                    llama_ms(a.llama_bench, tmp / f"m-{outtype}.gguf", a.tokens, a.threads))
            source = tmp / f"m-{outtype}.gguf" if q and q.startswith("gguf") else folder   # the file read back
            runs.setdefault(f"subquad {q or 'f32'} eager", []).append(
                subquad_ms(source, a.tokens, a.repeats, False, None if source != folder else q))
        print(f"round {r + 1}/{a.interleave}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs.items()), flush=True)
    machine = machine_line(matmul_gflops())
    lines = [f"{what(a.model)} (random weights), batch 1, {a.threads} threads, {a.tokens} tokens, {a.interleave} "
             f"rounds alternating the engines; {machine}", "",
             "| precision | llama.cpp ms (median) | subquad eager ms (median) | ratio of medians | each round's |",
             "|---|---:|---:|---:|---|"]
    for outtype, q in pairs:
        ll, sq = runs[f"llama.cpp {outtype}"], runs[f"subquad {q or 'f32'} eager"]     # gguf rows: the same llama.cpp
        ratios = ", ".join(f"{x / y:.2f}" for x, y in zip(sq, ll))
        lines.append(f"| {q or 'f32'} / {outtype} | {statistics.median(ll):.2f} | {statistics.median(sq):.2f} | "
                     f"{statistics.median(sq) / statistics.median(ll):.2f} | {ratios} |")
    print("\n".join(lines))
    stem = "llama_decode_interleaved" if a.model == "mamba" else "llama_decode_hybrid_interleaved"
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True, help="the llama-bench binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="the rows of the batched compiled steps (1: none)")
    ap.add_argument("--interleave", type=int, default=0, help="rounds of the eager rows against llama.cpp only")
    ap.add_argument("--model", choices=("mamba", "hybrid"), default="mamba")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.gguf import save_gguf

    from benchmarks.bench_llama_server import HYBRID

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**(SHAPE if a.model == "mamba" else HYBRID))).eval()
    rows, batched = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "mamba"
        model.save_pretrained(folder)
        for outtype in OUTTYPES:
            save_gguf(model, Path(tmp) / f"m-{outtype}.gguf", outtype)
        if a.interleave:
            return interleaved(a, folder, Path(tmp))
        for outtype in OUTTYPES:
            rows[f"llama.cpp {outtype}"] = llama_ms(a.llama_bench, Path(tmp) / f"m-{outtype}.gguf", a.tokens, a.threads)
            print(f"llama.cpp {outtype}: {rows[f'llama.cpp {outtype}']:.2f} ms/token", flush=True)
        for name, compiled, q, k in (("subquad f32 eager", False, None, "1"),
                                     ("subquad f32 eager, op by op", False, None, "0"),
                                     ("subquad f32 compile_decode", True, None, "1"),
                                     ("subquad bf16 eager", False, "bf16", "1"),
                                     ("subquad int8 eager", False, "int8", "1"),
                                     ("subquad int8 compile_decode", True, "int8", "1"),
                                     ("subquad int4 eager", False, "int4", "1"),
                                     ("subquad int4 compile_decode", True, "int4", "1")):
            rows[name] = subquad_ms(folder, a.tokens, a.repeats, compiled, q, kernels=k)
            print(f"{name}: {rows[name]:.2f} ms/token", flush=True)
            if k == "1" and a.batch > 1:
                batched[name] = subquad_ms(folder, a.tokens // 4, a.repeats, compiled, q, a.batch)
                print(f"{name}, batch {a.batch}: {batched[name]:.2f} ms/step", flush=True)
    machine = machine_line(matmul_gflops())
    from benchmarks.bench_pretrained import read_gbps

    gbps = read_gbps()                   # the float32 bound: every weight read once a token (the tied head once)
    bound = sum(p.numel() * p.element_size() for p in model.parameters()) / gbps / 1e6

    def base(name):                     # llama.cpp's row of the same precision
        return rows[next(f"llama.cpp {o}" for k, o in (("int8", "q8_0"), ("q8_0", "q8_0"), ("int4", "q4_0"),
                                                        ("q4_0", "q4_0"), ("bf16", "bf16"), ("", "f32"))
                           if k in name)]
    from subquad.layers.linear import ONEDNN

    lines = [f"{what(a.model)} (random weights), batch 1, {a.threads} threads, {a.tokens} tokens; float32 "
             f"products through {'oneDNN' if ONEDNN else 'MKL (SUBQUAD_ONEDNN=0)'}; {machine}; read bandwidth "
             f"{gbps:.1f} GB/s (bench_pretrained.read_gbps), so the float32 bound is {bound:.2f} ms", "",
             "| engine | ms/token | x llama.cpp (same precision) | x the f32 bound (f32 rows) |",
             "|---|---:|---:|---:|"]
    for name, ms in rows.items():
        f32 = "f32" in name
        lines.append(f"| {name} | {ms:.2f} | {ms / base(name):.2f} | {f'{ms / bound:.2f}' if f32 else '-'} |")
    modes = ("eager", "compile_decode")
    best = {q: min(rows[f"subquad {q} {m}"] for m in modes) for q in ("int8", "int4")}
    lines += ["", "subquad int4 / int8 (batch 1, eager; compiled; the faster of each): "
              + "; ".join(f"{rows[f'subquad int4 {m}'] / rows[f'subquad int8 {m}']:.2f}" for m in modes)
              + f"; {best['int4'] / best['int8']:.2f}"]
    if batched:
        lines += ["", f"| batch {a.batch} | ms/step | x batch 1 |", "|---|---:|---:|"]
        lines += [f"| {name} | {ms:.2f} | {ms / rows[name]:.2f} |" for name, ms in batched.items()]
    print("\n".join(lines))
    stem = "llama_decode" if a.model == "mamba" else "llama_decode_hybrid"
    (OUT / f"{stem}.json").write_text(json.dumps({"ms": rows, "batched": batched, "batch": a.batch,
                                                       "read_gbps": gbps, "f32_bound_ms": bound,
                                                       "onednn": ONEDNN, "machine": machine, "tokens": a.tokens},
                                                      indent=1))
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
