"""``subquad eval``: held-out loss of a run, perplexity of a text under a model folder, passkey retrieval,
or lm-evaluation-harness tasks."""

from __future__ import annotations

import math

from subquad.cli.common import (
    add_model_flags,
    check_run_or_model,
    load_model,
    load_run_as_asked,
    model_dtype,
    positive,
    say,
    token_count,
)


def add_parser(command) -> None:
    e = command("eval", "held-out loss of a trained run, or the perplexity of a text under a model folder")
    add_model_flags(e, [], model_help="a Hugging Face model folder (with tokenizer.json) or a GGUF file "
                    "(with a tokenizer in its metadata): perplexity of --data")
    e.add_argument("--data", help="corpus (default: the run's); with --model, a local text file")
    e.add_argument("--piece", type=positive, default=1024,
                   help="with --model: tokens per forward, the state carried between them")
    e.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated (the `eval` extra): scores "
                                   "--run or --model on them (subquad.harness)")
    e.add_argument("--limit", type=positive, help="with --tasks: at most this many documents per task")
    e.add_argument("--passkey", action="store_true", help="passkey retrieval by --lengths and --depths "
                                                            "(subquad.tasks.passkey)")
    e.add_argument("--lengths", default="1K,4K", help="with --passkey: prompt lengths, e.g. 1K,4K,16K")
    e.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="with --passkey: needle depths in [0, 1]")
    e.add_argument("--trials", type=positive, default=5, help="with --passkey: keys per cell")
    e.add_argument("--out", help="with --passkey: a folder for passkey.json and the heat map passkey.png")
    e.add_argument("--include-path", help="with --tasks: a folder of task YAML files of your own")
    e.add_argument("--batches", type=positive, help="held-out batches (default: the run's eval_batches, as in "
                                                      "training)")
    e.add_argument("--batch-size", type=positive, help="sequences per batch (default: the run's)")
    e.set_defaults(fn=run, parser=e)


# the flags only some of eval's modes read, and those modes: one given to another mode would change nothing
_MODE_FLAGS = {"piece": ("perplexity", "passkey"), "limit": ("tasks",), "include_path": ("tasks",),
               "lengths": ("passkey",), "depths": ("passkey",), "trials": ("passkey",), "out": ("passkey",),
               "batches": ("held-out loss",), "batch_size": ("held-out loss", "tasks"),
               "data": ("held-out loss", "perplexity")}


def _check_flags_of_mode(args) -> None:
    mode = ("passkey" if args.passkey else "tasks" if args.tasks is not None
            else "perplexity" if args.model is not None else "held-out loss")
    for dest, modes in _MODE_FLAGS.items():
        if mode not in modes and getattr(args, dest) != args.parser.get_default(dest):
            flag = "--" + dest.replace("_", "-")
            where = {"perplexity": "--model's perplexity", "passkey": "--passkey", "tasks": "--tasks",
                     "held-out loss": "--run's held-out loss"}
            raise ValueError(f"{flag} applies to {' and '.join(where[m] for m in modes)}, not to {where[mode]}, "
                             f"where it would change nothing")


def run(args) -> int:
    import json
    from pathlib import Path

    from subquad.data.dataset import prepare
    from subquad.train import evaluate, run_folder
    from subquad.train.trainer import packing_eot

    check_run_or_model(args)
    _check_flags_of_mode(args)
    if args.passkey:
        return _eval_passkey(args)
    if args.tasks is not None:
        return _eval_tasks(args)
    if args.model is not None:
        return _eval_model(args)
    model, tok, meta = load_run_as_asked(args)
    train = meta.get("train_config", {})
    run_dir = run_folder(args.run) or Path(args.run).parent.parent
    try:
        cfg = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    except ValueError as e:
        raise ValueError(f"{run_dir / 'config.json'} is not JSON ({e})") from None
    data = args.data or cfg.get("data")
    tok_path = run_dir / "tokenizer.json"                  # the run's own ids, on its corpus or another
    td = prepare(None if data == "stdlib" else data, model.config.vocab_size,
                 tokenizer=tok_path if tok_path.exists() else None)
    batches = args.batches or train.get("eval_batches", 8)             # the trainer's held-out batches
    batch_size = args.batch_size or train.get("batch_size", 16)
    eot = packing_eot(train.get("pack", False), td, train.get("context_parallel", 1))   # as the run trained
    loss = evaluate(model, td.heldout, model.config.context_length, batch_size, batches, bf16=train.get("bf16", False),
                    eot=eot)
    print(f"{args.run}: step {meta['step']}, held-out loss {loss:.4f} nats/token "
          f"({batches} x {batch_size} windows of {model.config.context_length}{', packed' if eot is not None else ''})")
    return 0


def _eval_passkey(args) -> int:
    """Passkey retrieval by length and depth (``subquad.tasks.passkey``): a table, and a heat map with --out."""
    import json
    from pathlib import Path

    from subquad.tasks.passkey import heatmap, passkey_sweep

    try:
        lengths = [token_count(x) for x in args.lengths.split(",") if x]
        depths = [float(x) for x in args.depths.split(",") if x]
    except ValueError as e:
        raise ValueError(f"--lengths takes e.g. 1K,4K and --depths e.g. 0,0.5,1 ({e})") from None
    model, tok = load_model(args, need_tokenizer="to encode the passkey prompts with")
    name = args.model or args.run
    rows = passkey_sweep(model, lambda s: tok.encode(s).ids, lengths, depths, trials=args.trials,
                         piece=args.piece, progress=lambda r: say(f"length {r['length']}, depth {r['depth']:.2f}: "
                                                                   f"{r['accuracy']:.2f}"))
    print(f"passkey retrieval, {name}: accuracy over {args.trials} keys")
    print("| length | " + " | ".join(f"depth {d:.2f}" for d in depths) + " | state bytes |")
    print("|---" * (len(depths) + 2) + "|")
    for n in lengths:
        cells = [r for r in rows if r["length"] == n]
        print(f"| {n} | " + " | ".join(f"{r['accuracy']:.2f}" for r in cells) + f" | {cells[-1]['state_bytes']:,} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "passkey.json").write_text(json.dumps({"model": str(name), "rows": rows}, indent=1))
        heatmap(rows, out / "passkey.png", f"passkey retrieval: {Path(str(name)).name}")
        print(f"wrote {out / 'passkey.json'} and {out / 'passkey.png'}")
    return 0


def _eval_tasks(args) -> int:
    """lm-evaluation-harness tasks on a run or a model folder (``subquad.harness``; the ``eval`` extra)."""
    try:
        from subquad.harness import SubquadLM
    except ImportError as e:
        raise ValueError(f"--tasks needs lm-evaluation-harness: pip install 'subquad[eval]' ({e})") from None
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    lm = SubquadLM(path=args.run or args.model, dtype=model_dtype(args), device=args.device, quantize=args.quantize,
                   group_size=args.group_size,
                   batch_size=args.batch_size or 16)
    tasks = [t for t in args.tasks.split(",") if t]
    manager = None
    if args.include_path:              # tasks all in --include-path: no index of lm_eval's own ~50,000 YAML files
        manager = TaskManager(include_path=args.include_path, include_defaults=False)     # (~9 s here)
        if not all(t in manager.all_tasks for t in tasks):
            manager = None
    manager = manager or TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"--tasks {', '.join(unknown)}: no such lm-evaluation-harness task, group or tag"
                         + (f" (nor in --include-path {args.include_path})" if args.include_path else ""))
    try:
        res = simple_evaluate(model=lm, tasks=tasks, limit=args.limit, task_manager=manager)
    except (ConnectionError, OSError) as e:      # a task's dataset is fetched from the Hub: offline, no traceback
        raise ValueError(f"--tasks {args.tasks}: its dataset could not be read ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}); local tasks: --include-path") from None
    print(make_table(res))
    print(f"contexts read: {lm.context_prefills} (each shared context once)")
    return 0


def _eval_model(args) -> int:
    """Perplexity of a local text under a Hugging Face model folder: the whole text in one pass, pieces of
    ``--piece`` tokens with the decoding state carried, so every token sees everything before it."""
    from pathlib import Path

    import torch
    import torch.nn.functional as F

    if not args.data:
        raise ValueError("--model needs --data, a local text file")
    if not Path(args.data).is_file():
        raise ValueError(f"--data {args.data}: no such file")
    model, tok = load_model(args, need_tokenizer="to encode --data with")
    ids = tok.encode(Path(args.data).read_text(encoding="utf-8", errors="replace")).ids
    if len(ids) < 2:
        raise ValueError(f"--data {args.data} holds fewer than 2 tokens")
    dev = model.embed.weight.device
    x = torch.tensor(ids, device=dev).view(1, -1)
    total, state = 0.0, None
    with torch.no_grad():
        for s in range(0, len(ids) - 1, args.piece):
            e = min(s + args.piece, len(ids) - 1)
            logits, state = model.prefill(x[:, s:e], state)
            total += F.cross_entropy(logits[0].float(), x[0, s + 1:e + 1], reduction="sum").item()
    nll = total / (len(ids) - 1)
    print(f"{args.data}: {len(ids) - 1:,} tokens, {nll:.4f} nats/token, perplexity {math.exp(nll):.3f} "
          f"({args.model}, {precision(model, args)})")
    return 0


def precision(model, args) -> str:
    """What the weights are, as a user would name them: --quantize, a GGUF file's own quantised types (kept as
    int8 blocks: "Q4_0 (the file's)"), a quantised model's kind, or the dtype."""
    from subquad.models.quant import weights_name

    return args.quantize or weights_name(model)

