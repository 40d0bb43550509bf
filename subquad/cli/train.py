"""``subquad train``: a language model from a preset and a layer pattern; ``--resume`` continues a run with its
own settings and refuses flags that would change it."""

from __future__ import annotations

import argparse
import os
import sys

from subquad.cli.common import add_device_flag, positive, positive_seconds


def _option(text: str):
    """--mixer-option swa.window=128  ->  ("swa", "window", 128): the value read as JSON (Python's None, True and
    False too), else kept as text."""
    import json

    key, eq, value = text.partition("=")
    mixer, dot, name = key.partition(".")
    if not eq or not dot or not mixer or not name:
        raise argparse.ArgumentTypeError(f"--mixer-option takes MIXER.KEY=VALUE (e.g. swa.window=128), got {text!r}")
    if value in ("None", "True", "False"):
        return mixer, name, {"None": None, "True": True, "False": False}[value]
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


def _mixer_options(args) -> dict:
    """--mixer-option flags as {mixer: {key: value}}; one key given twice is refused (which should win?)."""
    opts: dict = {}
    for mixer, name, value in args.mixer_option or []:
        if name in opts.get(mixer, {}) and opts[mixer][name] != value:
            raise ValueError(f"--mixer-option {mixer}.{name} is given twice ({opts[mixer][name]!r} and {value!r})")
        opts.setdefault(mixer, {})[name] = value
    return opts


def _model_config(args):
    from subquad.models import preset

    overrides = {field: getattr(args, dest) for dest, field in _MODEL_FLAGS.items() if getattr(args, dest) is not None}
    if args.no_mlp:
        overrides["mlp"] = False
    if getattr(args, "moe", None):
        overrides["moe"] = args.moe
    opts = _mixer_options(args)
    if opts:
        overrides["mixer_options"] = opts
    if getattr(args, "blocks", None) == "rwkv7":   # RWKV-7's own blocks (README: "Models, patterns and training")
        overrides.update(RWKV7_BLOCKS)
    cfg = preset(args.preset, **overrides)
    if getattr(args, "blocks", None) == "rwkv7":
        if set(cfg.layers) != {"rwkv7"}:
            raise ValueError(f"--blocks rwkv7 is RWKV-7's block layout around rwkv7 mixers; the pattern "
                             f"{cfg.pattern!r} has others")
        # its group norm's eps 64e-5 (BlinkDL's, which llama.cpp fixes), and the LayerNorms' such that head size x
        # theirs is it (as the rwkv7 type reads it back): 1e-5 at heads of 64
        cfg.norm_eps = 64e-5 / (cfg.d_model // cfg.n_heads)
        cfg.mixer_options = {**cfg.mixer_options, "rwkv7": {"norm_eps": 64e-5, **cfg.mixer_options.get("rwkv7", {})}}
    if args.n_kv_heads is not None:            # a flag that would change nothing is a mistake on the command line
        from subquad.layers.registry import MIXERS

        used = [*cfg.layers, *cfg.parallel.values()]
        if not any(MIXERS[m].heads == "n_kv_heads" for m in used):
            takes = ", ".join(sorted(m for m, e in MIXERS.items() if e.heads == "n_kv_heads"))
            raise ValueError(f"--n-kv-heads sets the key/value heads of attention layers ({takes}); the pattern "
                             f"{cfg.pattern!r} has none")
    if opts:                                   # on the command line an option for an absent mixer is a mistake
        from subquad.layers.registry import check_mixer_options

        check_mixer_options(cfg.layers, opts, in_pattern=True)
    return cfg


# --blocks rwkv7: RWKV-7's blocks - LayerNorms with bias, ln0 on the embeddings, the channel-mix MLP, its own head -
# so that a run exports as the rwkv7 type (Hugging Face, GGUF) and decodes as BlinkDL's (the norms' eps: _model_config)
RWKV7_BLOCKS = {"norm": "layer", "embed_norm": True, "mlp_kind": "rwkv7", "tie_embeddings": False}

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
    from subquad.train.run import RESUME_SAFE, read_run_config, same_data, same_layers

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
    if "mixer_option" in given:                  # against the run's pattern, not the default preset's
        asked["mixer_options"] = _mixer_options(args)
    if "moe" in given:
        asked["moe"] = _model_config(args).moe
    if "blocks" in given:
        asked.update(RWKV7_BLOCKS)
    for field, value in asked.items():
        if field == "pattern" and same_layers(value, model.get(field), asked.get("n_layers", model["n_layers"])):
            continue                                                          # 'a,a,b' is the run's 'a*2,b'
        if model.get(field) != value:
            refused.append(f"{field} {value!r} (the run has {model.get(field)!r})")
    for dest, field in _TRAIN_FLAGS.items():
        if field == "pack" and train.get("pack") is None and getattr(args, dest) == saved.get("packed"):
            continue                                  # --pack on a run whose automatic choice was to pack
        if dest in given and getattr(args, dest) != train.get(field):
            if field in RESUME_SAFE:
                train[field] = getattr(args, dest)
            else:
                refused.append(f"{field} {getattr(args, dest)!r} (the run has {train.get(field)!r})")
    if "hsdp" in given:
        train["fsdp"] = True
    if "data" in given and not same_data(args.data or "stdlib", saved.get("data", "stdlib")):
        refused.append(f"data {args.data!r} (the run has {saved.get('data')!r})")
    if saved.get("packed") and train["context_parallel"] > 1:      # said before any process starts (train_run too)
        refused.append(f"context_parallel {train['context_parallel']} (the run packed its batches at document starts, "
                       "which context parallelism cannot)")
    if refused:
        raise ValueError(f"--resume continues the run in {args.out} with its own settings; these flags would "
                         f"change it: {'; '.join(refused)}")
    data = args.data if "data" in given else saved.get("data")       # the same data, named from here
    return ModelConfig.from_dict(model), TrainConfig(**train), None if data == "stdlib" else data


def add_parser(command) -> None:
    from subquad.layers.registry import causal_mixers
    from subquad.models import PRESETS

    t = command("train", "train a language model from a preset and a layer pattern")
    t.add_argument("--preset", default="micro", choices=list(PRESETS),
                   help="model shape: micro (d_model 128, 4 layers), small, jamba (mamba2*3,softmax,mamba2*4)")
    t.add_argument("--pattern", help=f"mixers per layer, e.g. softmax | 'mamba2*3,softmax,mamba2*4' (default: the "
                                     f"preset's). Mixers: {', '.join(sorted(causal_mixers()))}")
    t.add_argument("--d-model", type=positive, help="model width (default: the preset's)")
    t.add_argument("--n-layers", type=positive, help="layers (default: the preset's)")
    t.add_argument("--n-heads", type=positive, help="heads (default: the preset's)")
    t.add_argument("--n-kv-heads", type=positive, help="grouped-query attention for softmax layers "
                                                        "(default: = heads)")
    t.add_argument("--context", type=positive, help="training context length (default: the preset's)")
    t.add_argument("--vocab-size", type=positive, help="BPE vocabulary (default: the preset's, 4096)")
    t.add_argument("--no-mlp", action="store_true", help="no SwiGLU MLP after the mixers")
    t.add_argument("--blocks", choices=["rwkv7"],
                   help="rwkv7: RWKV-7's own blocks around --pattern rwkv7 (LayerNorms, ln0 on the embeddings, the "
                        "channel-mix MLP), so the run exports as the rwkv7 type (Hugging Face folder, GGUF)")
    t.add_argument("--moe", type=_moe, metavar="KEY=VALUE,...",
                   help="mixture-of-experts MLPs, e.g. experts=8,top_k=2,every=2,offset=1 (keys: experts, top_k, "
                        "every, offset, aux_loss_coef, renormalize)")
    t.add_argument("--mixer-option", type=_option, action="append", metavar="MIXER.KEY=VALUE",
                   help="e.g. swa.window=128, linear.feature_map=performer, *.chunk_size=128 (repeatable)")
    t.add_argument("--steps", type=positive, default=600, help="optimizer steps (on --resume: may grow)")
    t.add_argument("--batch-size", type=positive, default=16, help="sequences per step")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, warmup then cosine)")
    t.add_argument("--warmup", type=int, default=50, help="warmup steps")
    t.add_argument("--eval-every", type=positive, default=100, help="held-out loss every N steps")
    t.add_argument("--ckpt-every", type=positive, default=200, help="checkpoint every N steps")
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
    t.add_argument("--nproc", type=positive, default=1,
                   help="data-parallel processes (relaunches under torchrun; each rank draws its own batches)")
    t.add_argument("--context-parallel", type=positive, default=1, metavar="P",
                   help="split each sequence over P processes: ring attention for softmax layers, state passing "
                        "for recurrent ones (launches P processes; with --nproc N, N/P data-parallel replicas)")
    t.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=False,
                   help="shard parameters, gradients and optimizer state over the processes (FSDP2, per block); "
                        "checkpoints are then written as each rank's shards (DCP) and resume on any --nproc")
    t.add_argument("--hsdp", type=positive, metavar="R",
                   help="with FSDP: R replicas of the shards (HSDP: shard within a replica, all-reduce across "
                        "them); implies --fsdp")
    t.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward: less memory for more compute")
    t.add_argument("--nnodes", type=positive, default=1,
                   help="machines taking part (torchrun's rendezvous; run the same command on each, with "
                        "--rdzv-endpoint HOST:PORT of one of them)")
    t.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="where the machines of a multi-node run meet (torchrun's c10d rendezvous)")
    t.add_argument("--dist-timeout", type=positive_seconds, default=60.0,
                   help="seconds a rank waits for a peer before stopping with an error (distributed runs)")
    add_device_flag(t)
    t.set_defaults(fn=run, parser=t)


def run(args) -> int:
    from subquad.distributed.launch import init_from_env, launch, rank_error
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
    rank, world = init_from_env(args.dist_timeout, device=args.device)
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
        rank_error(f"error: {e}")                 # under --nproc: said once by the launcher, with its ranks
        return 1
    except OSError as e:                          # a read-only or full disk: one line, not a traceback
        print(f"error: cannot write the run in {out}: {e.strerror or e} "
              f"({e.filename or out})", file=sys.stderr)
        return 1
    if rank == 0:
        held = "n/a" if r["heldout_loss"] is None else f"{r['heldout_loss']:.4f}"
        skipped = r.get("skipped_steps") or 0
        print(f"done: {r['steps']} steps{f' on {world} processes' if world > 1 else ''}, held-out loss "
              f"{held} nats/token; run in {out}"
              + (f"\nwarning: {skipped} of those steps were skipped (a non-finite loss or gradient: "
                 f"--on-nonfinite skip); try a lower --lr" if skipped else ""))
    return 0
