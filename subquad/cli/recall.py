"""``subquad recall``: MQAR recall of every mixer against its state size (Zoology's sweep)."""

from __future__ import annotations

import argparse
import sys

from subquad.cli.common import add_device_flag, positive


def sizes(text: str):
    try:
        out = [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        out = []
    if not out or any(len(t) != 2 for t in out):
        raise argparse.ArgumentTypeError(f"--sizes takes TxN pairs like 64x4,128x8, got {text!r}")
    for T, N in out:                        # MQAR's own conditions (tasks.mqar), before any cell trains
        if N < 1 or T % 2 or 4 * N > T:
            raise argparse.ArgumentTypeError(f"--sizes {T}x{N}: each needs N >= 1 key-value pairs, an even length "
                                             f"T and 4 N <= T (pairs and their queries fit), got {text!r}")
    return out


def mixer_list(text: str) -> list[str]:
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


def positive_list(kind):
    """An argparse type: comma-separated numbers of ``kind``, each > 0."""
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes comma-separated {kind.__name__}s, got {text!r}") from None
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"takes numbers > 0, got {text!r}")
        return values
    return parse


def add_parser(command) -> None:
    from subquad.bench.recall import DECAY as RECALL_DECAY, sweep_rows

    r = command("recall", "MQAR recall of every mixer against its state size (Zoology)")
    r.add_argument("--out", default="runs/recall", help="output folder (a rerun resumes)")
    r.add_argument("--mixers", type=mixer_list,
                   help=f"comma-separated labels (default: all): {'; '.join(sweep_rows())}")
    r.add_argument("--sizes", type=sizes, default=[(64, 4), (128, 8), (256, 16)],
                   help="TxN pairs (default: 64x4,128x8,256x16)")
    r.add_argument("--d-models", type=positive_list(int), default=[64, 128],
                   help="model widths (default: 64,128)")
    r.add_argument("--lrs", type=positive_list(float), default=[3e-3, 1e-2],
                   help="learning rates (default: 3e-3,1e-2; the best mean over seeds kept per cell)")
    r.add_argument("--seeds", type=positive, default=2, help="seeds per cell (default: 2; mean and range reported)")
    r.add_argument("--vocab", type=positive, default=512, help="vocabulary (Zoology: 8192)")
    r.add_argument("--steps", type=positive, default=1500,
                   help="optimizer steps per cell, the same for every mixer (stops early at 99%%; as the "
                        "published table)")
    r.add_argument("--batch-size", type=positive, default=64, help="sequences per step")
    r.add_argument("--mlp", action="store_true", help="add the SwiGLU MLP (Zoology's default has none)")
    r.add_argument("--decay", choices=RECALL_DECAY, default="all",
                   help="weight decay 0.1 on every parameter (Zoology's) or on matrices only (no decay on norms, "
                        "biases, Mamba's A_log / D / dt_bias; subquad train's); other than 'all', a row of its own")
    r.add_argument("--mix-budgets", action="store_true",
                   help="let --out hold cells of another --steps (refused otherwise); each budget on rows of its own")
    r.add_argument("--quick", action="store_true", help="a tiny sweep (seconds), for tests")
    r.add_argument("--no-progress", action="store_true", help="no progress lines")
    add_device_flag(r)
    r.set_defaults(fn=run)


def run(args) -> int:
    from pathlib import Path

    from subquad.bench import recall

    if args.quick:
        given = [f for f in ("--sizes", "--d-models", "--lrs", "--vocab", "--steps", "--batch-size")
                 if any(a == f or a.startswith(f + "=") for a in (args.argv or sys.argv[1:]))]
        if given:
            raise ValueError(f"--quick sets its own tiny sweep; drop {', '.join(given)} (or drop --quick)")
        kw = dict(mixers=args.mixers or ["softmax", "linear (elu+1)"], sizes=[(16, 2)], d_models=[32], lrs=[3e-3],
                  vocab=32, steps=30, batch=16, seeds=range(args.seeds))
    else:
        long = [f"{T}x{N}" for T, N in args.sizes if T >= args.vocab]          # MQAR's fourth condition
        if long:
            raise ValueError(f"--sizes {','.join(long)}: MQAR needs --vocab ({args.vocab}) above each length T")
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
