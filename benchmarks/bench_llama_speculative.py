"""Prompt-lookup speculation against llama.cpp's own (issue 50's last target: at batch 1, >= 1.2x `llama-server`'s
speculation on the same weights), on a model trained here so that acceptance means something.

The model: ``bench_speculative.py``'s target recipe (the ``small`` preset, 500 steps on the embedded corpus) as a
pure Mamba-2 stack - an architecture llama.cpp has (its hybrid target, Mamba-2 with softmax layers, has no GGUF
architecture) - kept in ``--out``; its GGUF written by ``save_gguf`` (f32, the run's tokenizer in its metadata).
Both engines decode the same prompts (``bench_speculative``'s edit and free tasks, as token ids), one at a time,
greedy, 128 new tokens (``ignore_eos``):

    subquad       ``generate`` after ``compile_decode(faster=True)``, as ``--compile-decode`` asks for it (its
                  step and verification graphs built before timing; the faster of the compiled and the eager
                  step kept, timed in the first round's first steps), plain and with ``speculative="ngram"``
                  (``--draft-tokens``, prompt lookup of up to 3 tokens)
    llama-server  one slot (``-np 1 -t 2 -tb 2``), its native ``/completion`` route, plain and with
                  ``--spec-type ngram-simple`` twice: its defaults (a 12-token lookup, 48-token drafts) and set
                  as subquad's (``--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m`` draft tokens)

Each row: completion tokens over the requests' wall time (prefill included, for both), the median of
``--rounds`` rounds that run every mode in turn, and how many outputs equal subquad's plain greedy output.

    python benchmarks/bench_llama_speculative.py --llama-server /path/to/build/bin/llama-server
    python benchmarks/bench_llama_speculative.py --llama-server ... --quick     # 20 steps, 2 prompts: runs

Writes results/llama_speculative.{json,md}.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_serve import Server  # noqa: E402
from benchmarks.bench_speculative import TARGET, edit_prompts, free_prompts, prepare, train_or_load  # noqa: E402
from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402

MAMBA2 = {**TARGET, "pattern": "mamba2", "mlp": False}   # as Hugging Face's mamba2 (no MLP)


def llama_complete(port: int, prompt: list[int], n: int) -> list[int]:
    """Greedy ``n`` tokens after ``prompt`` from llama-server's native route (no prompt cache across requests)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True, "return_tokens": True,
                "cache_prompt": False}
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"llama-server {r.status}: {data}")
        return data["tokens"]
    finally:
        conn.close()


def timed(decode, prompts, n) -> dict:
    t = time.perf_counter()
    outs = [decode(p, n) for p in prompts]
    return {"tok_s": sum(map(len, outs)) / (time.perf_counter() - t), "outs": outs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, help="the llama-server binary")
    ap.add_argument("--steps", type=int, default=500, help="training steps of the model")
    ap.add_argument("--out", default=str(OUT / "speculative"), help="where the trained run is kept")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per task")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="20 training steps, 2 prompts, 24 tokens: the script runs")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.prompts, a.new_tokens, a.rounds = 20, 2, 24, 1
        a.out = str(Path(a.out) / "quick")
    torch.set_num_threads(2)
    from subquad.models.decode import compile_decode
    from subquad.models.gguf import save_gguf
    from subquad.models.speculative import verify

    model, tok = train_or_load(Path(a.out) / "target_mamba2", MAMBA2, a.steps, prepare(None, 4096, log=print), print)
    rng = random.Random(0)
    tasks = {"edit": edit_prompts(tok, a.prompts, rng), "free": free_prompts(tok, a.prompts, rng)}
    compile_decode(model, faster=True)
    with torch.no_grad():                         # the step's and the verification's graphs, before timing
        p = tasks["free"][0]
        model.generate(p, 4, temperature=0)
        _, state = model.prefill(torch.tensor([p[:8]]))
        verify(model, torch.tensor([p[:a.draft_tokens + 1]]), state)[1].accept(1)

    def subquad(spec):
        kw = {} if spec is None else {"speculative": spec, "draft_tokens": a.draft_tokens}
        return lambda p, n: model.generate(p, n, temperature=0, ignore_eos=True, **kw)[0]

    modes = {"subquad plain": None, "subquad ngram": None, "llama-server plain": [],
             "llama-server ngram-simple (defaults)": ["--spec-type", "ngram-simple"],
             "llama-server ngram-simple (n 3, m draft tokens)": ["--spec-type", "ngram-simple",
                                                                 "--spec-ngram-simple-size-n", 3,
                                                                 "--spec-ngram-simple-size-m", a.draft_tokens]}
    runs = {(task, m): [] for task in tasks for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "m.gguf"
        save_gguf(model, gguf, "f32", tokenizer=tok)
        servers = {}
        try:
            for m, flags in modes.items():
                if flags is not None:           # up together; idle ones wait on their sockets
                    servers[m] = Server(Path(tmp), command=[a.llama_server, "-m", str(gguf), "-t", "2", "-tb", "2",
                                                            "-np", "1", "-c", "4096", "--no-webui",
                                                            *map(str, flags)])
            for r in range(a.rounds):
                for task, prompts in tasks.items():
                    for m in modes:
                        if m.startswith("subquad"):
                            decode = subquad("ngram" if m.endswith("ngram") else None)
                        else:
                            decode = lambda p, n, port=servers[m].port: llama_complete(port, p, n)  # noqa: E731
                        runs[(task, m)].append(timed(decode, prompts, a.new_tokens))
                print(f"round {r + 1}/{a.rounds} done", flush=True)
        finally:
            for s in servers.values():
                s.stop()
    machine = machine_line(matmul_gflops())
    lines = [f"{MAMBA2['preset']} preset as Mamba-2, {a.steps} steps; batch 1, greedy, {a.new_tokens} new tokens, "
             f"draft tokens {a.draft_tokens}; median of {a.rounds} rounds; subquad's one-row step "
             f"{model._decode_step.chosen.get('1', 'not chosen')}; {machine}", "",
             "| task | engine | tokens/s | x its plain | = subquad plain | each round |",
             "|---|---|---:|---:|---:|---|"]
    rows = []
    for task in tasks:
        ref = runs[(task, "subquad plain")][-1]["outs"]
        for m in modes:
            tok_s = statistics.median(x["tok_s"] for x in runs[(task, m)])
            base = statistics.median(x["tok_s"] for x in runs[(task, m.split(" ")[0] + " plain")])
            same = sum(o == e for o, e in zip(runs[(task, m)][-1]["outs"], ref)) / len(ref)
            rows.append({"task": task, "engine": m, "tok_s": tok_s, "x_plain": tok_s / base, "same": same,
                         "rounds": [x["tok_s"] for x in runs[(task, m)]]})
            lines.append(f"| {task} | {m} | {tok_s:.1f} | {tok_s / base:.2f} | {100 * same:.0f}% | "
                         + " / ".join(f"{x['tok_s']:.0f}" for x in runs[(task, m)]) + " |")
        best = max((r for r in rows if r["task"] == task and r["engine"].startswith("llama-server ngram")),
                   key=lambda r: r["tok_s"])
        ours = next(r for r in rows if r["task"] == task and r["engine"] == "subquad ngram")
        ratio = ours["tok_s"] / best["tok_s"]
        lines.append(f"| {task} | subquad ngram / llama-server's best speculation | {ratio:.2f} | | | |")
    print("\n".join(lines))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "llama_speculative.json").write_text(json.dumps({"rows": rows, "machine": machine}, indent=1))
    (OUT / "llama_speculative.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
