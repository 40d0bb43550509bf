"""Training runs side by side (``subquad compare``): each run folder's config and metrics.jsonl read into one
row, and the held-out and training loss curves overlaid in one figure.

    tokens read  = the sum of the records' "tokens" (a step's over every data-parallel stream); records from
                   before they were logged: batch_size * context * processes / context_parallel of the last start
    tokens/s     = a record's tokens_per_s (one process's) * its tokens / (batch_size * context): every stream's
    training loss shown = exponential moving average, factor ``SMOOTH``, of the per-step loss

Losses are nats per token of each run's own tokenizer: runs with different tokenizers or corpora (their
sha256 in config.json) are compared with a warning, as the numbers then measure different things.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

SMOOTH = 0.9


def read_run(path) -> dict:
    """One run folder -> {"name", "pattern", "params", "steps", "tokens", "tokens_at" {step: tokens read by then},
    "curve" [(step, held-out)],
    "train" [(step, loss)], "last", "best", "best_step", "tokens_per_s", "tokenizer", "corpus"}; ValueError
    naming the folder when it holds no run or no metrics yet."""
    import torch

    from subquad.models import LanguageModel, ModelConfig
    from subquad.train.run import read_run_config
    from subquad.train.trainer import read_metrics

    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not a training run folder (no config.json there)")
    cfg = read_run_config(path)
    records = read_metrics(path / "metrics.jsonl")
    if not records:
        raise ValueError(f"{path} has no metrics yet (metrics.jsonl is missing or empty)")
    mcfg = ModelConfig.from_dict(cfg["model"])
    with torch.device("meta"):
        params = sum(p.numel() for p in LanguageModel(mcfg).parameters())
    tr = cfg["train"]
    ranks = max(1, int(cfg.get("world") or 1) // tr.get("context_parallel", 1))   # a context-parallel group: 1 batch
    curve = [(r["step"], r["heldout_loss"]) for r in records if r.get("heldout_loss") is not None]
    one = tr["batch_size"] * mcfg.context_length                     # a process's (or a group's) tokens a step
    per_step = [r.get("tokens", one * ranks) for r in records]
    rates = sorted(r["tokens_per_s"] * n / one for r, n in zip(records, per_step) if r.get("tokens_per_s"))
    best = min(curve, key=lambda p: p[1]) if curve else (None, None)
    return {"name": path.resolve().name, "path": str(path), "pattern": mcfg.pattern, "params": params,
            "steps": records[-1]["step"], "tokens": sum(per_step),
            "tokens_at": dict(zip((r["step"] for r in records), itertools.accumulate(per_step))),
            "curve": curve, "train": [(r["step"], r["loss"]) for r in records if _finite(r.get("loss"))],
            "last": curve[-1][1] if curve else None, "best": best[1], "best_step": best[0],
            "tokens_per_s": rates[len(rates) // 2] if rates else None,
            "tokenizer": cfg.get("tokenizer_sha256"), "corpus": cfg.get("corpus_sha256")}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def smoothed(points: list[tuple[int, float]], factor: float = SMOOTH) -> list[tuple[int, float]]:
    """Exponential moving average of (step, value) points, bias-corrected as TensorBoard's (the first point is
    itself, not pulled towards 0)."""
    out, avg, weight = [], 0.0, 0.0
    for step, v in points:
        avg = factor * avg + (1 - factor) * v
        weight = factor * weight + (1 - factor)
        out.append((step, avg / weight))
    return out


def mismatches(runs: list[dict]) -> list[str]:
    """Warnings where the runs' losses do not measure the same thing (another tokenizer or corpus)."""
    said = []
    for key, what in (("tokenizer", "tokenizer"), ("corpus", "corpus")):
        groups = {}
        for r in runs:
            if r[key] is not None:                  # a run from before the hash was recorded: unknown, not other
                groups.setdefault(r[key], []).append(r["name"])
        if len(groups) > 1:
            names = "; ".join(", ".join(g) for g in groups.values())
            said.append(f"the runs used {len(groups)} different {what}s ({names}): their losses per token are not "
                        "comparable")
    return said


def figure(runs: list[dict], path, x: str = "step") -> None:
    """Held-out loss (left) and smoothed training loss (right) of every run against ``x``, "step" or "tokens"."""
    from subquad.bench.plots import plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, r in enumerate(runs):
        color = f"C{i % 10}"
        at = r["tokens_at"] if x == "tokens" else {s: s for s in r["tokens_at"]}
        label = f"{r['name']} ({r['pattern']}, {r['params'] / 1e6:.2f}M)"
        if r["curve"]:
            axes[0].plot([at[s] for s, _ in r["curve"]], [v for _, v in r["curve"]], "o-", ms=3, color=color,
                         label=label)
        sm = smoothed(r["train"])
        axes[1].plot([at[s] for s, _ in sm], [v for _, v in sm], "-", color=color, label=label)
    for ax, title in zip(axes, ("Held-out loss", f"Training loss (moving average {SMOOTH})")):
        ax.set_xlabel("tokens read" if x == "tokens" else "step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
