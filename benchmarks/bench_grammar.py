"""What ``response_format`` costs per token (``models.constrain``): llguidance's mask for one row, the bits turned
into a (vocab,) mask, and applying it, for byte-level BPE tokenizers of 4,096 and 32,768 tokens trained on the
embedded corpus, over JSON outputs of a schema and of JSON mode; beside it a float32 decoding step of
mamba-130m's shape (the cost the mask adds to).

    python benchmarks/bench_grammar.py          # ~2 minutes (most of it training the 32K tokenizer)
"""

from __future__ import annotations

import json
import platform
import subprocess
import time

import torch

from subquad.data.corpus import stdlib_corpus
from subquad.data.tokenizer import train_tokenizer
from subquad.models.constrain import Grammar

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
OUTPUTS = [({"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            '{"name":"Ada Lovelace","age":36,"tags":["mathematics","engine","notes","poetry"]}'),
           ({"type": "json_object"}, '{"id":17,"items":[{"k":"a","v":1.5},{"k":"b","v":null}],"ok":true}')]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def per_token(tok, fmt, text, V, repeats=20) -> tuple[float, float, int]:
    """(ms per token for the mask, ms per token to apply it to (1, V) logits, tokens)."""
    ids = tok.encode(text).ids
    g = Grammar(fmt, tok, V)
    logits = torch.randn(1, V)
    mask_t = apply_t = 0.0
    for _ in range(repeats):
        m = g.matcher()
        for t in ids:
            a = time.perf_counter()
            allowed = m.allowed()
            b = time.perf_counter()
            logits[0].masked_fill(~allowed, float("-inf"))
            c = time.perf_counter()
            assert allowed[t], "the output is not in the grammar"
            m.consume(t)
            mask_t, apply_t = mask_t + b - a, apply_t + c - b
    n = repeats * len(ids)
    return 1e3 * mask_t / n, 1e3 * apply_t / n, len(ids)


def step_ms() -> float:
    from subquad.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=50280, d_model=768, n_layers=24, n_heads=12, pattern="mamba",
                                      mlp=False, context_length=2048)).eval()
    with torch.no_grad():
        _, s = model.prefill(torch.zeros(1, 8, dtype=torch.long))
        for _ in range(3):
            model.step(torch.zeros(1, dtype=torch.long), s)
        t = time.perf_counter()
        for _ in range(10):
            model.step(torch.zeros(1, dtype=torch.long), s)
    return 1e3 * (time.perf_counter() - t) / 10


def main():
    torch.set_num_threads(2)
    texts = stdlib_corpus().train[:400] + [json.dumps(o) for _, o in OUTPUTS] * 50
    print(f"CPU: {cpu_name()}, torch threads 2")
    print("| tokenizer vocab | format | tokens | mask ms/token | apply ms/token |")
    print("|---:|---|---:|---:|---:|")
    for V in (4096, 32768):
        t0 = time.perf_counter()
        tok = train_tokenizer(texts, V)
        build = time.perf_counter() - t0
        for fmt, text in OUTPUTS:
            per_token(tok, fmt, text, tok.get_vocab_size(), repeats=2)      # warm: the grammar's first build
            mask, apply, n = per_token(tok, fmt, text, tok.get_vocab_size())
            print(f"| {tok.get_vocab_size():,} | {fmt['type']} | {n} | {mask:.3f} | {apply:.3f} |", flush=True)
        print(f"(tokenizer trained in {build:.0f} s)")
    print(f"float32 eager decoding step, mamba-130m's shape: {step_ms():.1f} ms")


if __name__ == "__main__":
    main()
