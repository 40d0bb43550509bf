"""Prefix checkpoints in the server's engine: many users sharing one long system prompt.

    python benchmarks/bench_prefix.py                  # 64 users, a 2,048-token system prompt, 64-token questions
    python benchmarks/bench_prefix.py --block-sweep    # the cost of a checkpoint against the tokens it saves
    python benchmarks/bench_prefix.py --quick          # a smoke run (8 users, 256 tokens)

Users: each prompt is the shared system prompt then the user's own question (random token ids), greedy, a fixed
number of new tokens. Two arrivals: a burst (every user submitted at once: the engine admits --max-batch at a
time, prefills one request at a time in --prefill-chunk pieces between decoding steps) and one at a time (each
user alone in the engine, after the previous one's answer). Reported: the median time to first token with the
prefix cache and with ``--state-cache-mb 0`` (the issue's target: <= 0.2x), the cached tokens per user, and
whether every answer equals ``LanguageModel.generate`` run alone (a difference is counted as a tie when the
two best logits at the first differing token are within 1e-6 of the logits' scale).

The engine runs in this process, stepped by this thread (no HTTP: the cost measured is the engine's), on a
small random hybrid (Mamba-2 and attention layers). Bounded: --time-limit seconds for each run, after which it
stops and reports what it has.

``--block-sweep``: for each --prefix-block, a cold 2,112-token request (the prefill in block-sized pieces plus
a checkpoint at each block: their cost against the cache off), the bytes the cache then holds, and the time to
first token of requests that share a random 1,500-2,047 tokens with it and then diverge (what the block saves:
on average block/2 tokens are prefilled again).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def model_of(quick: bool):
    import torch

    from subquad.models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=1024, d_model=64 if quick else 256, n_layers=3 if quick else 6, n_heads=4,
                      n_kv_heads=2, pattern="mamba2,softmax,mamba2" if quick else
                      "mamba2,mamba2,softmax,mamba2,mamba2,softmax",
                      mixer_options={"softmax": {"rotary_fraction": 0.5}, "mamba2": {"norm_eps": 1e-6}})
    return LanguageModel(cfg).eval()


def run_engine(model, prompts, max_tokens, *, burst, cache_mb, block, max_batch, prefill_chunk, time_limit):
    """(time to first token per user, cached tokens per user, answers); None where a user did not finish."""
    from subquad.serve import Engine, SamplingParams

    engine = Engine(model, max_batch=max_batch, max_queue=len(prompts), max_context=8192,
                    prefill_chunk=prefill_chunk, state_cache_mb=cache_mb, prefix_block=block)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    end = time.monotonic() + time_limit
    seqs = []
    if burst:
        seqs = [engine.submit(p, params) for p in prompts]
        while engine.step() and time.monotonic() < end:
            pass
    else:
        for p in prompts:
            if time.monotonic() >= end:
                break
            seqs.append(engine.submit(p, params))
            while engine.step() and time.monotonic() < end:
                pass
    out = []
    for s in seqs:
        done = s.finish_reason is not None and s.first_token_at is not None
        out.append((s.first_token_at - s.submitted if done else None, s.cached_tokens, s.tokens if done else None))
    return out, engine


def compare(model, prompt, got, max_tokens):
    """"equal", "tie" or "differ": ``got`` against ``generate`` alone."""
    import torch

    want = model.generate(prompt, max_tokens, temperature=0, ignore_eos=True)[0]
    if got == want:
        return "equal"
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    with torch.no_grad():
        logits = model.prefill(torch.tensor([prompt + want[:i]]), logits="last")[0][0]
    top = logits.topk(2).values
    return "tie" if float(top[0] - top[1]) <= 1e-6 * float(logits.abs().max()) else "differ"


def users(args):
    rng = random.Random(0)
    system = [rng.randrange(1024) for _ in range(args.system)]
    return [system + [rng.randrange(1024) for _ in range(args.question)] for _ in range(args.users)]


def main_users(args, model):
    prompts = users(args)
    print(f"{args.users} users, a {args.system}-token system prompt, {args.question}-token questions, "
          f"{args.max_tokens} new tokens; max_batch {args.max_batch}, prefill_chunk {args.prefill_chunk}, "
          f"prefix_block {args.block}")
    rows, answers = [], {}
    for burst in (True, False):
        med = {}
        for cache_mb in (args.state_cache_mb, 0):
            t0 = time.monotonic()
            out, _ = run_engine(model, prompts, args.max_tokens, burst=burst, cache_mb=cache_mb, block=args.block,
                                max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                                time_limit=args.time_limit)
            ttft = [t for t, _, _ in out if t is not None]
            med[cache_mb] = statistics.median(ttft) if ttft else float("nan")
            cached = statistics.median(c for _, c, _ in out) if out else 0
            for i, (_, _, toks) in enumerate(out):
                if toks is not None:
                    answers.setdefault(i, set()).add(tuple(toks))
            rows.append(("burst" if burst else "one at a time", cache_mb, len(ttft), med[cache_mb], cached,
                         time.monotonic() - t0))
        rows[-1] += (med[args.state_cache_mb] / med[0],)
    print("\n| arrival | --state-cache-mb | users done | median TTFT (s) | median cached tokens | run (s) | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = f"{r[6]:.3f}x" if len(r) > 6 else ""
        print(f"| {r[0]} | {r[1]:g} | {r[2]} | {r[3]:.3f} | {r[4]:.0f} | {r[5]:.1f} | {ratio} |")
    verdict = {"equal": 0, "tie": 0, "differ": 0}
    t0 = time.monotonic()
    for i, seen in sorted(answers.items()):
        for toks in seen:
            verdict[compare(model, prompts[i], list(toks), args.max_tokens)] += 1
    print(f"\nanswers against generate alone ({time.monotonic() - t0:.1f} s): {verdict}")
    ratios = [r[6] for r in rows if len(r) > 6]
    print(f"median TTFT with the cache / without (target <= 0.2x): {', '.join(f'{x:.3f}x' for x in ratios)} - "
          f"{'within' if max(ratios) <= 0.2 else 'over'} it in this run (a timing on a shared machine is no claim)")


def main_sweep(args, model):
    rng = random.Random(1)
    base = [rng.randrange(1024) for _ in range(args.system + args.question)]
    forks = [base[:n] + [rng.randrange(1024) for _ in range(args.question)]
             for n in (rng.randrange(1500 * args.system // 2048, args.system) for _ in range(args.forks))]
    print(f"a cold {len(base)}-token request, then {len(forks)} requests sharing a random "
          f"{1500 * args.system // 2048}-{args.system - 1} tokens with it; prefill_chunk {args.prefill_chunk}")
    print("\n| --prefix-block | cold TTFT (s) | cache bytes | mean cached of shared | mean TTFT of the forks (s) |")
    print("|---:|---:|---:|---:|---:|")
    for block in (0, *args.blocks):
        cache_mb = args.state_cache_mb if block else 0
        cold, forked = [], []
        for _ in range(args.repeats):
            out, engine = run_engine(model, [base] + forks, 1, burst=False, cache_mb=cache_mb, block=block or 256,
                                     max_batch=1, prefill_chunk=args.prefill_chunk, time_limit=args.time_limit)
            cold.append(out[0][0])
            forked.append(out[1:])
        shared = [min(len(f) - args.question, len(f) - 1) for f in forks]
        cached = statistics.mean(c / s for run in forked for (_, c, _), s in zip(run, shared))
        fork_t = statistics.mean(t for run in forked for t, _, _ in run)
        print(f"| {block or 'cache off'} | {min(cold):.3f} | {engine.cache.nbytes:,} | {cached:.1%} | {fork_t:.3f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--block-sweep", action="store_true")
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--block", type=int, default=None, help="--prefix-block (default: the engine's)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--state-cache-mb", type=float, default=256.0)
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per run, then report what it has")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.system, args.question, args.max_tokens = 8, 256, 16, 4
        args.blocks, args.forks, args.repeats = [32, 128], 2, 1
    import torch

    from subquad.serve.engine import PREFIX_BLOCK

    args.block = args.block or PREFIX_BLOCK
    torch.set_num_threads(args.threads)
    model = model_of(args.quick)
    with torch.no_grad():
        (main_sweep if args.block_sweep else main_users)(args, model)


if __name__ == "__main__":
    main()
