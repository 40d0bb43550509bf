"""The ``subquad`` command: thin - parse arguments, call the library, print."""

from __future__ import annotations

import argparse
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
    measured_ctx = [T for T in args.context if T <= args.measure_max] or [min(args.context)]
    print(f"\nMeasured from the tensors the ops keep (B=1, one head), T <= {args.measure_max:,}:")
    print(render([{"context": f"{m['context']:,}", "KV cache (KVCache.nbytes)": f"{m['kv_cache_bytes']:,} B",
                   "state (S + z)": f"{m['state_bytes']:,} B", "state dtype": m["state_dtype"]}
                  for m in memory.measure(measured_ctx, args.head_dim, args.dtype)]))
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


def _model_config(args):
    from subquad.models import preset

    overrides = {k: v for k, v in {"pattern": args.pattern, "d_model": args.d_model, "n_layers": args.n_layers,
                                   "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
                                   "context_length": args.context, "vocab_size": args.vocab_size}.items()
                 if v is not None}
    if args.no_mlp:
        overrides["mlp"] = False
    opts: dict = {}
    for mixer, name, value in args.mixer_option or []:
        opts.setdefault(mixer, {})[name] = value
    if opts:
        overrides["mixer_options"] = opts
    return preset(args.preset, **overrides)


def cmd_train(args) -> int:
    from subquad.distributed.launch import init_from_env, launch
    from subquad.train import PeerLost, TrainConfig, TrainingDiverged, train_run

    mcfg = _model_config(args)               # bad settings fail here, once, before any process starts
    P = args.context_parallel
    nproc = args.nproc if args.nproc > 1 or P == 1 else P
    if nproc % P:
        raise SystemExit(f"error: --nproc {nproc} must be a multiple of --context-parallel {P}")
    if nproc > 1 and "WORLD_SIZE" not in os.environ:   # re-run this command under torchrun, one process per rank
        argv = list(sys.argv[1:] if args.argv is None else args.argv)
        if "--nproc" in argv:
            i = argv.index("--nproc")
            argv = argv[:i] + argv[i + 2:]
        return launch(nproc, argv)
    rank, world = init_from_env(args.dist_timeout)
    tcfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                       eval_every=args.eval_every, ckpt_every=args.ckpt_every, seed=args.seed, bf16=args.bf16,
                       context_parallel=P)
    out = args.out or f"runs/{args.preset}-{mcfg.pattern.replace('*', 'x').replace(',', '_')}"
    try:
        r = train_run(mcfg, tcfg, out, data=args.data, resume=args.resume, progress=not args.no_progress,
                      device=args.device)
    except (TrainingDiverged, PeerLost) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if rank == 0:
        print(f"done: {r['steps']} steps{f' on {world} processes' if world > 1 else ''}, held-out loss "
              f"{r['heldout_loss']:.4f} nats/token; run in {out}")
    return 0


def cmd_eval(args) -> int:
    import json
    from pathlib import Path

    from subquad.data.dataset import prepare
    from subquad.train import evaluate, load_run

    model, tok, meta = load_run(args.run, device=args.device)
    cfg = json.loads((Path(args.run) / "config.json").read_text()) if (Path(args.run) / "config.json").exists() else {}
    td = prepare(args.data or cfg.get("data"), model.config.vocab_size)
    loss = evaluate(model, td.heldout, model.config.context_length, args.batch_size, args.batches)
    print(f"{args.run}: step {meta['step']}, held-out loss {loss:.4f} nats/token "
          f"({args.batches} x {args.batch_size} windows of {model.config.context_length})")
    return 0


def cmd_generate(args) -> int:
    from subquad.models import load_state, save_state
    from subquad.train import load_run

    model, tok, _ = load_run(args.run, device=args.device)
    state = None
    if args.load_state:
        state, extra = load_state(args.load_state)
        ids = [extra["last_token"]] + (tok.encode(args.prompt).ids if args.prompt else [])
    else:
        if not args.prompt:
            print("error: --prompt is required (or --load-state to continue a saved generation)", file=sys.stderr)
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
                                top_p=args.top_p, seed=args.seed, state=state, on_token=stream)
    print(tok.decode(new)[len(shown[0]):])
    print(f"\n[state: {model.state_bytes(state):,} bytes over {model.config.n_layers} layers "
          f"({', '.join(sorted(set(model.config.layers)))})]", file=sys.stderr)
    if args.save_state:
        save_state(args.save_state, state, {"last_token": out[-1] if out else ids[-1]})
        print(f"[state saved to {args.save_state}; continue with --load-state]", file=sys.stderr)
    return 0


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
                  vocab=32, steps=30, batch=16, time_budget=30.0)
    else:
        kw = dict(mixers=args.mixers, sizes=args.sizes, d_models=args.d_models, lrs=args.lrs, vocab=args.vocab,
                  steps=args.steps, batch=args.batch_size, time_budget=args.time_budget)
    res = recall.sweep(out=args.out, mlp=args.mlp, progress=not args.no_progress, device=args.device, **kw)
    md = recall.table(res)
    out = Path(args.out)
    (out / "recall.md").write_text(md + "\n")
    recall.plot(res, out / "recall.png")
    print("\nMQAR accuracy (best over learning rates):\n" + md)
    print(f"\nwrote {out / 'recall.json'}, recall.md and recall.png ({res['seconds_this_run']} s this run)")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="subquad", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("memory", help="KV cache against linear state, per layer and head")
    m.add_argument("--context", type=_contexts, default=[1024, 4096, 16384, 65536, 131072, 262144, 1048576],
                   help="comma-separated context lengths (default 1K..1M)")
    m.add_argument("--head-dim", type=_positive, default=32, help="head dimension d (default 32)")
    m.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    m.add_argument("--flops", action="store_true", help="also print N^2 d against N d^2")
    m.add_argument("--measure-max", type=_positive, default=16384,
                   help="measure allocated bytes at contexts up to this length (default 16384)")
    m.set_defaults(fn=cmd_memory)

    w = sub.add_parser("workshop", help="the plate, reproduced: forms agree, memory, softmax vs linear training")
    w.add_argument("--out", default="runs/workshop", help="output folder (default runs/workshop)")
    w.add_argument("--head-dim", type=_positive, default=32)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--steps", type=_positive, default=600, help="training steps per run (default 600; the plate: 6000)")
    w.add_argument("--seeds", type=_positive, default=1, help="repeat both runs with N seeds; report the gap's spread")
    w.add_argument("--data", default=None, help="corpus: stdlib (default), shakespeare, or a local path")
    w.add_argument("--positions", default="rope", choices=["rope", "learned"],
                   help="rope: rotary in softmax, none in linear (default); learned: the same learned "
                        "absolute positions in both")
    w.add_argument("--no-train", action="store_true", help="only the first half (forms agree, memory)")
    w.add_argument("--no-progress", action="store_true")
    w.set_defaults(fn=cmd_workshop)

    t = sub.add_parser("train", help="train a language model from a preset and a layer pattern")
    t.add_argument("--preset", default="micro", choices=["micro", "small", "jamba"])
    t.add_argument("--pattern", help="mixers per layer, e.g. softmax | linear | 'mamba2*3,softmax,mamba2*4'")
    t.add_argument("--d-model", type=_positive)
    t.add_argument("--n-layers", type=_positive)
    t.add_argument("--n-heads", type=_positive)
    t.add_argument("--n-kv-heads", type=_positive, help="grouped-query attention for softmax layers")
    t.add_argument("--context", type=_positive, help="training context length")
    t.add_argument("--vocab-size", type=_positive, help="BPE vocabulary (default 4096)")
    t.add_argument("--no-mlp", action="store_true")
    t.add_argument("--mixer-option", type=_option, action="append", metavar="MIXER.KEY=VALUE",
                   help="e.g. swa.window=128, linear.feature_map=performer (repeatable)")
    t.add_argument("--steps", type=_positive, default=600)
    t.add_argument("--batch-size", type=_positive, default=16)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--eval-every", type=_positive, default=100)
    t.add_argument("--ckpt-every", type=_positive, default=200)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    t.add_argument("--data", help="stdlib (default), shakespeare, or a local file/folder")
    t.add_argument("--out", help="run folder (default runs/PRESET-PATTERN)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--nproc", type=_positive, default=1,
                   help="data-parallel processes (relaunches under torchrun; each rank draws its own batches)")
    t.add_argument("--context-parallel", type=_positive, default=1, metavar="P",
                   help="split each sequence over P processes: ring attention for softmax layers, state passing "
                        "for recurrent ones (launches P processes; with --nproc N, N/P data-parallel replicas)")
    t.add_argument("--dist-timeout", type=float, default=60.0,
                   help="seconds a rank waits for a peer before stopping with an error (distributed runs)")
    _device_flag(t)
    t.set_defaults(fn=cmd_train)

    r = sub.add_parser("recall", help="MQAR recall of every mixer against its state size (Zoology)")
    r.add_argument("--out", default="runs/recall")
    r.add_argument("--mixers", type=lambda t: [m.strip() for m in t.split(",")],
                   help="comma-separated labels (default: all; see subquad.bench.recall.MIXERS)")
    r.add_argument("--sizes", type=_sizes, default=[(64, 4), (128, 8)], help="TxN pairs (default 64x4,128x8)")
    r.add_argument("--d-models", type=lambda t: [int(v) for v in t.split(",")], default=[64])
    r.add_argument("--lrs", type=lambda t: [float(v) for v in t.split(",")], default=[1e-2])
    r.add_argument("--vocab", type=_positive, default=512, help="vocabulary (default 512; Zoology: 8192)")
    r.add_argument("--steps", type=_positive, default=1500)
    r.add_argument("--batch-size", type=_positive, default=64)
    r.add_argument("--time-budget", type=float, default=120.0, help="seconds per cell before it stops")
    r.add_argument("--mlp", action="store_true", help="add the SwiGLU MLP (Zoology's default has none)")
    r.add_argument("--quick", action="store_true", help="a tiny sweep (seconds), for tests")
    r.add_argument("--no-progress", action="store_true")
    _device_flag(r)
    r.set_defaults(fn=cmd_recall)

    e = sub.add_parser("eval", help="held-out loss of a trained run")
    e.add_argument("--run", required=True, help="run folder (or one of its checkpoints)")
    e.add_argument("--data", help="corpus (default: the run's)")
    e.add_argument("--batches", type=_positive, default=16)
    e.add_argument("--batch-size", type=_positive, default=16)
    _device_flag(e)
    e.set_defaults(fn=cmd_eval)

    g = sub.add_parser("generate", help="stream text from a trained run with its recurrent state")
    g.add_argument("--run", required=True)
    g.add_argument("--prompt", default="")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=_positive)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save-state", help="write the decoding state here (safetensors) to continue later")
    g.add_argument("--load-state", help="continue from a state saved with --save-state")
    _device_flag(g)
    g.set_defaults(fn=cmd_generate)
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
