"""The ``subquad`` command: thin - parse arguments, call the library, print."""

from __future__ import annotations

import argparse
import math
import os
import sys


def _contexts(text: str) -> list[int]:
    try:
        vals = [int(float(x.replace("_", ""))) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--context takes comma-separated token counts, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"--context needs positive token counts, got {text!r}")
    return vals


def _positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def cmd_memory(args) -> int:
    from subquad.bench import memory
    from subquad.bench.table import fmt_bytes, render

    rows = memory.analytic(args.context, args.head_dim, args.dtype)
    print(f"Memory per layer and head, head dim d = {args.head_dim}, {args.dtype}")
    print(render([{"context": f"{r['context']:,}", "KV cache 2Td (numbers)": f"{r['kv_numbers']:,}",
                   "state d²+d (numbers)": f"{r['state_numbers']:,}",
                   "KV cache": f"{r['kv_bytes']:,} B ({fmt_bytes(r['kv_bytes'])})",
                   "state": f"{r['state_bytes']:,} B ({fmt_bytes(r['state_bytes'])})", "ratio": f"{r['ratio']:,.0f}x"} for r in rows]))
    measured = memory.measure(memory.measured_contexts(args.context, args.measure_max), args.head_dim, args.dtype)
    print("\n" + memory.measured_title(measured))
    print(render([{"context": f"{m['context']:,}", "KV cache (KVCache.nbytes)": f"{m['kv_cache_bytes']:,} B",
                   "state (S + z)": f"{m['state_bytes']:,} B", "state dtype": m["state_dtype"]}
                  for m in measured]))
    if args.flops:
        print("\nOperations of the attention product (per head): softmax N²d against linear Nd²")
        print(render([{"N": f"{r['context']:,}", "softmax N²d": f"{r['softmax_flops']:.2e}",
                       "linear Nd²": f"{r['linear_flops']:.2e}", "ratio": f"{r['ratio']:,.0f}x"}
                      for r in memory.flops(args.context, args.head_dim)]))
    return 0


def cmd_workshop(args) -> int:
    from subquad.bench import workshop

    workshop.run(out=args.out, head_dim=args.head_dim, seed=args.seed, steps=args.steps, seeds=args.seeds,
                 data=args.data, train=not args.no_train, progress=not args.no_progress, positions=args.positions)
    return 0


def _option(text: str):
    """--mixer-option swa.window=128  ->  ("swa", "window", 128)."""
    import json

    key, eq, value = text.partition("=")
    mixer, dot, name = key.partition(".")
    if not eq or not dot or not mixer or not name:
        raise argparse.ArgumentTypeError(f"--mixer-option takes MIXER.KEY=VALUE (e.g. swa.window=128), got {text!r}")
    try:
        value = json.loads(value)
    except json.JSONDecodeError:
        pass
    return mixer, name, value


def _moe(text: str) -> dict:
    """--moe experts=8,top_k=2,every=2,offset=1  ->  the ModelConfig moe dict (checked by ModelConfig)."""
    import json

    out = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"--moe takes KEY=VALUE pairs (e.g. experts=8,top_k=2), got {text!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"--moe {key}: {value!r} is not a number or true/false") from None
    return out


def _model_config(args):
    from subquad.models import preset

    overrides = {field: getattr(args, dest) for dest, field in _MODEL_FLAGS.items() if getattr(args, dest) is not None}
    if args.no_mlp:
        overrides["mlp"] = False
    if getattr(args, "moe", None):
        overrides["moe"] = args.moe
    opts: dict = {}
    for mixer, name, value in args.mixer_option or []:
        opts.setdefault(mixer, {})[name] = value
    if opts:
        overrides["mixer_options"] = opts
    cfg = preset(args.preset, **overrides)
    if opts:                                   # on the command line an option for an absent mixer is a mistake
        from subquad.layers.registry import check_mixer_options

        check_mixer_options(cfg.layers, opts, in_pattern=True)
    return cfg


# flags of `train` and the config field each sets: on --resume the run's own value is used, and a flag
# given with another value is refused (except RESUME_SAFE ones, which update the run)
_MODEL_FLAGS = {"pattern": "pattern", "d_model": "d_model", "n_layers": "n_layers", "n_heads": "n_heads",
                "n_kv_heads": "n_kv_heads", "context": "context_length", "vocab_size": "vocab_size"}
_TRAIN_FLAGS = {"steps": "steps", "batch_size": "batch_size", "lr": "lr", "warmup": "warmup",
                "eval_every": "eval_every", "ckpt_every": "ckpt_every", "seed": "seed", "bf16": "bf16",
                "context_parallel": "context_parallel", "on_nonfinite": "on_nonfinite", "pack": "pack",
                "fsdp": "fsdp", "hsdp": "replicate", "activation_checkpointing": "activation_checkpointing"}


def _given(args) -> set:
    """The dests of the flags written on the command line (train's parser takes no abbreviations)."""
    argv = list(sys.argv[1:] if args.argv is None else args.argv)
    opts = {tok.split("=", 1)[0] for tok in argv if tok.startswith("--")}
    return {a.dest for a in args.parser._actions if any(o in opts for o in a.option_strings)}


def _resume_configs(args):
    """(model config, train config, data) of the run in --out, with the flags given checked against it."""
    from dataclasses import asdict

    from subquad.models import ModelConfig, preset
    from subquad.train import TrainConfig
    from subquad.train.run import RESUME_SAFE, read_run_config

    if not args.out:
        raise ValueError("--resume needs --out, the run folder to continue")
    saved = read_run_config(args.out)
    given = _given(args)
    model, train = dict(saved["model"]), {**asdict(TrainConfig()), **saved["train"]}
    refused = []
    asked = {}
    if "preset" in given:
        asked.update({k: v for k, v in preset(args.preset).to_dict().items()
                      if k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "context_length", "pattern")})
    asked.update({field: getattr(args, dest) for dest, field in _MODEL_FLAGS.items() if dest in given})
    if "no_mlp" in given:
        asked["mlp"] = False
    if "mixer_option" in given:
        asked["mixer_options"] = _model_config(args).mixer_options
    if "moe" in given:
        asked["moe"] = _model_config(args).moe
    for field, value in asked.items():
        if model.get(field) != value:
            refused.append(f"{field} {value!r} (the run has {model.get(field)!r})")
    for dest, field in _TRAIN_FLAGS.items():
        if dest in given and getattr(args, dest) != train.get(field):
            if field in RESUME_SAFE:
                train[field] = getattr(args, dest)
            else:
                refused.append(f"{field} {getattr(args, dest)!r} (the run has {train.get(field)!r})")
    if "hsdp" in given:
        train["fsdp"] = True
    if "data" in given and (args.data or "stdlib") != saved.get("data", "stdlib"):
        refused.append(f"data {args.data!r} (the run has {saved.get('data')!r})")
    if refused:
        raise ValueError(f"--resume continues the run in {args.out} with its own settings; these flags would "
                         f"change it: {'; '.join(refused)}")
    data = saved.get("data")
    return ModelConfig.from_dict(model), TrainConfig(**train), None if data == "stdlib" else data


def cmd_train(args) -> int:
    from subquad.distributed.launch import init_from_env, launch
    from subquad.train import PeerLost, TrainConfig, TrainingDiverged, train_run
    from subquad.train.checkpoint import CheckpointWriteError

    if (args.restart or args.reschedule) and not args.resume:
        raise ValueError(f"--{'restart' if args.restart else 'reschedule'} goes with --resume (the run in --out)")
    if args.resume:
        mcfg, tcfg, data = _resume_configs(args)       # the run's own settings; conflicting flags refused
    else:
        mcfg = _model_config(args)                     # bad settings fail here, once, before any process starts
        tcfg, data = None, args.data
    P = tcfg.context_parallel if tcfg is not None else args.context_parallel
    R = tcfg.replicate if tcfg is not None else (args.hsdp or 1)
    nproc = args.nproc if args.nproc > 1 or P * R == 1 or args.nnodes > 1 else P * R
    if (nproc * args.nnodes) % (P * R):
        raise SystemExit(f"error: --nproc {nproc} x --nnodes {args.nnodes} processes must be a multiple of "
                         f"--context-parallel {P} x --hsdp {R}")
    if (nproc > 1 or args.nnodes > 1) and "WORLD_SIZE" not in os.environ:   # re-run under torchrun, a process per rank
        argv = list(sys.argv[1:] if args.argv is None else args.argv)
        for flag in ("--nproc", "--nnodes", "--rdzv-endpoint"):
            if flag in argv:
                i = argv.index(flag)
                argv = argv[:i] + argv[i + 2:]
        return launch(nproc, argv, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint)
    rank, world = init_from_env(args.dist_timeout)
    if tcfg is None:
        tcfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                           eval_every=args.eval_every, ckpt_every=args.ckpt_every, seed=args.seed, bf16=args.bf16,
                           context_parallel=P, on_nonfinite=args.on_nonfinite, pack=args.pack,
                           fsdp=args.fsdp or args.hsdp is not None, replicate=R,
                           activation_checkpointing=args.activation_checkpointing)
    out = args.out or f"runs/{args.preset}-{mcfg.pattern.replace('*', 'x').replace(',', '_')}"
    try:
        r = train_run(mcfg, tcfg, out, data=data, resume=args.resume, progress=not args.no_progress,
                      device=args.device, restart=args.restart, reschedule=args.reschedule)
    except (TrainingDiverged, PeerLost, CheckpointWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:                          # a read-only or full disk: one line, not a traceback
        print(f"error: cannot write the run in {out}: {e.strerror or e} "
              f"({e.filename or out})", file=sys.stderr)
        return 1
    if rank == 0:
        held = "n/a" if r["heldout_loss"] is None else f"{r['heldout_loss']:.4f}"
        print(f"done: {r['steps']} steps{f' on {world} processes' if world > 1 else ''}, held-out loss "
              f"{held} nats/token; run in {out}")
    return 0


def cmd_eval(args) -> int:
    import json
    from pathlib import Path

    from subquad.data.dataset import prepare
    from subquad.train import evaluate, load_run
    from subquad.train.trainer import packing_eot

    if (args.run is None) == (args.model is None):
        raise ValueError("give one of --run (a subquad run) or --model (a Hugging Face model folder)")
    if args.passkey:
        return _eval_passkey(args)
    if args.tasks is not None:
        return _eval_tasks(args)
    if args.model is not None:
        return _eval_model(args)
    if not Path(args.run).exists():
        raise ValueError(f"--run {args.run} does not exist")
    model, tok, meta = load_run(args.run, device=args.device, quantize=args.quantize, log=_say)
    train = meta.get("train_config", {})
    run = Path(args.run) if (Path(args.run) / "ckpt").exists() else Path(args.run).parent.parent
    cfg = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
    data = args.data or cfg.get("data")
    tok_path = run / "tokenizer.json"                  # the run's own ids, on its corpus or another
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


def _tokens(text: str) -> int:
    """"4K" -> 4096, "512" -> 512."""
    t = text.strip().upper()
    n = int(t[:-1]) * 1024 if t.endswith("K") else int(t)
    if n <= 0:
        raise ValueError(f"a length must be positive, got {text!r}")
    return n


def _eval_passkey(args) -> int:
    """Passkey retrieval by length and depth (``subquad.tasks.passkey``): a table, and a heat map with --out."""
    import json
    from pathlib import Path

    from subquad.tasks.passkey import heatmap, passkey_sweep

    try:
        lengths = [_tokens(x) for x in args.lengths.split(",") if x]
        depths = [float(x) for x in args.depths.split(",") if x]
    except ValueError as e:
        raise ValueError(f"--lengths takes e.g. 1K,4K and --depths e.g. 0,0.5,1 ({e})") from None
    if args.model is not None:
        from subquad.models import from_pretrained

        model, tok = from_pretrained(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize)
        if tok is None:
            raise ValueError(f"--model {args.model} has no tokenizer.json")
    else:
        from subquad.train import load_run

        model, tok, _ = load_run(args.run, device=args.device, quantize=args.quantize, log=_say)
    name = args.model or args.run
    rows = passkey_sweep(model, lambda s: tok.encode(s).ids, lengths, depths, trials=args.trials,
                         piece=args.piece, progress=lambda r: _say(f"length {r['length']}, depth {r['depth']:.2f}: "
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

    lm = SubquadLM(path=args.run or args.model, dtype=args.dtype, device=args.device, quantize=args.quantize,
                   batch_size=args.batch_size or 16)
    tasks = [t for t in args.tasks.split(",") if t]
    res = simple_evaluate(model=lm, tasks=tasks, limit=args.limit,
                          task_manager=TaskManager(include_path=args.include_path))
    print(make_table(res))
    print(f"contexts read: {lm.context_prefills} (each shared context once)")
    return 0


def _eval_model(args) -> int:
    """Perplexity of a local text under a Hugging Face model folder: the whole text in one pass, pieces of
    ``--piece`` tokens with the decoding state carried, so every token sees everything before it."""
    from pathlib import Path

    import torch
    import torch.nn.functional as F

    from subquad.device import resolve_device
    from subquad.models import from_pretrained

    if not args.data or not Path(args.data).is_file():
        raise ValueError(f"--model needs --data, a local text file; got {args.data!r}")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[args.dtype]
    model, tok = from_pretrained(args.model, dtype=dtype, device=resolve_device(args.device),
                                 quantize=args.quantize)
    if tok is None:
        raise ValueError(f"--model {args.model} has no tokenizer.json to encode --data with")
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
          f"({args.model}, {args.quantize or args.dtype})")
    return 0


def _say(message: str) -> None:
    """A note for the user on stderr (stdout stays the command's output)."""
    print(message, file=sys.stderr)


def _stop_ids(tok, texts) -> list[int]:
    ids = []
    for text in texts or []:
        enc = tok.encode(text.encode().decode("unicode_escape")).ids      # --stop '\n' means a newline
        if len(enc) != 1:
            raise ValueError(f"--stop {text!r} is {len(enc)} tokens for this tokenizer; it must be one")
        ids += enc
    return ids


def cmd_export(args) -> int:
    from pathlib import Path

    from subquad.models.hf.saver import PLAIN, hf_type, save_pretrained
    from subquad.train import load_run

    if not Path(args.run).exists():
        raise ValueError(f"--run {args.run} does not exist")
    model, tok, meta = load_run(args.run, log=_say)          # full or sharded checkpoints, read whole
    kind = args.model_type or hf_type(model) or PLAIN
    save_pretrained(model, args.out, tokenizer=tok, model_type=kind)
    what = ("a subquad folder (no Hugging Face type has this structure; from_pretrained and subquad generate "
            "--model read it)" if kind == PLAIN else f"a Hugging Face {kind} folder")
    print(f"{args.run}: step {meta['step']} written to {args.out} as {what}")
    return 0


def cmd_generate(args) -> int:
    from pathlib import Path

    import torch

    from subquad.models import load_state, save_state
    from subquad.train import load_run

    if (args.run is None) == (args.model is None):
        raise ValueError("give one of --run (a subquad run) or --model (a Hugging Face model folder)")
    if args.run is not None and not Path(args.run).exists():
        raise ValueError(f"--run {args.run} does not exist")
    if args.prompts_file:
        if args.load_state or args.save_state or args.prompt:
            raise ValueError("--prompts-file generates a batch; it does not combine with --prompt, --load-state "
                             "or --save-state")
        path = Path(args.prompts_file)
        if not path.exists():
            raise ValueError(f"--prompts-file {path} does not exist")
        prompts = [ln for ln in path.read_text().splitlines() if ln.strip()]
        if not prompts:
            raise ValueError(f"--prompts-file {path} holds no prompt (one per line)")
    if args.model is not None:
        from subquad.device import resolve_device
        from subquad.models import from_pretrained

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[args.dtype]
        model, tok = from_pretrained(args.model, dtype=dtype, device=resolve_device(args.device),
                                     quantize=args.quantize)
        if tok is None:
            raise ValueError(f"--model {args.model} has no tokenizer.json to encode the prompt with")
    else:
        model, tok, _ = load_run(args.run, device=args.device, quantize=args.quantize, log=_say)
    if args.compile_decode:
        from subquad.models.decode import compile_decode

        compile_decode(model)
    stop = _stop_ids(tok, args.stop)
    if args.prompts_file:
        outs, _ = model.generate([tok.encode(p).ids or [0] for p in prompts], args.max_new_tokens,
                                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                 stop_ids=stop)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            print(f"--- [{i}] {p}{tok.decode(o)}")
        return 0
    state = None
    if args.load_state:
        state, extra = load_state(args.load_state)
        ids = [extra["last_token"]] + (tok.encode(args.prompt).ids if args.prompt else [])
    else:
        if not args.prompt:
            print("error: --prompt is required (or --prompts-file, or --load-state to continue a saved generation)",
                  file=sys.stderr)
            return 2
        ids = tok.encode(args.prompt).ids
        print(args.prompt, end="", flush=True)
    new: list[int] = []
    shown = [""]

    def stream(t):
        new.append(t)
        text = tok.decode(new)
        if not text.endswith("\ufffd"):          # wait for the rest of a multi-byte character
            print(text[len(shown[0]):], end="", flush=True)
            shown[0] = text

    out, state = model.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, state=state, on_token=stream, stop_ids=stop)
    print(tok.decode(new)[len(shown[0]):])
    print(f"\n[state: {model.state_bytes(state):,} bytes over {model.config.n_layers} layers "
          f"({', '.join(sorted(set(model.config.layers)))})]", file=sys.stderr)
    if args.save_state:
        save_state(args.save_state, state, {"last_token": out[-1] if out else ids[-1]})
        print(f"[state saved to {args.save_state}; continue with --load-state]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    """subquad serve: load the model, build the engine (memory budget: --memory-mb, else half of what is
    available), serve until SIGTERM."""
    from pathlib import Path

    import torch

    from subquad.train import load_run

    if (args.run is None) == (args.model is None):
        raise ValueError("give one of --run (a subquad run) or --model (a Hugging Face model folder)")
    try:
        from subquad.serve import Engine
        from subquad.serve.server import default_memory_mb, end_of_text_ids, run
    except ImportError as e:
        raise ValueError(f"subquad serve needs the serve extra (pip install 'subquad[serve]'): {e}") from None
    chat_template = None
    if args.model is not None:
        from subquad.models import from_pretrained
        from subquad.serve.chat import load_chat_template

        if not Path(args.model).is_dir():
            raise ValueError(f"--model {args.model} is not a folder")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[args.dtype]
        model, tok = from_pretrained(args.model, dtype=dtype, device=args.device, quantize=args.quantize)
        chat_template = load_chat_template(args.model)
    else:
        if not Path(args.run).exists():
            raise ValueError(f"--run {args.run} does not exist")
        model, tok, _ = load_run(args.run, device=args.device, quantize=args.quantize, log=_say)
    if args.compile_decode:
        _compile_and_warm(model)
    name = args.served_model_name or Path(args.model or args.run).resolve().name
    memory_mb = default_memory_mb(args.device) if args.memory_mb is None else args.memory_mb or None  # 0: none
    engine = Engine(model, tok, max_batch=args.max_batch, max_queue=args.max_queue, max_context=args.max_context,
                    prefill_chunk=args.prefill_chunk, state_cache_mb=args.state_cache_mb, memory_mb=memory_mb,
                    eos_ids=end_of_text_ids(model, tok))
    return run(engine, name, host=args.host, port=args.port, chat_template=chat_template, api_key=args.api_key,
               drain_timeout=args.drain_timeout)


def _compile_and_warm(model) -> None:
    """The compiled decoding step (``models.decode``), its graphs built before the first request: one batch row,
    then two rows of different lengths (the batch and any KV cache become dynamic sizes), so requests do not
    wait for a compile."""
    from subquad.models.decode import compile_decode

    print("compiling the decoding step (one batch row, then a ragged batch) ...", file=sys.stderr, flush=True)
    compile_decode(model)
    eos = model.config.eos_token_ids
    model.config.eos_token_ids = []
    try:
        model.generate([[0, 0, 0]], 4, temperature=0)
        model.generate([[0, 0], [0, 0, 0]], 4, temperature=0)
    finally:
        model.config.eos_token_ids = eos


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def _quantize_flag(parser) -> None:
    parser.add_argument("--quantize", choices=["int8", "bf16"],
                        help="quantise the projections for inference: int8 per output channel, or bfloat16 "
                             "(subquad.models.quant; the weights load as float32 first)")


def _sizes(text: str):
    try:
        out = [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        out = []
    if not out or any(len(t) != 2 for t in out):
        raise argparse.ArgumentTypeError(f"--sizes takes TxN pairs like 64x4,128x8, got {text!r}")
    return out


def cmd_recall(args) -> int:
    from pathlib import Path

    from subquad.bench import recall

    if args.quick:
        kw = dict(mixers=args.mixers or ["softmax", "linear (elu+1)"], sizes=[(16, 2)], d_models=[32], lrs=[3e-3],
                  vocab=32, steps=30, batch=16, seeds=range(args.seeds))
    else:
        kw = dict(mixers=args.mixers, sizes=args.sizes, d_models=args.d_models, lrs=args.lrs, vocab=args.vocab,
                  steps=args.steps, batch=args.batch_size, seeds=range(args.seeds))
    res = recall.sweep(out=args.out, mlp=args.mlp, progress=not args.no_progress, device=args.device,
                       decay=args.decay, mix_budgets=args.mix_budgets, **kw)
    md = recall.table(res, mix_budgets=args.mix_budgets)
    out = Path(args.out)
    (out / "recall.md").write_text(md + "\n")
    recall.plot(res, out / "recall.png", mix_budgets=args.mix_budgets)
    recall.grid(res, out / "recall_grid.png", mix_budgets=args.mix_budgets)
    print("\nMQAR accuracy, mean over seeds (their range), best learning rate per cell after @ "
          "(†: the only one run):\n" + md)
    print(f"\nwrote {out / 'recall.json'}, recall.md, recall.png and recall_grid.png "
          f"({res['seconds_this_run']} s this run)")
    return 0


def _device(text: str):
    from subquad.device import resolve_device

    try:
        return resolve_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _device_flag(parser):
    parser.add_argument("--device", type=_device, default="cpu",
                        help="auto | cpu | cuda | mps (or cuda:N): where the model, batches and sampler live "
                             "(default cpu; auto picks CUDA, then MPS, then the CPU)")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default (left out where the help says where the default comes from)."""

    def _get_help_string(self, action):
        h = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not hidden and "default" not in h and action.option_strings:     # 0 is a default to show
            h += f" (default: {action.default})"
        return h


def _mixer_list(text: str) -> list[str]:
    """Comma-separated labels; commas inside parentheses belong to a label ('hybrid (mamba2, softmax)')."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [m for m in out if m]


DESCRIPTION = """\
subquad: train, compare and run sequence mixers that escape softmax attention's quadratic cost -
linear attention, RetNet, GLA, DeltaNet, Gated DeltaNet, Mamba, Mamba-2 and hybrids with attention.

  subquad workshop                  the plate reproduced: forms agree, memory, softmax vs linear (start here)
  subquad train --pattern mamba2    train a small language model; --resume continues a run
  subquad generate --run runs/NAME  stream text with a constant-size state
  subquad serve --model DIR         an OpenAI-compatible server (continuous batching, prefix-state reuse)
  subquad recall                    associative recall of every mixer against its state size
  subquad memory                    KV cache against recurrent state, per layer and head

'subquad COMMAND --help' lists a command's flags with their defaults."""


def build_parser() -> argparse.ArgumentParser:
    from subquad import __version__
    from subquad.layers import MIXERS
    from subquad.models import PRESETS
    from subquad.models.hf import MAPPINGS

    HF_TYPES = list(MAPPINGS)                   # every checkpoint type from_pretrained reads

    p = argparse.ArgumentParser(prog="subquad", description=DESCRIPTION, formatter_class=_Help)
    p.add_argument("--version", action="version", version=f"subquad {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help):
        return sub.add_parser(name, help=help, description=help, formatter_class=_Help, allow_abbrev=False)

    m = command("memory", "KV cache against linear state, per layer and head")
    m.add_argument("--context", type=_contexts, default=[1024, 4096, 16384, 65536, 131072, 262144, 1048576],
                   help="comma-separated context lengths (default: 1K..1M)")
    m.add_argument("--head-dim", type=_positive, default=32, help="head dimension d")
    m.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"],
                   help="element type of cache and state")
    m.add_argument("--flops", action="store_true", help="also print N^2 d against N d^2")
    m.add_argument("--measure-max", type=_positive, default=16384,
                   help="measure allocated bytes at contexts up to this length")
    m.set_defaults(fn=cmd_memory)

    w = command("workshop", "the plate, reproduced: forms agree, memory, softmax vs linear training")
    w.add_argument("--out", default="runs/workshop", help="output folder")
    w.add_argument("--head-dim", type=_positive, default=32, help="head dimension of the memory table")
    w.add_argument("--seed", type=int, default=0, help="seed of the first training pair")
    w.add_argument("--steps", type=_positive, default=600, help="training steps per run (the plate: 6000)")
    w.add_argument("--seeds", type=_positive, default=1, help="repeat both runs with N seeds; report the gap's spread")
    w.add_argument("--data", default=None, help="corpus: stdlib, shakespeare, or a local path (default: stdlib)")
    w.add_argument("--positions", default="rope", choices=["rope", "learned"],
                   help="rope: rotary in softmax, none in linear; learned: the same learned absolute positions "
                        "in both")
    w.add_argument("--no-train", action="store_true", help="only the first half (forms agree, memory)")
    w.add_argument("--no-progress", action="store_true", help="no progress bars")
    w.set_defaults(fn=cmd_workshop)

    t = command("train", "train a language model from a preset and a layer pattern")
    t.add_argument("--preset", default="micro", choices=list(PRESETS),
                   help="model shape: micro (d_model 128, 4 layers), small, jamba (mamba2*3,softmax,mamba2*4)")
    t.add_argument("--pattern", help=f"mixers per layer, e.g. softmax | 'mamba2*3,softmax,mamba2*4' (default: the "
                                     f"preset's). Mixers: {', '.join(sorted(MIXERS))}")
    t.add_argument("--d-model", type=_positive, help="model width (default: the preset's)")
    t.add_argument("--n-layers", type=_positive, help="layers (default: the preset's)")
    t.add_argument("--n-heads", type=_positive, help="heads (default: the preset's)")
    t.add_argument("--n-kv-heads", type=_positive, help="grouped-query attention for softmax layers "
                                                        "(default: = heads)")
    t.add_argument("--context", type=_positive, help="training context length (default: the preset's)")
    t.add_argument("--vocab-size", type=_positive, help="BPE vocabulary (default: the preset's, 4096)")
    t.add_argument("--no-mlp", action="store_true", help="no SwiGLU MLP after the mixers")
    t.add_argument("--moe", type=_moe, metavar="KEY=VALUE,...",
                   help="mixture-of-experts MLPs, e.g. experts=8,top_k=2,every=2,offset=1 (keys: experts, top_k, "
                        "every, offset, aux_loss_coef, renormalize)")
    t.add_argument("--mixer-option", type=_option, action="append", metavar="MIXER.KEY=VALUE",
                   help="e.g. swa.window=128, linear.feature_map=performer, *.chunk_size=128 (repeatable)")
    t.add_argument("--steps", type=_positive, default=600, help="optimizer steps (on --resume: may grow)")
    t.add_argument("--batch-size", type=_positive, default=16, help="sequences per step")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, warmup then cosine)")
    t.add_argument("--warmup", type=int, default=50, help="warmup steps")
    t.add_argument("--eval-every", type=_positive, default=100, help="held-out loss every N steps")
    t.add_argument("--ckpt-every", type=_positive, default=200, help="checkpoint every N steps")
    t.add_argument("--seed", type=int, default=0, help="seed of weights and batches")
    t.add_argument("--bf16", action="store_true", help="bfloat16 autocast on the model's device")
    t.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="boundaries at document starts: no token attends to or carries state from another "
                        "document, and no target crosses into the next (default: on for a corpus of many "
                        "documents, off for one text or with --context-parallel)")
    t.add_argument("--on-nonfinite", default="stop", choices=["stop", "skip"],
                   help="a step whose loss or gradient is not finite: stop the run, or skip the step; "
                        "either way it updates nothing and is never checkpointed")
    t.add_argument("--data", help="stdlib, shakespeare, or a local file/folder (default: stdlib)")
    t.add_argument("--out", help="run folder (default: runs/PRESET-PATTERN)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest intact checkpoint, with the run's own settings "
                        "(flags that would change the model, data or training are refused, and so are changed "
                        "data files; --steps may grow)")
    t.add_argument("--reschedule", action="store_true",
                   help="with --resume and a new --steps: stretch the cosine schedule to it (the learning rate "
                        "changes from the resume point); without it the schedule keeps its length and steps "
                        "past it train at its final rate")
    t.add_argument("--restart", action="store_true",
                   help="with --resume: train a run whose checkpoints are all lost (ckpt/ deleted, emptied or "
                        "corrupt) again from step 0, overwriting its metrics (refused while an intact one exists)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--nproc", type=_positive, default=1,
                   help="data-parallel processes (relaunches under torchrun; each rank draws its own batches)")
    t.add_argument("--context-parallel", type=_positive, default=1, metavar="P",
                   help="split each sequence over P processes: ring attention for softmax layers, state passing "
                        "for recurrent ones (launches P processes; with --nproc N, N/P data-parallel replicas)")
    t.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=False,
                   help="shard parameters, gradients and optimizer state over the processes (FSDP2, per block); "
                        "checkpoints are then written as each rank's shards (DCP) and resume on any --nproc")
    t.add_argument("--hsdp", type=_positive, metavar="R",
                   help="with FSDP: R replicas of the shards (HSDP: shard within a replica, all-reduce across "
                        "them); implies --fsdp")
    t.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward: less memory for more compute")
    t.add_argument("--nnodes", type=_positive, default=1,
                   help="machines taking part (torchrun's rendezvous; run the same command on each, with "
                        "--rdzv-endpoint HOST:PORT of one of them)")
    t.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="where the machines of a multi-node run meet (torchrun's c10d rendezvous)")
    t.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds a rank waits for a peer before stopping with an error (distributed runs)")
    _device_flag(t)
    t.set_defaults(fn=cmd_train, parser=t)

    from subquad.bench.recall import DECAY as RECALL_DECAY, sweep_rows

    r = command("recall", "MQAR recall of every mixer against its state size (Zoology)")
    r.add_argument("--out", default="runs/recall", help="output folder (a rerun resumes)")
    r.add_argument("--mixers", type=_mixer_list,
                   help=f"comma-separated labels (default: all): {'; '.join(sweep_rows())}")
    r.add_argument("--sizes", type=_sizes, default=[(64, 4), (128, 8), (256, 16)],
                   help="TxN pairs (default: 64x4,128x8,256x16)")
    r.add_argument("--d-models", type=lambda t: [int(v) for v in t.split(",")], default=[64, 128],
                   help="model widths (default: 64,128)")
    r.add_argument("--lrs", type=lambda t: [float(v) for v in t.split(",")], default=[3e-3, 1e-2],
                   help="learning rates (default: 3e-3,1e-2; the best mean over seeds kept per cell)")
    r.add_argument("--seeds", type=_positive, default=2, help="seeds per cell (default: 2; mean and range reported)")
    r.add_argument("--vocab", type=_positive, default=512, help="vocabulary (Zoology: 8192)")
    r.add_argument("--steps", type=_positive, default=1500,
                   help="optimizer steps per cell, the same for every mixer (stops early at 99%%; as the "
                        "published table)")
    r.add_argument("--batch-size", type=_positive, default=64, help="sequences per step")
    r.add_argument("--mlp", action="store_true", help="add the SwiGLU MLP (Zoology's default has none)")
    r.add_argument("--decay", choices=RECALL_DECAY, default="all",
                   help="weight decay 0.1 on every parameter (Zoology's) or on matrices only (no decay on norms, "
                        "biases, Mamba's A_log / D / dt_bias; subquad train's); other than 'all', a row of its own")
    r.add_argument("--mix-budgets", action="store_true",
                   help="let --out hold cells of another --steps (refused otherwise); each budget on rows of its own")
    r.add_argument("--quick", action="store_true", help="a tiny sweep (seconds), for tests")
    r.add_argument("--no-progress", action="store_true", help="no progress lines")
    _device_flag(r)
    r.set_defaults(fn=cmd_recall)

    e = command("eval", "held-out loss of a trained run, or the perplexity of a text under a model folder")
    e.add_argument("--run", help="run folder (or one of its checkpoints)")
    e.add_argument("--model", help="a Hugging Face model folder (with tokenizer.json): perplexity of --data")
    e.add_argument("--data", help="corpus (default: the run's); with --model, a local text file")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"],
                   help="weights' dtype for --model")
    e.add_argument("--piece", type=_positive, default=1024,
                   help="with --model: tokens per forward, the state carried between them")
    e.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated (the `eval` extra): scores "
                                   "--run or --model on them (subquad.harness)")
    e.add_argument("--limit", type=_positive, help="with --tasks: at most this many documents per task")
    e.add_argument("--passkey", action="store_true", help="passkey retrieval by --lengths and --depths "
                                                            "(subquad.tasks.passkey)")
    e.add_argument("--lengths", default="1K,4K", help="with --passkey: prompt lengths, e.g. 1K,4K,16K")
    e.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="with --passkey: needle depths in [0, 1]")
    e.add_argument("--trials", type=_positive, default=5, help="with --passkey: keys per cell")
    e.add_argument("--out", help="with --passkey: a folder for passkey.json and the heat map passkey.png")
    e.add_argument("--include-path", help="with --tasks: a folder of task YAML files of your own")
    e.add_argument("--batches", type=_positive, help="held-out batches (default: the run's eval_batches, as in "
                                                      "training)")
    e.add_argument("--batch-size", type=_positive, help="sequences per batch (default: the run's)")
    _quantize_flag(e)
    _device_flag(e)
    e.set_defaults(fn=cmd_eval)

    x = command("export", "write a run's checkpoint (full or sharded) as a model folder for inference")
    x.add_argument("--run", required=True, help="a run folder (its newest intact checkpoint) or a checkpoint folder")
    x.add_argument("--out", required=True, help="the folder to write: config.json, model.safetensors, tokenizer.json")
    x.add_argument("--model-type", choices=HF_TYPES + ["subquad"],
                   help="the Hugging Face type to write (default: the first whose structure the model has; "
                        "'subquad' when none has it: a folder of subquad's own config and names)")
    x.set_defaults(fn=cmd_export)

    g = command("generate", "stream text from a trained run with its recurrent state")
    g.add_argument("--run", help="run folder (or one of its checkpoints)")
    g.add_argument("--model", help="a Hugging Face model folder (config.json, model.safetensors, tokenizer.json) "
                                   f"of a supported type: {', '.join(HF_TYPES)}; or a BlinkDL RWKV-7 .pth file "
                                   "(its world vocabulary rwkv_vocab_v20230424.txt beside it)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"],
                   help="weights' dtype for --model")
    g.add_argument("--prompt", help="text to continue (required, unless --prompts-file or --load-state)")
    g.add_argument("--prompts-file", help="a file of prompts, one per line: all generated as one batch")
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    g.add_argument("--top-k", type=_positive, help="sample among the k most likely tokens (default: all)")
    g.add_argument("--top-p", type=float, help="sample within the nucleus of this mass (default: all)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop a sequence when it emits this text's token (repeatable; default: none)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--save-state", help="write the decoding state here (safetensors) to continue later")
    g.add_argument("--load-state", help="continue from a state saved with --save-state")
    _quantize_flag(g)
    g.add_argument("--compile-decode", action="store_true",
                   help="decode with the compiled one-token step (subquad.models.decode: faster per token once "
                        "compiled; compiling takes seconds per kind of layer)")
    _device_flag(g)
    g.set_defaults(fn=cmd_generate)

    v = command("serve", "an OpenAI-compatible HTTP server: continuous batching, prefix-state reuse")
    v.description += ("\n\nfinish_reason: \"stop\" (end of text or a stop string), \"length\" (max_tokens or the\n"
                      "context), \"abort\" (still running when a SIGTERM's --drain-timeout ran out) or \"error\"\n"
                      "(the engine failed on that request; the others and the server go on).")
    v.add_argument("--run", help="run folder (or one of its checkpoints)")
    v.add_argument("--model", help="a Hugging Face model folder (its tokenizer.json and chat template are used)")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"],
                   help="weights' dtype for --model")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    v.add_argument("--port", type=int, default=8000, help="port to listen on")
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes (default: none)")
    v.add_argument("--served-model-name", help="the model's name in the API (default: the folder's name)")
    v.add_argument("--max-batch", type=_positive, default=16, help="sequences decoded together")
    v.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429s")
    v.add_argument("--max-context", type=_positive, default=4096, help="prompt plus max_tokens, per request")
    v.add_argument("--prefill-chunk", type=_positive, default=512,
                   help="prompt tokens prefilled per loop iteration, between decoding steps")
    v.add_argument("--state-cache-mb", type=_nonneg_float, default=256.0,
                   help="bound of the prefix-state cache, exact bytes (0: no cache)")
    v.add_argument("--memory-mb", type=_nonneg_float,
                   help="admission budget for live states (KV buffers as allocated, twice while the batch changes) "
                        "plus the prefix cache; 0: no bound (default: half the memory available at start - "
                        "MemAvailable in /proc/meminfo, or the GPU's free memory - and no bound where unknown)")
    v.add_argument("--drain-timeout", type=_nonneg_float, default=10.0,
                   help="seconds accepted requests may run on after SIGTERM")
    _quantize_flag(v)
    v.add_argument("--compile-decode", action="store_true",
                   help="decode with the compiled step (subquad.models.decode), compiled before serving")
    _device_flag(v)
    v.set_defaults(fn=cmd_serve)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.fn(args)
    except ValueError as e:            # bad input found past argparse: a clear message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
