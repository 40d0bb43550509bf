"""Passkey retrieval (``subquad.tasks.passkey``) on the workshop's models and on models trained for the task,
and passkey evaluation time against length.

Three parts, each its own command:

    python benchmarks/bench_passkey.py curriculum   # train tiny models on the task, then sweep lengths x depths
    python benchmarks/bench_passkey.py workshop     # sweep the workshop-shaped runs in --runs (trained elsewhere)
    python benchmarks/bench_passkey.py timing       # seconds per passkey trial against prompt length
    python benchmarks/bench_passkey.py attention --run DIR   # where a hybrid's attention layer looks
    python benchmarks/bench_passkey.py curriculum --quick   # the test's size: seconds

The curriculum. Every model is trained from scratch on passkey prompts alone (``passkey_batch``: the filler,
the needle at a uniform random depth, the question), with the loss on the key's tokens only (the answer, and
the key's copy inside the needle), through a short curriculum of prompt lengths (``--stages``: the default
64:800,128:300,256:100 is 800 steps at 64 tokens, then 300 at 128, then 100 at 256), AdamW with a linear warmup
and a cosine decay over all stages. The tokenizer is the workshop's (the stdlib corpus's BPE, 4,096), so the
prompts are the ones ``subquad eval --passkey`` builds. Each model is saved as a run folder (``ckpt/``,
``tokenizer.json``) that ``subquad eval --run DIR --passkey`` reads, then swept over ``--lengths`` (past the
longest trained) and ``--depths``; its heat map is results/passkey_NAME_toLONGEST.png. Models (``--models``,
names from MODELS): a softmax transformer (rotary), fixed-state models, and hybrids with one softmax layer.

Writes results/passkey_{curriculum,workshop,timing}.{json,md} (``--name`` renames them).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import OUT, machine_line  # noqa: E402

# name -> (layer pattern, mixer options); every model is otherwise the same: d_model 64, 2 heads of 32, SwiGLU MLPs.
# "_conv": a short causal convolution (4) on GLA's q, k, v, as Zoology's protocol and fla's layers have
# (subquad.bench.recall); "hybrid_nope": Jamba's choice, attention without positions (the recurrent layer before
# it supplies order).
CONV = {"gla": {"conv_size": 4}}
MODELS = {
    "softmax": ("softmax,softmax", {}),
    "gla": ("gla,gla", {}),
    "gla_conv": ("gla,gla", CONV),
    "mamba2": ("mamba2,mamba2", {}),
    "gated_deltanet": ("gated_deltanet,gated_deltanet", {}),
    "hybrid": ("gla,softmax", {}),
    "hybrid_conv": ("gla,softmax", CONV),
    "hybrid_nope": ("gla,softmax", {**CONV, "softmax": {"rotary": False}}),
}


def tokenizer(data=None):
    """The workshop's tokenizer (the stdlib corpus's byte-level BPE, 4,096): (its path, encode)."""
    from subquad.data.dataset import prepare
    from subquad.data.tokenizer import load_tokenizer

    td = prepare(data, 4096, log=lambda m: None)
    path, tok = Path(td.tokenizer_path), load_tokenizer(td.tokenizer_path)
    return path, (lambda s: tok.encode(s).ids)


def curriculum_model(pattern: str, d_model: int = 64, n_layers: int = 2, vocab: int = 4096, seed: int = 0,
                     options: dict | None = None):
    from subquad.models import LanguageModel, ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=max(1, d_model // 32),
                      pattern=pattern, mixer_options=options or {}, context_length=max(256, d_model))
    return LanguageModel(cfg)


def parse_stages(text: str) -> list[tuple[int, int]]:
    """"64:300,128:300" -> [(64, 300), (128, 300)]: (prompt length, steps) per stage, in order."""
    stages = []
    for item in text.split(","):
        length, _, steps = item.partition(":")
        stages.append((int(length), int(steps)))
    if not stages or any(n < 40 or s < 1 for n, s in stages):
        raise ValueError(f"--stages takes LENGTH:STEPS,... with lengths >= 40 and steps >= 1, got {text!r}")
    return stages


def train_curriculum(model, encode, stages, batch: int = 32, lr: float = 3e-3, warmup: int = 50, seed: int = 0,
                     repeat: bool = True, log=print) -> list[dict]:
    """Train ``model`` on passkey batches, stage by stage; the loss is the cross-entropy of the key's tokens: the
    answer's, and with ``repeat`` its copy inside the needle too (``passkey_batch``). Returns the curve: every
    ``max(1, steps // 20)`` steps, the stage's length, the mean loss since the last point, and in those batches
    the fraction of answers whose every token was predicted right (teacher-forced, which is then what greedy
    decoding answers) and the fraction of key tokens right."""
    from subquad.tasks.passkey import passkey_batch

    rng = random.Random(seed)
    total = sum(s for _, s in stages)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))
    every, curve, step, t0 = max(1, total // 20), [], 0, time.perf_counter()
    loss_sum, right, count, keys, rows = 0.0, 0, 0, 0, 0
    model.train()
    for length, steps in stages:
        for _ in range(steps):
            x, y = passkey_batch(encode, length, batch, rng, repeat=repeat)
            mask = y != -100
            h, _ = model._hidden(x)                              # (B, T, D)
            logits = model._logits(h[mask])                      # (key tokens, vocab): the head only where read
            loss = torch.nn.functional.cross_entropy(logits, y[mask])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            loss_sum += loss.item()
            hit = torch.full_like(y, -1)                         # (B, T): 1 right, 0 wrong, -1 no target
            hit[mask] = (logits.argmax(-1) == y[mask]).long()
            keys += int((hit[:, length - 1:] != 0).all(1).sum())  # the answer: from the question's last token on
            rows += x.shape[0]
            right += int((hit == 1).sum())
            count += int(mask.sum())
            if step % every == 0 or step == total:
                point = {"step": step, "length": length, "loss": loss_sum / every, "key_accuracy": keys / rows,
                         "token_accuracy": right / count, "seconds": round(time.perf_counter() - t0, 1)}
                curve.append(point)
                log(f"    step {step}/{total} (length {length}): loss {point['loss']:.3f}, answers right "
                    f"{point['key_accuracy']:.2f}, key tokens right {point['token_accuracy']:.2f}, "
                    f"{point['seconds']:.0f} s")
                loss_sum, right, count, keys, rows = 0.0, 0, 0, 0, 0
    model.eval()
    return curve


def save_run(model, tok_path: Path, run: Path, step: int, extra: dict) -> None:
    """A run folder ``subquad eval --run`` reads: the checkpoint and the tokenizer."""
    import shutil

    from subquad.train.checkpoint import save_checkpoint

    run.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tok_path, run / "tokenizer.json")
    opt = torch.optim.AdamW(model.parameters())                 # an empty optimizer: the run is for evaluation
    save_checkpoint(run, step, model, opt, {"model_config": model.config.to_dict(), **extra})


def table(rows: list[dict]) -> str:
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    acc = {(r["length"], r["depth"]): r for r in rows}
    lines = ["| length | " + " | ".join(f"depth {d:.2f}" for d in depths) + " | mean | state bytes |",
             "|---" * (len(depths) + 3) + "|"]
    for n in lengths:
        cells = [acc[(n, d)] for d in depths if (n, d) in acc]
        mean = sum(c["accuracy"] for c in cells) / len(cells)
        lines.append(f"| {n:,} | " + " | ".join(f"{c['accuracy']:.2f}" for c in cells)
                     + f" | {mean:.2f} | {cells[-1]['state_bytes']:,} |")
    return "\n".join(lines)


def sweep(model, encode, lengths, depths, trials, name, log=print) -> list[dict]:
    from subquad.tasks.passkey import passkey_sweep

    t0 = time.perf_counter()
    rows = passkey_sweep(model, encode, lengths, depths, trials=trials, seed=1,
                         progress=lambda r: log(f"    {name}: length {r['length']}, depth {r['depth']:.2f}: "
                                                f"{r['accuracy']:.2f}"))
    log(f"    {name}: swept in {time.perf_counter() - t0:.0f} s")
    return rows


def cmd_curriculum(args) -> dict:
    from subquad.tasks.passkey import heatmap

    tok_path, encode = tokenizer(args.data)
    stages = parse_stages(args.stages)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    result = {"machine": machine_line(), "date": time.strftime("%Y-%m-%d"), "stages": stages,
              "batch": args.batch, "lr": args.lr, "d_model": args.d_model, "n_layers": args.n_layers,
              "trials": args.trials, "models": {}}
    for name in args.models.split(","):
        pattern, options = MODELS[name]
        model = curriculum_model(pattern, args.d_model, args.n_layers, seed=args.seed, options=options)
        print(f"[{name}] {pattern} {options or ''}, {model.num_parameters():,} parameters; curriculum {args.stages}, "
              f"batch {args.batch}, lr {args.lr}", flush=True)
        t0 = time.perf_counter()
        curve = train_curriculum(model, encode, stages, args.batch, args.lr, seed=args.seed,
                                 log=lambda m: print(m, flush=True))
        train_s = time.perf_counter() - t0
        if args.runs:
            save_run(model, tok_path, Path(args.runs) / name, sum(s for _, s in stages),
                     {"passkey_curriculum": {"stages": stages, "pattern": pattern}})
        rows = sweep(model, encode, lengths, depths, args.trials, name, log=lambda m: print(m, flush=True))
        result["models"][name] = {"pattern": pattern, "mixer_options": options, "parameters": model.num_parameters(),
                                  "curve": curve, "train_seconds": round(train_s, 1), "rows": rows}
        if not args.quick:
            longest = max(n for n, _ in stages)
            heatmap(rows, OUT / f"passkey_{name}_to{longest}.png", f"passkey, trained for it: {name} ({pattern}), "
                                                                   f"trained to {longest} tokens")
        print(table(rows), flush=True)
    return result


def cmd_workshop(args) -> dict:
    """Sweep the workshop-shaped runs found in --runs (each a run folder, by name)."""
    from subquad.tasks.passkey import heatmap
    from subquad.train import load_run

    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    result = {"machine": machine_line(), "date": time.strftime("%Y-%m-%d"), "trials": args.trials, "models": {}}
    for run in sorted(Path(args.runs).iterdir()):
        if not (run / "ckpt").exists():
            continue
        model, tok, meta = load_run(run)
        encode = lambda s, tok=tok: tok.encode(s).ids                   # noqa: E731
        print(f"[{run.name}] {meta['model_config']['pattern']}, step {meta['step']}", flush=True)
        rows = sweep(model, encode, lengths, depths, args.trials, run.name, log=lambda m: print(m, flush=True))
        result["models"][run.name] = {"pattern": meta["model_config"]["pattern"], "step": meta["step"],
                                      "heldout_loss": (meta.get("curve") or [[None, None]])[-1][1], "rows": rows}
        heatmap(rows, OUT / f"passkey_workshop_{run.name}.png", f"passkey, workshop run: {run.name}")
        print(table(rows), flush=True)
    return result


def cmd_timing(args) -> dict:
    """Seconds of one passkey trial (``answer``: prefill in pieces of 2,048, then the key's tokens decoded) per
    model and prompt length, the median of --repeats."""
    from subquad.tasks.passkey import answer, passkey_prompt
    from subquad.train import load_run

    lengths = [int(x) for x in args.lengths.split(",")]
    result = {"machine": machine_line(), "date": time.strftime("%Y-%m-%d"), "rows": []}
    for run in [Path(p) for p in args.run]:
        model, tok, meta = load_run(run)
        encode = lambda s, tok=tok: tok.encode(s).ids                   # noqa: E731
        for n in lengths:
            ids, want, _ = passkey_prompt(encode, n, 0.5, 48213)
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                _, nbytes = answer(model, ids, len(want))
                times.append(time.perf_counter() - t)
            s = sorted(times)[len(times) // 2]
            row = {"model": run.name, "pattern": meta["model_config"]["pattern"], "length": n, "seconds": s,
                   "tokens_per_s": n / s, "state_bytes": nbytes}
            result["rows"].append(row)
            print(f"    {run.name}: {n:,} tokens in {s:.3f} s ({n / s:,.0f} tokens/s), state {nbytes:,} bytes",
                  flush=True)
    return result


def cmd_attention(args) -> dict:
    """Where a hybrid's attention layer looks from the question's last token: for each --run whose layer
    ``--layer`` is softmax attention without rotary positions (``hybrid_nope``), the weight each head puts on the
    key's first copy and the key's best score against the filler's best, per length and depth (one key)."""
    from subquad.tasks.passkey import NEEDLE, QUESTION, passkey_prompt
    from subquad.train import load_run

    result = {"machine": machine_line(), "date": time.strftime("%Y-%m-%d"), "rows": []}
    for run in [Path(p) for p in args.run]:
        model, tok, _ = load_run(run)
        encode = lambda s, tok=tok: tok.encode(s).ids                   # noqa: E731
        att = model.blocks[args.layer].mixer
        if getattr(att, "rotary", True) or att.qk_norm or att.output_gate:   # scores read as q k^T / sqrt(K)
            raise ValueError(f"{run}: layer {args.layer} is not plain softmax attention without positions")
        seen = {}
        hook = att.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
        H, K = att.n_heads, att.head_dim
        for n in [int(x) for x in args.lengths.split(",")]:
            for depth in [float(x) for x in args.depths.split(",")]:
                ids, want, at = passkey_prompt(encode, n, depth, 48213)
                with torch.no_grad():
                    model.prefill(torch.tensor(ids).view(1, -1))
                    x = seen["x"][0]                                    # (T, D): the layer's input
                    q = att.q_proj(x[-1:]).view(H, K)                   # the question's last token
                    k = att.k_proj(x).view(-1, H, K)                    # (T, H, K)
                    score = torch.einsum("hk,thk->ht", q, k) * K ** -0.5     # (H, T)
                key = slice(at + len(encode("The pass key is")), at + len(encode("The pass key is")) + len(want))
                needle = slice(at, at + len(encode(NEEDLE.format(key=48213))))
                filler = torch.cat([score[:, :needle.start], score[:, needle.stop:n - len(encode(QUESTION))]], 1)
                row = {"model": run.name, "length": n, "depth": depth,
                       "weight_on_key": score.softmax(-1)[:, key].sum(-1).tolist(),
                       "key_best_score": score[:, key].max(-1).values.tolist(),
                       "filler_best_score": filler.max(-1).values.tolist()}
                result["rows"].append(row)
                print(f"    {run.name} {n} depth {depth}: weight on the key per head "
                      f"{[round(w, 3) for w in row['weight_on_key']]}, best score key "
                      f"{[round(v, 1) for v in row['key_best_score']]} / filler "
                      f"{[round(v, 1) for v in row['filler_best_score']]}", flush=True)
        hook.remove()
    return result


def distance_split(rows: list[dict], encode_lengths: dict, trained: int) -> dict:
    """Accuracy of the cells longer than ``trained`` split by how far the needle starts before the question's
    end: within ``trained`` tokens, or farther. ``encode_lengths``: {"needle": n, "question": q} in tokens."""
    near, far = [], []
    for r in rows:
        if r["length"] <= trained:
            continue
        room = r["length"] - encode_lengths["needle"] - encode_lengths["question"]
        distance = r["length"] - round(r["depth"] * room)
        (near if distance <= trained else far).append(r["accuracy"])
    mean = lambda xs: None if not xs else sum(xs) / len(xs)          # noqa: E731
    return {"near": mean(near), "near_cells": len(near), "far": mean(far), "far_cells": len(far)}


def markdown(part: str, result: dict) -> str:
    """The tables of a part's result, as RESULTS.md quotes them."""
    out = [f"`{result.get('command', '')}` ({result['date']}; {result['machine']})", ""]
    if part == "attention":
        out += ["| model | length | depth | weight on the key, per head | key's best score | filler's best score |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['length']:,} | {r['depth']:.2f} | "
                + " | ".join(", ".join(f"{v:.{d}f}" for v in r[c]) for c, d in
                             (("weight_on_key", 3), ("key_best_score", 1), ("filler_best_score", 1))) + " |"
                for r in result["rows"]]
        return "\n".join(out) + "\n"
    if part == "timing":
        out += ["| model | pattern | length | seconds per trial | tokens/s | state bytes |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['model']} | {r['pattern']} | {r['length']:,} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | "
                f"{r['state_bytes']:,} |" for r in result["rows"]]
        return "\n".join(out) + "\n"
    for name, m in result["models"].items():
        opts = m.get("mixer_options")
        out += [f"**{name}** (`{m['pattern']}`{f' {opts}' if opts else ''}"
                + (f", {m['parameters']:,} parameters, trained {m['train_seconds']:.0f} s, answers right at the end "
                   f"of training {m['curve'][-1]['key_accuracy']:.2f}" if "curve" in m else
                   f", step {m['step']}, held-out loss {m['heldout_loss']:.3f}") + ")", "", table(m["rows"]), ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=["curriculum", "workshop", "timing", "attention"])
    p.add_argument("--layer", type=int, default=1, help="attention: the hybrid's softmax layer")
    p.add_argument("--models", default="softmax,gla,hybrid", help=f"curriculum: some of {', '.join(MODELS)}")
    p.add_argument("--stages", default="64:800,128:300,256:100", help="curriculum: LENGTH:STEPS per stage")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="the corpus whose tokenizer the prompts use (default: stdlib)")
    p.add_argument("--runs", default=None, help="curriculum: save the models as run folders here; workshop: the "
                                                "folder of workshop runs to sweep")
    p.add_argument("--run", action="append", default=[], help="timing: a run folder (repeatable)")
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timing: trials per length (the median is reported)")
    p.add_argument("--name", default=None, help="results/passkey_NAME.{json,md} (default: the part)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, no files: the test's check")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.stages, args.batch, args.d_model, args.lengths, args.depths, args.trials = \
            "96:3,128:3", 4, 32, "128,192", "0,1", 1
    result = {"curriculum": cmd_curriculum, "workshop": cmd_workshop, "timing": cmd_timing,
              "attention": cmd_attention}[args.part](args)
    result["command"] = "python benchmarks/bench_passkey.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if not args.quick:
        name = args.name or args.part
        (OUT / f"passkey_{name}.json").write_text(json.dumps(result, indent=1))
        (OUT / f"passkey_{name}.md").write_text(markdown(args.part, result))
        print(f"wrote {OUT / f'passkey_{name}.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
