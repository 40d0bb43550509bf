"""Batched prefill in the serving engine (issue 49, item 2): the prompts due in one iteration packed in one forward
(``serve.prefill``) against one forward per prompt, the engine driven directly (no HTTP).

    python benchmarks/bench_prefill_batch.py [--kind mamba|hybrid] [--streams 16] [--prompt 128] [--max-tokens 128]

``--streams`` requests of ``--prompt`` random token ids each, submitted together, ``--max-tokens`` new tokens
(greedy, ``ignore_eos``), ``Engine(max_batch=streams, prefill_chunk=--chunk, state_cache_mb=0)``; rows:
``packed`` - today's engine, each round's pieces in one forward; ``one by one`` - the same engine told to plan one
piece per round (``_plan(...)[:1]``: what it did before). Reported: the median over ``--rounds`` interleaved rounds
of the time to the last first token (every prompt prefilled) and of the whole run, and completion tokens/s; the
model at mamba-130m's shape (``--kind mamba``, random weights) or a Mamba-2 + attention hybrid of that width
(``--kind hybrid``). Every stream's tokens are checked equal between the two rows. Writes
results/prefill_batch.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import OUT, machine_line  # noqa: E402
from subquad.models import LanguageModel, ModelConfig  # noqa: E402
from subquad.serve import Engine, SamplingParams  # noqa: E402

SHAPES = {"mamba": dict(vocab_size=50280, d_model=768, n_layers=24, pattern="mamba", mlp=False, norm_eps=1e-5),
          "hybrid": dict(vocab_size=50280, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, mlp=False,
                         pattern=",".join(["mamba2,mamba2,mamba2,softmax"] * 3), norm_eps=1e-5)}


class OneByOne(Engine):
    """The engine as before batched prefill: one piece per forward."""

    def _plan(self, budget: int) -> list:
        return super()._plan(budget)[:1]


def run(engine_class, model, prompts, max_tokens: int, chunk: int) -> dict:
    engine = engine_class(model, max_batch=len(prompts), prefill_chunk=chunk, state_cache_mb=0,
                          max_context=max(map(len, prompts)) + max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    seqs = [engine.submit(p, params) for p in prompts]
    first = None
    while engine.step():
        if first is None and all(s.tokens for s in seqs):
            first = time.perf_counter() - start
    total = time.perf_counter() - start
    return {"first": first, "total": total, "tokens": [s.tokens for s in seqs],
            "forwards": engine.counters["prefill_forwards"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=sorted(SHAPES), default="mamba")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=512, help="the engine's prefill_chunk (tokens per iteration)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**SHAPES[a.kind])).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50000, (a.prompt,), generator=g).tolist() for _ in range(a.streams)]
    run(Engine, model, prompts[:2], 2, a.chunk)                     # warm up
    rows = {"packed": (Engine, []), "one by one": (OneByOne, [])}
    for r in range(a.rounds):
        for name, (cls, out) in rows.items():
            out.append(run(cls, model, prompts, a.max_tokens, a.chunk))
            print(f"round {r + 1} {name}: first tokens {out[-1]['first']:.2f} s, all {out[-1]['total']:.2f} s, "
                  f"{out[-1]['forwards']} prefill forwards", flush=True)
    ref = rows["one by one"][1][0]["tokens"]
    same = all(o["tokens"] == ref for _, out in rows.values() for o in out)
    caption = machine_line()
    lines = [f"{a.kind} (mamba-130m's width), {a.streams} streams of {a.prompt} + {a.max_tokens} tokens, "
             f"prefill_chunk {a.chunk}; {caption}", "",
             "| prefill | forwards | every first token s | all done s | tokens/s |", "|---|---:|---:|---:|---:|"]
    result = {"kind": a.kind, "streams": a.streams, "prompt": a.prompt, "max_tokens": a.max_tokens,
              "chunk": a.chunk, "machine": caption, "equal": same, "rows": {}}
    for name, (_, out) in rows.items():
        first = statistics.median(o["first"] for o in out)
        total = statistics.median(o["total"] for o in out)
        tps = a.streams * a.max_tokens / total
        result["rows"][name] = {"first_s": first, "total_s": total, "tokens_per_s": tps,
                                "forwards": out[0]["forwards"]}
        lines.append(f"| {name} | {out[0]['forwards']} | {first:.2f} | {total:.2f} | {tps:.1f} |")
    lines += ["", f"every stream equal between the rows: {same}"]
    print("\n".join(lines))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "prefill_batch.json").write_text(json.dumps(result, indent=1))
    (OUT / "prefill_batch.md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
