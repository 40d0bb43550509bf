"""``subquad export``: a run's checkpoint (full or sharded) - or a model folder or GGUF file - written as a model
folder (a Hugging Face type's, or quantised) or a GGUF file for inference."""

from __future__ import annotations

import os

from subquad.cli.common import add_group_size_flag, say


def add_parser(command, hf_types: list[str]) -> None:
    x = command("export", "write a run's checkpoint (full or sharded), or a model folder or GGUF file, as a model "
                          "folder or a GGUF file for inference")
    src = x.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a run folder (its newest intact checkpoint) or a checkpoint folder")
    src.add_argument("--model", help="a Hugging Face model folder, a GGUF file or an RWKV-7 .pth (what "
                                     "from_pretrained reads): converted to a quantised folder or a GGUF file")
    x.add_argument("--out", required=True, help="the folder to write (config.json, model.safetensors, "
                   "tokenizer.json), or with --format gguf the .gguf file")
    x.add_argument("--model-type", choices=hf_types + ["subquad"],
                   help="the Hugging Face type to write (default: the first whose structure the model has; "
                        "'subquad' when none has it: a folder of subquad's own config and names)")
    x.add_argument("--format", choices=["hf", "gguf"], default=None,
                   help="hf: a model folder (the default, but for an --out ending in .gguf); gguf: one GGUF file "
                        "for llama.cpp / Ollama (--out is the file; "
                        "the structures of the Hugging Face types subquad.models.gguf writes: "
                        "benchmarks/gguf_architectures.md)")
    x.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0", "q4_0"], default="f32",
                   help="--format gguf: the type of the matrices (norms, convolutions, A, D and biases stay f32)")
    x.add_argument("--quantize", choices=["int8", "int4", "bf16"],
                   help="write the model quantised (subquad.models.quant): a folder of subquad's own format that "
                        "from_pretrained and subquad generate --model load quantised as written")
    add_group_size_flag(x)
    x.set_defaults(fn=run)


def run(args) -> int:
    from pathlib import Path

    from subquad.models.hf.saver import PLAIN, hf_type, save_pretrained

    source = args.run or args.model
    if not Path(source).exists():
        raise ValueError(f"--{'run' if args.run else 'model'} {source} does not exist")
    if Path(args.out).exists() and os.path.samefile(args.out, source):     # written over its own source: lost
        raise ValueError(f"--out {args.out} is the --{'run' if args.run else 'model'} it is exported from: give "
                         "another --out")
    if args.format is None:
        args.format = "gguf" if args.out.lower().endswith(".gguf") else "hf"    # a file's name: what was meant
        if args.format == "gguf":
            say(f"--out {args.out} ends in .gguf: writing a GGUF file (--format gguf)")
    if args.format == "gguf":
        return _gguf(args)
    if args.outtype != "f32":
        raise ValueError("--outtype is for --format gguf; a folder's quantisation is --quantize")
    model, tok, what_from = _load(args, quantize=args.quantize)
    if args.quantize and args.model_type not in (None, PLAIN):
        raise ValueError(f"--quantize writes subquad's own format (--model-type {PLAIN}), not {args.model_type!r}")
    kind = PLAIN if args.quantize else args.model_type or hf_type(model) or PLAIN
    save_pretrained(model, args.out, tokenizer=tok, model_type=kind)
    what = (f"a subquad folder of {args.quantize} weights (from_pretrained and subquad generate --model read it)"
            if args.quantize else
            "a subquad folder (no Hugging Face type has this structure; from_pretrained and subquad generate "
            "--model read it)" if kind == PLAIN else f"a Hugging Face {kind} folder")
    print(f"{what_from} written to {args.out} as {what}")
    return 0


def _load(args, quantize=None):
    """(model, tokenizer, what it is) of --run (its end-of-text named: ``_end_of_text``) or --model."""
    if args.run is not None:
        from subquad.train import load_run

        model, tok, meta = load_run(args.run, log=say, quantize=quantize,       # full or sharded, read whole
                                    group_size=args.group_size)
        _end_of_text(model, tok)
        return model, tok, f"{args.run}: step {meta['step']}"
    import torch

    from subquad.models import from_pretrained
    from subquad.models.hf import is_gguf
    from subquad.train import run_folder

    if run_folder(args.model) is not None:
        raise ValueError(f"--model {args.model} is a run folder: give it as --run")
    gguf = is_gguf(args.model)
    # a GGUF file's BF16 / F16 matrices read as float32 (from_pretrained keeps them half by default); its
    # Q8_0 / Q4_0 / Q4_K / Q6_K blocks load quantised, which only --quantize's folder can hold
    model, tok = from_pretrained(args.model, quantize=quantize, dtype=torch.float32 if gguf and quantize is None
                                 else None, group_size=args.group_size)
    if quantize is None and getattr(model, "quantized", None) and gguf:
        raise ValueError(f"--model {args.model} holds block-quantised matrices ({model.quantized} in subquad's "
                         "kernels): write it with --quantize int8 or int4 (a subquad folder); a float folder or "
                         "another GGUF file is not made from them (llama.cpp's llama-quantize converts GGUF types)")
    if quantize is None and getattr(model, "quantized", None):
        raise ValueError(f"--model {args.model} is a folder of {model.quantized} weights: a float folder or a GGUF "
                         "file is not made from them - export the float checkpoint it was quantised from")
    return model, tok, args.model


def _gguf(args) -> int:
    from subquad.models.gguf import save_gguf

    if args.quantize:
        raise ValueError(f"--format gguf takes --outtype for the matrices' type (q8_0, q4_0, ...), not --quantize "
                         f"{args.quantize}")
    if args.model_type == "subquad":
        raise ValueError("--format gguf writes a Hugging Face type's GGUF architecture, not --model-type subquad")
    model, tok, what_from = _load(args)
    types = save_gguf(model, args.out, args.outtype, tokenizer=tok, model_type=args.model_type)
    print(f"{what_from} written to {args.out} as a GGUF file ({len(types)} tensors, "
          f"{sum(t == args.outtype.upper() for t in types.values())} of them {args.outtype.upper()})")
    return 0


def _end_of_text(model, tok) -> None:
    """A run names no end-of-text id (generate --run runs to --max-new-tokens); the folder or file it is written
    as names its tokenizer's <|endoftext|>, so that generate --model, the server, transformers, llama.cpp and
    lm-eval all stop there."""
    from subquad.data.tokenizer import EOT

    eot = tok.token_to_id(EOT) if tok is not None else None
    if not model.config.eos_token_ids and eot is not None:
        model.config.eos_token_ids = [eot]

