"""``subquad compare``: training runs side by side - a table of each run's size, held-out loss and speed, and its
curves overlaid in one PNG."""

from __future__ import annotations

import sys
from pathlib import Path


def add_parser(command) -> None:
    c = command("compare", "training runs side by side: held-out loss, size and speed; curves in one PNG")
    c.add_argument("runs", nargs="+", help="run folders (subquad train --out, the workshop's runs/workshop/*_seed0)")
    c.add_argument("--out", default="compare.png", help="the figure (PNG): held-out and training loss of every run")
    c.add_argument("--x", choices=["step", "tokens"], default="step",
                   help="the curves' axis: optimiser steps, or tokens read (runs with other batch sizes or contexts)")
    c.set_defaults(fn=run)


def run(args) -> int:
    from subquad.bench import compare
    from subquad.bench.table import render
    from subquad.cli.common import check_folder_of

    folders = [Path(p).resolve() for p in args.runs]
    if len(set(folders)) != len(folders):
        raise ValueError("compare: a run folder is named twice")
    check_folder_of("--out", args.out)                                # before the runs are read
    runs = [compare.read_run(p) for p in args.runs]
    names = [r["name"] for r in runs]
    if len(set(names)) != len(names):                 # folders of the same name in different places: their paths
        for r in runs:
            r["name"] = r["path"]
    for warning in compare.mismatches(runs):
        print(f"warning: {warning}", file=sys.stderr)

    def loss(v):
        return "-" if v is None else f"{v:.4f}"

    print(render([{"run": r["name"], "pattern": r["pattern"], "parameters": f"{r['params']:,}",
                   "steps": f"{r['steps']:,}", "tokens read": f"{r['tokens']:,}",
                   "held-out loss (last)": loss(r["last"]),
                   "best (step)": "-" if r["best"] is None else f"{r['best']:.4f} ({r['best_step']:,})",
                   "tokens/s (median, all processes)": "-" if r["tokens_per_s"] is None
                   else f"{r['tokens_per_s']:,.0f}"}
                  for r in runs]))
    compare.figure(runs, args.out, args.x)
    print(f"wrote {args.out}")
    return 0
