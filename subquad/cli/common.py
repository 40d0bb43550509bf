"""What the commands share: argument types, the flags several commands take, and loading the model that
``--run`` or ``--model`` names (the one place that checks the pair, maps ``--dtype`` and places the model)."""

from __future__ import annotations

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float64")     # --dtype of --model; the torch dtype is looked up by name


def say(message: str) -> None:
    """A note for the user on stderr (stdout stays the command's output)."""
    print(message, file=sys.stderr)


def check_folder_of(flag: str, path) -> None:
    """ValueError naming ``flag`` where the file ``path`` would go into a folder that does not exist - said before
    the work that would write it (a model loaded, runs read, a generation)."""
    from pathlib import Path

    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {Path(path).parent} does not exist")


def positive(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def token_count(text: str) -> int:
    """A length in tokens as people write it: "4K" -> 4,096, "1M" -> 1,048,576, "512", "16_384", "1e4"."""
    t = text.strip().upper().replace("_", "")
    scale = {"K": 1024, "M": 1024 ** 2}.get(t[-1:], 1)
    try:
        v = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise ValueError(f"a length in tokens such as 512, 4K or 1M, got {text!r}") from None
    if not 1 <= v < float("inf") or v != int(v):
        raise ValueError(f"a length in tokens must be a positive whole number, got {text!r}")
    return int(v)


def nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def positive_seconds(text: str) -> float:
    """A time limit: a finite number of seconds > 0 (0, negative, nan and inf refused by argparse)."""
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def device(text: str):
    from subquad.device import resolve_device

    try:
        return resolve_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_device_flag(parser) -> None:
    """--device, resolved once by argparse: commands get a ``torch.device``."""
    parser.add_argument("--device", type=device, default="cpu",
                        help="auto | cpu | cuda | mps (or cuda:N): where the model, batches and sampler live "
                             "(default cpu; auto picks CUDA, then MPS, then the CPU)")


def add_quantize_flag(parser) -> None:
    parser.add_argument("--quantize", choices=["int8", "int4", "bf16"],
                        help="quantise the projections for inference: int8 per output channel, int4 per group of "
                             "128 inputs (--group-size), or bfloat16 (subquad.models.quant; the weights load as "
                             "float32 first; a folder saved quantised loads as it was saved)")
    add_group_size_flag(parser)


def add_group_size_flag(parser) -> None:
    parser.add_argument("--group-size", type=positive, metavar="N",
                        help="with --quantize int4: inputs per scale (default 128; 32 is more accurate, 256 smaller)")


def add_model_flags(parser, hf_types: list[str], *, run_help: str = "run folder (or one of its checkpoints)",
                    model_help: str | None = None) -> None:
    """--run or --model (exactly one, checked by :func:`load_model`), --dtype, --quantize and --device."""
    parser.add_argument("--run", help=run_help)
    parser.add_argument("--model", help=model_help or (
        "a Hugging Face model folder (config.json, model.safetensors, tokenizer.json) of a supported type: "
        f"{', '.join(hf_types)}; or a GGUF file (.gguf) of a llama.cpp architecture subquad.models.gguf reads "
        "(benchmarks/gguf_architectures.md)"))
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="weights' dtype (default float32; a GGUF file's BF16 / F16 matrices of "
                             "2^18 weights or more stay as the file holds them, smaller ones are read as float32, "
                             "unless --dtype is given)")
    add_quantize_flag(parser)
    add_device_flag(parser)


def check_run_or_model(args) -> None:
    """Exactly one of --run and --model, and a --run that exists."""
    from pathlib import Path

    if (args.run is None) == (args.model is None):
        raise ValueError("give one of --run (a subquad run) or --model (a Hugging Face model folder)")
    if args.run is not None and not Path(args.run).exists():
        raise ValueError(f"--run {args.run} does not exist")
    from subquad.train.run import run_folder

    if args.model is not None and run_folder(args.model) is not None:
        raise ValueError(f"--model {args.model} is a training run (subquad train's folder): give it as --run")
    if args.run is not None and run_folder(args.run) is None \
            and '"model_type"' in _text(Path(args.run) / "config.json"):
        raise ValueError(f"--run {args.run} is a model folder, not a training run: give it as --model")


def _text(path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def model_dtype(args):
    """The torch dtype --dtype names for --model; without one float32 for a folder, None for a GGUF file (its BF16
    / F16 matrices kept as the file holds them: models.gguf.load)."""
    import torch

    from subquad.models.hf import is_gguf

    if args.dtype:
        return getattr(torch, args.dtype)
    return None if args.model and is_gguf(args.model) else torch.float32


def load_model(args, *, need_tokenizer: str | None = None):
    """(model, tokenizer) of --run or --model with --dtype, --quantize and --device. ``need_tokenizer`` names
    what the tokenizer is for: a --model folder without tokenizer.json is then refused with that reason."""
    check_run_or_model(args)
    if args.model is not None:
        from subquad.models import from_pretrained
        from subquad.models.hf import is_gguf

        model, tok = from_pretrained(args.model, dtype=model_dtype(args), device=args.device, quantize=args.quantize,
                                     group_size=getattr(args, "group_size", None))
        if tok is None and need_tokenizer:
            where = "no tokenizer in its metadata (write it with save_gguf(..., tokenizer=tok))" \
                if is_gguf(args.model) else "no tokenizer.json"
            raise ValueError(f"--model {args.model} has {where} {need_tokenizer}")
        return model, tok
    model, tok, _ = load_run_as_asked(args)
    return model, tok


def load_run_as_asked(args):
    """``load_run`` of --run with --device, --quantize and --dtype: (model, tokenizer, checkpoint meta)."""
    from subquad.train import load_run

    if args.quantize and args.dtype not in (None, "float32"):
        raise ValueError("--dtype and --quantize: a run is loaded in one of them (--quantize keeps what it does not "
                         "quantise in float32)")
    model, tok, meta = load_run(args.run, device=args.device, quantize=args.quantize, log=say,
                                group_size=getattr(args, "group_size", None))
    if args.dtype not in (None, "float32"):    # a run's weights are float32: cast as from_pretrained casts a folder's
        model = model.to(model_dtype(args))
    return model, tok, meta


class Help(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default (left out where the help says where the default comes from)."""

    def _get_help_string(self, action):
        h = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not hidden and "default" not in h and action.option_strings:     # 0 is a default to show
            h += f" (default: {action.default})"
        return h
