"""``subquad workshop``: the plate reproduced - the forms agree, memory, softmax against linear training."""

from __future__ import annotations

from subquad.cli.common import positive


def add_parser(command) -> None:
    w = command("workshop", "the plate, reproduced: forms agree, memory, softmax vs linear training")
    w.add_argument("--out", default="runs/workshop", help="output folder")
    w.add_argument("--head-dim", type=positive, default=32, help="head dimension of the memory table")
    w.add_argument("--seed", type=int, default=0, help="seed of the first training pair")
    w.add_argument("--steps", type=positive, default=600, help="training steps per run (the plate: 6000)")
    w.add_argument("--seeds", type=positive, default=1, help="repeat both runs with N seeds; report the gap's spread")
    w.add_argument("--data", default=None, help="corpus: stdlib, shakespeare, or a local path (default: stdlib)")
    w.add_argument("--positions", default="rope", choices=["rope", "learned"],
                   help="rope: rotary in softmax, none in linear; learned: the same learned absolute positions "
                        "in both")
    w.add_argument("--no-train", action="store_true", help="only the first half (forms agree, memory)")
    w.add_argument("--no-progress", action="store_true", help="no progress bars")
    w.set_defaults(fn=run)


def run(args) -> int:
    from subquad.bench import workshop

    workshop.run(out=args.out, head_dim=args.head_dim, seed=args.seed, steps=args.steps, seeds=args.seeds,
                 data=args.data, train=not args.no_train, progress=not args.no_progress, positions=args.positions)
    return 0
