"""Speculative decoding measured (``models.speculative``): tokens per model forward, acceptance and decode
tokens/s for prompt lookup ("ngram") and a draft model against plain decoding, at batch 1 and 8, greedy, on an
input-grounded task and on free continuation, with models trained here on the embedded corpus (random weights
would make acceptance meaningless).

    python benchmarks/bench_speculative.py                 # trains both models once (~10 min), then ~5 min
    python benchmarks/bench_speculative.py --quick         # a few training steps: checks the script runs
    python benchmarks/bench_speculative.py --eager         # the target eager (what generate and serve run
                                                           # without --compile-decode): results_eager.json

The target: the ``small`` preset as a hybrid (Mamba-2 and softmax attention, 6 layers of 256), the draft: the
``micro`` preset (4 layers of 128, GLA) on the same tokens and tokenizer; both trained ``--steps`` steps and kept
in ``--out`` (reused when there). The target decodes with its compiled step (``compile_decode``) in every mode,
and verifies through its compiled verification (``CompiledStep.verifier``, for ``draft_tokens`` and for the one
draft a row of a larger batch pads to, ``models.speculative.compiled_budget``; all built before timing). Then
the edit prompts go through the serving engine one at a time (a server with one user; ``serve_each``), and
``--served`` edit prompts at once (``serve.Engine``, one batch, greedy; one untimed round first, as a server that has
run a while), without and with per-row speculation (``speculative="ngram"``).

Tasks (prompts from the corpus' held-out split, never trained on):
- **edit** (input-grounded): a held-out standard-library function, then a comment asking for the same function
  with one parameter renamed, then the renamed signature line; the model continues the body (a model that
  copies its context well repeats most of it: what prompt lookup is for).
- **free**: 192 tokens of a held-out file; the model continues.

Each row: generated tokens / wall time (the prefill excluded; the median of ``--rounds`` rounds that run every
mode in turn), tokens per verification step, the drafts'
acceptance, and whether the output equals plain greedy decoding's (it must, up to float32 near-ties).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import OUT, machine_line, matmul_gflops  # noqa: E402
from subquad.data.corpus import stdlib_corpus  # noqa: E402
from subquad.data.dataset import prepare  # noqa: E402
from subquad.models import presets  # noqa: E402
from subquad.models.decode import compile_decode  # noqa: E402
from subquad.models.speculative import compiled_budget, verify  # noqa: E402
from subquad.train import load_run  # noqa: E402
from subquad.train.run import train_run  # noqa: E402
from subquad.train.trainer import TrainConfig  # noqa: E402

TARGET = {"preset": "small", "pattern": "mamba2,mamba2,softmax,mamba2,mamba2,softmax"}
DRAFT = {"preset": "micro", "pattern": "gla"}


def train_or_load(out: Path, spec: dict, steps: int, token_data, log, batch_size: int = 4):
    """The run in ``out`` (trained ``steps`` steps of ``batch_size`` windows first if it is not there)."""
    if not (out / "config.json").exists():
        cfg = presets.preset(spec["preset"], vocab_size=4096, **{k: v for k, v in spec.items() if k != "preset"})
        train_run(cfg, TrainConfig(steps=steps, batch_size=batch_size, eval_every=max(steps // 4, 1),
                                   ckpt_every=steps), out, token_data=token_data, log=log)
    model, tok, _ = load_run(out)
    return model.eval(), tok


def edit_prompts(tok, n: int, rng: random.Random) -> list[list[int]]:
    """Held-out functions of 8-30 lines with a parameter to rename: source, the request, the new signature."""
    out = []
    docs = [d for d in stdlib_corpus().heldout if d.lstrip().startswith(('"""', "#", "import", "from", "def", "class"))]
    rng.shuffle(docs)
    for doc in docs:
        try:
            tree = ast.parse(doc)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not 8 <= node.end_lineno - node.lineno <= 30:
                continue
            args = [a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 2]
            if not args:
                continue
            src = "\n".join(doc.splitlines()[node.lineno - 1:node.end_lineno])
            old = args[0]
            new = old + "_value"
            head = re.sub(rf"\b{old}\b", new, src.splitlines()[0])     # the parameter, not a name holding it
            # the prompt ends at the signature's colon: the tokenizer joins a newline and the body's indent into one
            # token, so a prompt ending in a bare newline token told the model the next line was not indented, and
            # it started another top-level definition instead of the body (none of the edit rows before
            # 2026-12-06 copied the function)
            text = f"{src}\n\n\n# The same function, with the parameter `{old}` renamed to `{new}`:\n{head}"
            ids = tok.encode(text).ids
            if len(ids) <= 400:
                out.append(ids)
            break
        if len(out) == n:
            return out
    return out


def free_prompts(tok, n: int, rng: random.Random) -> list[list[int]]:
    docs = [d for d in stdlib_corpus().heldout if len(d) > 4000]
    rng.shuffle(docs)
    return [tok.encode(d).ids[:192] for d in docs[:n]]


def run(model, prompts, new_tokens, batch, speculative=None, draft_tokens=4) -> dict:
    """Decode every prompt (in batches of ``batch``), greedy -> tokens/s, tokens per step, acceptance, outputs."""
    outs, t_total, gen, steps, emitted, drafted, accepted = [], 0.0, 0, 0, 0, 0, 0
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        with torch.no_grad():
            _, state = model.prefill(torch.tensor([group[0][:-1]])) if batch == 1 else (None, None)
        t = time.perf_counter()
        kw = {} if speculative is None else {"speculative": speculative, "draft_tokens": draft_tokens}
        out, _ = model.generate(group if batch > 1 else group[0], new_tokens, temperature=0, ignore_eos=True, **kw)
        t_total += time.perf_counter() - t
        out = out if batch > 1 else [out]
        outs += out
        gen += sum(len(o) for o in out)
        st = getattr(model, "speculation_stats", None) if speculative is not None else None
        if st is not None:
            steps, emitted = steps + st.row_steps, emitted + st.emitted
            drafted, accepted = drafted + st.drafted, accepted + st.accepted
        del state
    return {"tok_s": gen / t_total, "tokens_per_step": emitted / steps if steps else 1.0,
            "acceptance": accepted / drafted if drafted else float("nan"), "outs": outs}


def serve_run(model, prompts, new_tokens, speculative=None, draft_tokens=4) -> dict:
    """Every prompt through the serving engine at once (``serve.Engine``, one batch of len(prompts) rows, greedy),
    with or without per-row speculation -> completion tokens/s (prefill included), tokens per row and forward,
    acceptance, outputs."""
    from subquad.serve import Engine, SamplingParams

    engine = Engine(model, max_batch=len(prompts), state_cache_mb=0, speculative=speculative,
                    draft_tokens=draft_tokens, max_context=max(map(len, prompts)) + new_tokens)
    t = time.perf_counter()
    seqs = [engine.submit(p, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)) for p in prompts]
    while engine.step():
        pass
    wall = time.perf_counter() - t
    c = engine.counters
    return {"tok_s": c["generated_tokens"] / wall, "outs": [s.tokens for s in seqs],
            "tokens_per_step": (c["generated_tokens"] - len(prompts)) / max(c["decode_rows"], 1),
            "acceptance": c["accepted"] / c["drafted"] if c["drafted"] else float("nan")}


def serve_each(model, prompts, new_tokens, speculative=None, draft_tokens=4) -> dict:
    """``serve_run`` of each prompt alone, one after another (a server with one user) -> completion tokens/s over
    the requests' wall time, the mean tokens per row and forward and acceptance, outputs."""
    wall, gen, outs, per_step, acc = 0.0, 0, [], [], []
    for p in prompts:
        t = time.perf_counter()
        r = serve_run(model, [p], new_tokens, speculative, draft_tokens)
        wall += time.perf_counter() - t
        gen += len(r["outs"][0])
        outs += r["outs"]
        per_step.append(r["tokens_per_step"])
        acc += [] if r["acceptance"] != r["acceptance"] else [r["acceptance"]]
    return {"tok_s": gen / wall, "outs": outs, "tokens_per_step": statistics.mean(per_step),
            "acceptance": statistics.mean(acc) if acc else float("nan")}


def table_row(task, batch, mode, r, plain) -> dict:
    """One mode's result ``r`` against its plain mode's as a row of the results (printed as the table's line)."""
    same = sum(a == b for a, b in zip(r["outs"], plain["outs"], strict=True)) / len(r["outs"])
    row = {"task": task, "batch": batch, "mode": mode, "tok_s": r["tok_s"], "speedup": r["tok_s"] / plain["tok_s"],
           "tokens_per_step": r["tokens_per_step"], "acceptance": r["acceptance"], "same": same,
           "rounds": r["rounds"]}
    print(f"| {task} | {batch} | {mode} | {r['tok_s']:.1f} | {row['speedup']:.2f} | {r['tokens_per_step']:.2f} | "
          f"{r['acceptance']:.2f} | {100 * same:.0f}% | {' / '.join(f'{x:.0f}' for x in r['rounds'])} |", flush=True)
    return row


def interleaved(measure, modes, rounds: int) -> dict:
    """{mode: measure(spec)'s result with the median tokens/s of ``rounds`` rounds}, the modes run in turn in each
    round (this host's timings drift 10-25% within minutes: interleaving spreads the drift over every mode)."""
    runs = {mode: [] for mode, _ in modes}
    for _ in range(rounds):
        for mode, spec in modes:
            runs[mode].append(measure(spec))
    return {mode: {**r[-1], "tok_s": statistics.median(x["tok_s"] for x in r), "rounds": [x["tok_s"] for x in r]}
            for mode, r in runs.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500, help="training steps of each model")
    ap.add_argument("--batch-size", type=int, default=4, help="training windows per step (of the preset's context)")
    ap.add_argument("--out", default=str(OUT / "speculative"), help="where the two runs are kept")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per task")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--served", type=int, default=16, help="edit prompts served at once through serve.Engine")
    ap.add_argument("--draft-tokens", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every mode; the median tokens/s")
    ap.add_argument("--quick", action="store_true", help="20 training steps, 2 prompts, 24 tokens: the script runs")
    ap.add_argument("--eager", action="store_true", help="the target without compile_decode: eager steps and "
                    "verifications")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.new_tokens, args.served, args.rounds = 20, 2, 24, 4, 1
        args.out = str(Path(args.out) / "quick")
    torch.set_num_threads(2)
    out = Path(args.out)
    td = prepare(None, 4096, log=print)
    target, tok = train_or_load(out / "target", TARGET, args.steps, td, print, args.batch_size)
    draft, _ = train_or_load(out / "draft", DRAFT, args.steps, td, print, args.batch_size)
    t = time.perf_counter()
    if not args.eager:
        compile_decode(target)
    compile_s = time.perf_counter() - t
    rng = random.Random(0)
    tasks = {"edit": edit_prompts(tok, args.prompts, rng), "free": free_prompts(tok, args.prompts, rng)}
    t = time.perf_counter()                     # the compiled step's graphs (batch 1, batch >= 2) before timing
    for batch in (1, 2):
        target.generate(tasks["free"][0] if batch == 1 else tasks["free"][:2], 4, temperature=0)
    compile_s += time.perf_counter() - t
    t = time.perf_counter()                     # and the compiled verification's, for draft_tokens + 1 tokens
    with torch.no_grad():                       # (and at larger batches the fewer of compiled_budget)
        for batch, k in sorted({(1, args.draft_tokens), (2, args.draft_tokens),
                                (2, compiled_budget(target, max(8, args.served), args.draft_tokens))}):
            ids = torch.tensor([tasks["free"][0][:8]] * batch)
            _, state = target.prefill(ids)
            verify(target, ids[:, :k + 1], state)[1].accept(1)
    verify_s = time.perf_counter() - t
    gflops = matmul_gflops()
    print(machine_line(gflops))
    print(f"target {TARGET}, draft {DRAFT}, {args.steps} training steps each; "
          + ("eager (no compile_decode); " if args.eager else
             f"compile_decode {compile_s:.1f} s, its verification's graphs {verify_s:.1f} s; ")
          + f"{args.new_tokens} new tokens per prompt, greedy, draft_tokens={args.draft_tokens}")
    print("| task | batch | mode | tokens/s | x plain | tokens/step | acceptance | = plain | each round |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    rows = []
    modes = (("plain", None), ("ngram", "ngram"), ("draft model", draft))
    for task, prompts in tasks.items():
        for batch in (1, min(8, len(prompts))):
            res = interleaved(lambda spec: run(target, prompts, args.new_tokens, batch, spec, args.draft_tokens),
                              modes, args.rounds)
            rows += [table_row(task, batch, mode, res[mode], res["plain"]) for mode, _ in modes]
    served = edit_prompts(tok, args.served, random.Random(1))
    for spec in (None, "ngram"):                # untimed: a server that has run a while (the verification at
        serve_run(target, served, args.new_tokens, spec, args.draft_tokens)   # 16 rows is slow its first calls)
    for batch, measure in ((1, lambda spec: serve_each(target, tasks["edit"], args.new_tokens, spec,
                                                       args.draft_tokens)),
                           (len(served), lambda spec: serve_run(target, served, args.new_tokens, spec,
                                                                args.draft_tokens))):
        res = interleaved(measure, (("served plain", None), ("served ngram", "ngram")), args.rounds)
        rows += [table_row("edit", batch, mode, res[mode], res["served plain"]) for mode in res]
    name = "_eager" if args.eager else ""
    (out / f"results{name}.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / f"speculative{name}.png")
    print(f"plot: {out / f'speculative{name}.png'}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = [{**r, "batch": f"{r['batch']} served", "mode": r["mode"].split()[1]}
              for r in rows if r["mode"].startswith("served")]
    rows = [r for r in rows if not r["mode"].startswith("served")] + served
    keys = sorted({(r["task"], str(r["batch"])) for r in rows})
    rows = [{**r, "batch": str(r["batch"])} for r in rows]
    modes = ["plain", "ngram", "draft model"]
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        vals = [next((r["speedup"] for r in rows if (r["task"], r["batch"]) == k and r["mode"] == mode), 0.0)
                for k in keys]
        ax.bar([i + j * w for i in range(len(keys))], vals, w, label=mode)
    ax.set_xticks([i + w for i in range(len(keys))], [f"{t}, batch {b}" for t, b in keys])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("decode tokens/s / plain")
    ax.set_title("speculative decoding, greedy (bench_speculative.py)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
