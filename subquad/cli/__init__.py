"""The ``subquad`` command: thin - parse arguments, call the library, print. One module per command, each with
``add_parser(command)`` (its flags) and ``run(args)``; what they share is in :mod:`subquad.cli.common`."""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
import warnings
from pathlib import Path

from subquad.cli import compare, export, generate, memory, recall, serve, train, workshop
from subquad.cli import eval as eval_command
from subquad.cli.common import Help

DESCRIPTION = """\
subquad: train, compare and run sequence mixers that escape softmax attention's quadratic cost -
linear attention, RetNet, GLA, DeltaNet, Gated DeltaNet, Mamba, Mamba-2 and hybrids with attention.

  subquad workshop                  the plate reproduced: forms agree, memory, softmax vs linear (start here)
  subquad train --pattern mamba2    train a small language model; --resume continues a run
  subquad compare RUN RUN ...       training runs side by side: held-out loss, size, speed; curves in a PNG
  subquad generate --run runs/NAME  stream text with a constant-size state
  subquad serve --model DIR         an OpenAI-compatible server (continuous batching, prefix-state reuse)
  subquad recall                    associative recall of every mixer against its state size
  subquad memory                    KV cache against recurrent state, per layer and head

'subquad COMMAND --help' lists a command's flags with their defaults."""




def build_parser() -> argparse.ArgumentParser:
    from subquad import __version__
    from subquad.models.hf import MAPPINGS

    hf_types = list(MAPPINGS)                   # every checkpoint type from_pretrained reads

    p = argparse.ArgumentParser(prog="subquad", description=DESCRIPTION, formatter_class=Help)
    p.add_argument("--version", action="version", version=f"subquad {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help):
        return sub.add_parser(name, help=help, description=help, formatter_class=Help, allow_abbrev=False)

    memory.add_parser(command)
    workshop.add_parser(command)
    train.add_parser(command)
    compare.add_parser(command)
    recall.add_parser(command)
    eval_command.add_parser(command)
    export.add_parser(command, hf_types)
    generate.add_parser(command, hf_types)
    serve.add_parser(command)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or ``kill``'s stop) raised where the program is, as Ctrl-C's KeyboardInterrupt is."""


PACKAGE = Path(__file__).resolve().parent.parent          # subquad's own source


def _terminated(signum, frame):
    raise Terminated


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    # training stops on SIGTERM as on Ctrl-C: one line naming how to resume (the run keeps its newest
    # checkpoint, written atomically). `serve` has its own SIGTERM (drain); the others end as the signal ends them.
    before, shown = None, warnings.formatwarning
    if args.command == "train" and threading.current_thread() is threading.main_thread():
        before = signal.signal(signal.SIGTERM, _terminated)
    warnings.formatwarning = functools.partial(_one_line, shown)
    try:
        return _run(args)
    finally:
        warnings.formatwarning = shown     # a caller's own back (main() is also called in-process)
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def _one_line(other, message, category, filename, lineno, line=None):
    """subquad's own warnings (raised in its package) on the command line as "warning: ..." - not a file path and
    a source line; any other warning as ``other``, the format it had."""
    if issubclass(category, UserWarning) and Path(filename).resolve().is_relative_to(PACKAGE):
        return f"warning: {message}\n"
    return other(message, category, filename, lineno, line)


def _run(args) -> int:
    try:
        return args.fn(args)
    except ValueError as e:            # bad input found past argparse: a clear message, no traceback
        from subquad.distributed.launch import rank_error

        rank_error(f"error: {e}")      # under `--nproc`: once for the ranks that all said it (the launcher prints)
        return 2
    except (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError) as e:   # a path given wrong
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:     # Ctrl-C or SIGTERM: one line (the run keeps its newest checkpoint)
        out = getattr(args, "out", None)
        hint = f"; continue with: subquad train --resume --out {out}" if args.command == "train" and out else ""
        term = isinstance(e, Terminated)
        print(f"\n{'terminated' if term else 'interrupted'}{hint}", file=sys.stderr)
        return 143 if term else 130
