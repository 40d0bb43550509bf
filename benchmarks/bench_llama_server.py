"""`subquad serve` against llama.cpp's own `llama-server` on the same weights (issue 49, item 5): completion
tokens/s at 1 and 16 concurrent streams, a random model at mamba-130m's shape (Mamba-1, d_model 768, 24 layers,
vocab 50,280) saved as a Hugging Face folder and as GGUF files of the same weights (``save_gguf``: f32, bf16,
q8_0, q4_0).

    llama-server   built natively from llama-cpp-python's vendored source (its C++ server, continuous batching
                   over ``--parallel`` slots; not llama-cpp-python's Python server):
                       cd vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
                           && cmake --build build --target llama-server -j 2
                   run as ``llama-server -m F.gguf -t 2 -tb 2 --parallel 16 -c 16*512 --no-webui``
    subquad serve  ``--max-batch 16``, default (eager) and ``--compile-decode``, float32 and ``--quantize int8``
                   (each), ``--quantize bf16`` (eager), and the BF16 / Q8_0 / Q4_0 GGUF files themselves
                   (``--model m-q8_0.gguf``, eager)

    python benchmarks/bench_llama_server.py --llama-server /path/to/build/bin/llama-server
    python benchmarks/bench_llama_server.py --llama-server ... --quick    # 2 streams, 8 tokens: the script runs
    python benchmarks/bench_llama_server.py --llama-server ... --model hybrid   # Bamba's structure (HYBRID)

Every request is the same for both: a 128-token prompt of random token ids, 128 new tokens forced
(``ignore_eos``, checked in each answer's usage), greedy, not streamed. At ``c`` streams, ``--rounds`` x c
requests go out with c in flight (one thread each), after a warm-up round that builds any graph; tokens/s is the
completion tokens over the wall time. Bounded: a fixed number of requests, each with a 600 s timeout. Both
listen on 127.0.0.1. Writes results/llama_server.{json,md}.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_serve import Server  # noqa: E402
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402

SHAPE = dict(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False, norm_eps=1e-5)
# --model hybrid: Bamba's structure (Mamba-2 blocks with a SwiGLU MLP each, softmax attention every sixth layer with
# half-rotary GQA; ``save_gguf`` writes it as Bamba, llama.cpp's granitehybrid) at mamba2-130m's mixer shape.
HYBRID = dict(vocab_size=50280, d_model=768, n_layers=24, n_heads=12, n_kv_heads=4,
              pattern=",".join("softmax" if i % 6 == 5 else "mamba2" for i in range(24)),
              mixer_options={"mamba2": {"d_state": 128, "head_dim": 64, "expand": 2, "conv_size": 4, "n_groups": 1,
                                        "norm_eps": 1e-5},
                             "softmax": {"rotary_base": 10000.0, "rotary_fraction": 0.5}},
              mlp=True, mlp_size=1536, mlp_bias=False, mlp_kind="swiglu", pos_emb="none", tie_embeddings=False,
              norm_eps=1e-5, eos_token_ids=[2])


def byte_tokenizer():
    """A byte-level BPE tokenizer of the 256 bytes and no merges: llama-server needs a vocabulary in the GGUF to
    print tokens (``save_gguf`` pads it to the model's 50,280 with unused tokens); requests are token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def complete(port: int, prompt: list[int], max_tokens: int) -> int:
    """One greedy completion of ``prompt`` (token ids) -> its completion tokens (must be ``max_tokens``)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {data}")
        n = data["usage"]["completion_tokens"]
        if n != max_tokens:
            raise RuntimeError(f"{n} completion tokens, {max_tokens} asked (ignore_eos not honoured?)")
        return n
    finally:
        conn.close()


def tokens_per_s(port: int, streams: int, rounds: int, prompt_len: int, max_tokens: int, vocab: int,
                 seed: int) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(rounds * streams)]
    with ThreadPoolExecutor(streams) as pool:
        t = time.perf_counter()
        n = sum(pool.map(lambda p: complete(port, p, max_tokens), prompts))
        return n / (time.perf_counter() - t)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, help="the llama-server binary")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream at each concurrency")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--only", help="comma-separated server names to run (default: every one)")
    ap.add_argument("--model", choices=("mamba", "hybrid"), default="mamba",
                    help="mamba-130m's shape, or HYBRID (Bamba's structure, 4 attention layers of 24)")
    ap.add_argument("--quick", action="store_true", help="2 layers, streams 1 and 2, 8 tokens: the script runs")
    a = ap.parse_args(argv)
    streams = [int(s) for s in a.streams.split(",")]
    shape = dict(SHAPE if a.model == "mamba" else HYBRID)
    if a.quick:
        streams, a.rounds, a.prompt_tokens, a.max_tokens = [1, 2], 1, 16, 8
        shape.update(n_layers=2, d_model=128, **({"pattern": "mamba2,softmax", "n_heads": 4, "n_kv_heads": 2}
                                                 if a.model == "hybrid" else {}))
    torch.set_num_threads(2)
    from subquad.models import LanguageModel, ModelConfig
    from subquad.models.gguf import save_gguf

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**shape)).eval()
    top = max(streams)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "mamba"
        model.save_pretrained(folder)
        for outtype in ("f32", "bf16", "q8_0", "q4_0"):
            save_gguf(model, Path(tmp) / f"m-{outtype}.gguf", outtype, tokenizer=byte_tokenizer())
        llama = [a.llama_server, "-t", 2, "-tb", 2, "--parallel", top, "-c", top * 512, "--no-webui"]
        servers = {
            "llama-server f32": dict(command=llama + ["-m", Path(tmp) / "m-f32.gguf"]),
            "llama-server bf16": dict(command=llama + ["-m", Path(tmp) / "m-bf16.gguf"]),
            "llama-server q8_0": dict(command=llama + ["-m", Path(tmp) / "m-q8_0.gguf"]),
            "llama-server q4_0": dict(command=llama + ["-m", Path(tmp) / "m-q4_0.gguf"]),
            "subquad serve f32 (eager)": dict(args=()),
            "subquad serve f32 --compile-decode": dict(args=("--compile-decode",)),
            "subquad serve bf16 (eager)": dict(args=("--quantize", "bf16")),
            "subquad serve bf16 GGUF (eager)": dict(args=(), model=Path(tmp) / "m-bf16.gguf"),
            "subquad serve int8 (eager)": dict(args=("--quantize", "int8")),
            "subquad serve int8 --compile-decode": dict(args=("--compile-decode", "--quantize", "int8")),
            "subquad serve int4 (eager)": dict(args=("--quantize", "int4")),
            "subquad serve q8_0 GGUF (eager)": dict(args=(), model=Path(tmp) / "m-q8_0.gguf"),
            "subquad serve q4_0 GGUF (eager)": dict(args=(), model=Path(tmp) / "m-q4_0.gguf"),
        }
        if a.only:
            servers = {k: v for k, v in servers.items() if k in a.only.split(",")}
        for name, how in servers.items():
            if "command" in how:
                server = Server(folder, command=[str(c) for c in how["command"]])
            else:
                server = Server(how.get("model", folder), "--max-batch", top,
                                "--max-context", 2 * (a.prompt_tokens + a.max_tokens), "--served-model-name", "m",
                                *how["args"])
            try:
                tokens_per_s(server.port, top, 1, a.prompt_tokens, a.max_tokens, shape["vocab_size"], 99)  # warm-up
                rows[name] = {c: tokens_per_s(server.port, c, a.rounds, a.prompt_tokens, a.max_tokens,
                                              shape["vocab_size"], c) for c in streams}
            finally:
                server.stop()
            print(name, {c: round(v, 1) for c, v in rows[name].items()}, flush=True)
    machine = machine_line(matmul_gflops())
    what = {"mamba": "mamba-130m's shape", "hybrid": "a Bamba-structured hybrid (bench_llama_server.HYBRID)"}[a.model]
    what = f"{what}, cut to 2 layers of width 128 (--quick)" if a.quick else what
    lines = [f"{what} (random weights), {a.prompt_tokens}-token prompts as ids, {a.max_tokens} new tokens "
             f"(ignore_eos), greedy, {a.rounds} requests per stream; {machine}", "",
             "| server | " + " | ".join(f"{c} stream{'s' if c > 1 else ''} tok/s" for c in streams)
             + f" | {top} / 1 | x llama-server ({top}, same precision) |",
             "|---|" + "---:|" * (len(streams) + 2)]
    for name, r in rows.items():
        ref = rows.get("llama-server q4_0" if "q4_0" in name or "int4" in name else
                       "llama-server bf16" if "bf16" in name else
                       "llama-server q8_0" if "int8" in name or "q8_0" in name else "llama-server f32")
        vs = f"{r[top] / ref[top]:.2f}" if ref else "-"
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.1f}" for c in streams)
                     + f" | {r[top] / r[min(streams)]:.2f} | {vs} |")
    print("\n".join(lines))
    OUT.mkdir(parents=True, exist_ok=True)
    stem = ("llama_server" if a.model == "mamba" else "llama_server_hybrid") + ("_quick" if a.quick else "")
    (OUT / f"{stem}.json").write_text(json.dumps({"tokens_per_s": rows, "machine": machine,
                                                       "streams": streams}, indent=1))
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
