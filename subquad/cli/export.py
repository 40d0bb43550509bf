"""``subquad export``: a run's checkpoint (full or sharded) written as a model folder for inference."""

from __future__ import annotations

from subquad.cli.common import say


def add_parser(command, hf_types: list[str]) -> None:
    x = command("export", "write a run's checkpoint (full or sharded) as a model folder for inference")
    x.add_argument("--run", required=True, help="a run folder (its newest intact checkpoint) or a checkpoint folder")
    x.add_argument("--out", required=True, help="the folder to write: config.json, model.safetensors, tokenizer.json")
    x.add_argument("--model-type", choices=hf_types + ["subquad"],
                   help="the Hugging Face type to write (default: the first whose structure the model has; "
                        "'subquad' when none has it: a folder of subquad's own config and names)")
    x.set_defaults(fn=run)


def run(args) -> int:
    from pathlib import Path

    from subquad.models.hf.saver import PLAIN, hf_type, save_pretrained
    from subquad.train import load_run

    if not Path(args.run).exists():
        raise ValueError(f"--run {args.run} does not exist")
    model, tok, meta = load_run(args.run, log=say)          # full or sharded checkpoints, read whole
    kind = args.model_type or hf_type(model) or PLAIN
    save_pretrained(model, args.out, tokenizer=tok, model_type=kind)
    what = ("a subquad folder (no Hugging Face type has this structure; from_pretrained and subquad generate "
            "--model read it)" if kind == PLAIN else f"a Hugging Face {kind} folder")
    print(f"{args.run}: step {meta['step']} written to {args.out} as {what}")
    return 0
