"""The recall sweep: MQAR accuracy of 2-layer models for every mixer, against the bytes of state they keep.

Zoology's protocol (2 layers, no MLP by default, a short convolution before every attention-like mixer,
answer accuracy on held-out examples), scaled to 2 CPU cores: vocab 512 (not 8,192), (T, N) in {(64, 4), (128, 8), (256, 16)}, d_model in {64, 128}, learning
rates {3e-3, 1e-2} (the best kept per cell), seeds {0, 1}. Every cell has the same budget in optimizer
steps - never in seconds, so a table does not depend on the machine's speed - and stops early only on
reaching 99%. Results go to a JSON that a rerun resumes from (finished cells are skipped), a table of
mean and spread over seeds, and a PNG of accuracy against decoding-state bytes with the seeds' range.

Accuracy depends on the budget, so the table shows it and keys every cell by it, and one results file or
table holds one budget unless ``mix_budgets=True`` is asked for (each budget then has rows of its own).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from subquad.device import device_of, resolve_device
from subquad.models import LanguageModel, ModelConfig
from subquad.tasks import answer_accuracy, mqar
from subquad.train.trainer import decay_groups

CONV = 4   # Zoology's protocol: a short convolution before every attention-like mixer (see below)

# label -> (pattern, mixer options). Zoology puts a short convolution (its BaseConv) in front of every
# attention-like mixer; DeltaNet, Gated DeltaNet, Mamba and Mamba-2 have their own, and linear attention,
# its feature maps, RetNet and GLA get one here (``conv_size``, on q, k, v as fla's ``use_short_conv``).
# Without it they stay at chance on MQAR (the "no conv" rows): nothing in one layer binds a key to the value
# after it. Softmax and sliding-window attention keep none (a deviation: their layers have no such option;
# rotary positions let attention find the neighbouring token). The other mechanisms of the layer table
# (KDA, MLA, lightning, and any registered mixer) follow these rows under their own names (``sweep_rows``),
# with the table's ``recall`` options; lightning has no convolution option (MiniMax's layer has none).
MIXERS = {
    "softmax": ("softmax", {}),
    "sliding window (16)": ("swa", {"swa": {"window": 16}}),
    "linear (elu+1)": ("linear", {"linear": {"conv_size": CONV}}),
    "performer": ("performer", {"performer": {"conv_size": CONV}}),
    "taylor (Based)": ("taylor", {"taylor": {"conv_size": CONV}}),
    "retention (RetNet)": ("retention", {"retention": {"conv_size": CONV}}),
    "gla": ("gla", {"gla": {"conv_size": CONV}}),
    "linear (elu+1, no conv)": ("linear", {}),
    "retention (RetNet, no conv)": ("retention", {}),
    "gla (no conv)": ("gla", {}),
    "deltanet": ("deltanet", {}),
    "gated deltanet": ("gated_deltanet", {}),
    "mamba": ("mamba", {}),
    "mamba2": ("mamba2", {}),
    # the literature's hybrids, one attention layer in two: Mamba-2's and Jamba's (Mamba + attention),
    # DeltaNet's and Gated DeltaNet's papers (+ attention), Based (Taylor linear attention + a sliding window)
    "hybrid (mamba2, softmax)": ("mamba2,softmax", {}),
    "hybrid (gated deltanet, softmax)": ("gated_deltanet,softmax", {}),
    "hybrid (deltanet, softmax)": ("deltanet,softmax", {}),
    "hybrid (mamba, softmax)": ("mamba,softmax", {}),
    "hybrid (taylor, sliding window 16)": ("taylor,swa", {"taylor": {"conv_size": CONV}, "swa": {"window": 16}}),
}


def sweep_rows() -> dict:
    """The sweep's rows: ``MIXERS`` (labelled as in the published results), then every other mechanism of
    the layer table (``subquad.layers.registry``, a registered mixer included) under its own name, with
    the table's recall options (its short convolution); not the encoder-only ones (no language model)."""
    from subquad.layers.registry import MIXERS as TABLE

    rows = dict(MIXERS)
    covered = {pattern for pattern, _ in MIXERS.values()}
    for name, entry in TABLE.items():
        if name not in covered and name not in rows and not entry.encoder_only:
            rows[name] = (name, {name: dict(entry.recall)} if entry.recall else {})
    return rows


def cell_model(pattern, options, vocab, d_model, T, mlp, seed):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=2, n_heads=2 if d_model <= 64 else 4,
                      context_length=T, pattern=pattern, mixer_options=options, mlp=mlp)
    return LanguageModel(cfg)


def state_bytes(model, T):
    with torch.no_grad():
        return model.state_bytes(model.prefill(torch.zeros(1, T, dtype=torch.long, device=device_of(model)))[1])


DECAY = ("all", "matrices")


def optimizer(model, lr, decay="all"):
    """AdamW, weight decay 0.1. ``decay="all"``: on every parameter, as Zoology's trainer; ``"matrices"``:
    ``subquad train``'s groups (``decay_groups``: none on norms, biases, Mamba's A_log, D, dt_bias)."""
    if decay not in DECAY:
        raise ValueError(f"decay must be one of {DECAY}, got {decay!r}")
    if decay == "all":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    return torch.optim.AdamW(decay_groups(model, 0.1), lr=lr)


def train_cell(pattern, options, *, T, N, vocab, d_model, lr, steps, batch, mlp, seed, log, device="cpu",
               decay="all"):
    """Train one cell for at most ``steps`` optimizer steps (stopping at 99% held-out answer accuracy)."""
    dev = resolve_device(device)
    xtr, ytr = mqar(20_000 if steps * batch > 20_000 else steps * batch, T, N, vocab, seed=seed)
    xte, yte = mqar(1_000, T, N, vocab, seed=seed + 10_000)
    xtr, ytr, xte, yte = (t.to(dev) for t in (xtr, ytr, xte, yte))      # data generated on the CPU, then moved
    model = cell_model(pattern, options, vocab, d_model, T, mlp, seed).to(dev)
    opt = optimizer(model, lr, decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    best, t0, step = 0.0, time.time(), 0
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(xtr), (batch,), generator=g, device=g.device).to(dev)
        logits = model(xtr[idx])
        loss = F.cross_entropy(logits.reshape(-1, vocab), ytr[idx].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps:
            with torch.no_grad():
                acc = sum(answer_accuracy(model(xte[i:i + 250]), yte[i:i + 250]) for i in range(0, 1000, 250)) / 4
            best = max(best, acc)
            log(f"step {step}: loss {loss.item():.3f}, accuracy {acc:.3f}")
            if acc >= 0.99:
                break
    return {"accuracy": best, "steps": step, "seconds": round(time.time() - t0, 1),
            "state_bytes": state_bytes(model, T), "parameters": model.num_parameters()}


def sweep(out="runs/recall", mixers=None, sizes=((64, 4), (128, 8), (256, 16)), d_models=(64, 128),
          lrs=(3e-3, 1e-2), vocab=512, steps=1500, batch=64, mlp=False, seeds=(0, 1), progress=True, log=print,
          device="cpu", decay="all", mix_budgets=False) -> dict:
    """Train every missing cell into ``out/recall.json``. A file that holds cells of another step budget is
    refused before any training, unless ``mix_budgets=True`` (its table would mix budgets; see ``table``)."""
    out = Path(out)
    path = out / "recall.json"
    results = json.loads(path.read_text()) if path.exists() else {"cells": {}}
    others = budgets(results) - {steps}
    if others and not mix_budgets:
        raise ValueError(f"{path} holds cells trained with a budget of {_steps(others)}; this sweep asks for "
                         f"{steps:,} steps, and one table would mix the two. Keep the budget (--steps), write to "
                         f"another folder (--out), or pass --mix-budgets (mix_budgets=True) to keep both, each on rows "
                         f"of its own")
    out.mkdir(parents=True, exist_ok=True)
    rows = sweep_rows()
    names = list(mixers or rows)
    for n in names:
        if n not in rows:
            raise ValueError(f"unknown mixer {n!r} for the recall sweep; known: {', '.join(rows)}")
    cells = [(n, T, N, d, lr, seed) for d in d_models for (T, N) in sizes for n in names for lr in lrs
             for seed in seeds]
    t_start = time.time()
    for i, (n, T, N, d, lr, seed) in enumerate(cells, 1):
        key = f"{n}|T={T}|N={N}|d={d}|lr={lr}|vocab={vocab}|mlp={mlp}|seed={seed}|steps={steps}" + (
            "" if decay == "all" else f"|decay={decay}")
        if key in results["cells"]:
            continue
        pattern, options = rows[n]
        log(f"[{i}/{len(cells)}] {n}, T={T}, N={N}, d_model={d}, lr={lr}, seed {seed} "
            f"({time.time() - t_start:.0f} s so far)")
        r = train_cell(pattern, options, T=T, N=N, vocab=vocab, d_model=d, lr=lr, steps=steps, batch=batch, mlp=mlp,
                       seed=seed, device=device, decay=decay,
                       log=(lambda m: log("    " + m)) if progress else (lambda m: None))
        r.update({"mixer": n, "T": T, "N": N, "d_model": d, "lr": lr, "vocab": vocab, "mlp": mlp, "seed": seed,
                  "budget": steps, "decay": decay})
        results["cells"][key] = r
        log(f"    -> accuracy {r['accuracy']:.3f} after {r['steps']} steps ({r['seconds']} s), "
            f"state {r['state_bytes']:,} B")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(path)
    results["seconds_this_run"] = round(time.time() - t_start, 1)
    return results


def budgets(results) -> set:
    """The step budgets of the cells in ``results`` (None for a cell that does not record its own)."""
    return {r.get("budget") for r in results["cells"].values()}


def _steps(bs) -> str:
    return " and ".join(f"{b:,} steps" if b is not None else "an unrecorded number of steps"
                        for b in sorted(bs, key=lambda b: (b is None, b or 0)))


def best_per_cell(results, vocab=None):
    """(mixer, T, N, d_model, budget) -> the learning rate whose mean accuracy over seeds is best, among those
    with the most seeds run: {"accuracy" (mean), "low", "high" (the seeds' range), "seeds", "lr", "lrs" (how
    many learning rates the cell has run), "state_bytes", "steps" (mean), "budget"}. Cells of different step
    budgets are never compared or pooled."""
    groups = {}
    for r in results["cells"].values():
        if vocab is not None and r["vocab"] != vocab:
            continue
        label = r["mixer"] + ("" if r.get("decay", "all") == "all" else f" [decay: {r['decay']}]")   # its own row
        groups.setdefault((label, r["T"], r["N"], r["d_model"], r.get("budget"), r["lr"]), []).append(r)
    best, tried = {}, {}
    for (m, T, N, d, budget, lr), rs in groups.items():      # seeds of one learning rate and step budget
        accs = [r["accuracy"] for r in rs]
        cell = {"accuracy": sum(accs) / len(accs), "low": min(accs), "high": max(accs), "seeds": len(rs), "lr": lr,
                "state_bytes": rs[0]["state_bytes"], "steps": sum(r["steps"] for r in rs) / len(rs),
                "budget": budget}
        k = (m, T, N, d, budget)
        tried[k] = tried.get(k, 0) + 1
        # a learning rate with all its seeds run beats one still missing some; then the better mean
        if k not in best or (cell["seeds"], cell["accuracy"]) > (best[k]["seeds"], best[k]["accuracy"]):
            best[k] = cell
    for k, n in tried.items():
        best[k]["lrs"] = n
    return best


def _rows(best):
    """(label, budget) rows in ``MIXERS``' order, each variant (``[decay: ...]``) after its mixer, others last;
    a mixer's budgets in increasing order."""
    order = {m: i for i, m in enumerate(sweep_rows())}
    rows = dict.fromkeys((k[0], k[4]) for k in best)
    return sorted(rows, key=lambda r: (order.get(r[0].split(" [")[0], len(order)), r[0], r[1] is None, r[1] or 0))


def _single_budget(results, mix_budgets):
    """Refuse results of several step budgets unless asked to mix them."""
    bs = budgets(results)
    if len(bs) > 1 and not mix_budgets:
        raise ValueError(f"the recall results mix step budgets ({_steps(bs)}): accuracies at different budgets "
                         f"are not comparable in one table. Pass --mix-budgets (mix_budgets=True) to show each budget "
                         f"on rows of its own, or keep one budget per results file")


def _lr(lr) -> str:
    return f"{lr:.0e}".replace("e-0", "e-").replace("e+0", "e")


def _cell_text(c, spread=True) -> str:
    """``mean (low-high) @lr`` (``spread=False``: without the seeds' range), ``†`` where the cell has run one
    learning rate only."""
    acc = f"{c['accuracy']:.2f}" + (f" ({c['low']:.2f}-{c['high']:.2f})" if spread and c["seeds"] > 1 else "")
    return f"{acc} @{_lr(c['lr'])}" + ("†" if c["lrs"] < 2 else "")


def _columns(best):
    """The (T, N, d_model) cells of ``best``, by width, then length."""
    return sorted({(k[1], k[2], k[3]) for k in best}, key=lambda c: (c[2], c[0]))


def table(results, mix_budgets=False) -> str:
    """Mean accuracy over seeds (the seeds' range) of the best learning rate per cell, that learning rate after
    ``@``, one row per mixer and step budget; ``†`` marks a cell that has run one learning rate only. Results
    of more than one budget are refused unless ``mix_budgets=True``."""
    _single_budget(results, mix_budgets)
    best = best_per_cell(results)
    cols = _columns(best)
    head = ("| mixer | budget (steps) | " + " | ".join(f"T={T}, N={N}, d={d}" for T, N, d in cols)
            + " | state bytes (largest T) |")
    lines = [head, "|---|---|" + "---|" * (len(cols) + 1)]
    for m, budget in _rows(best):
        cells = [best.get((m, T, N, d, budget)) for T, N, d in cols]
        sb = max((c["state_bytes"] for c in cells if c), default=0)
        lines.append(f"| {m} | {'?' if budget is None else f'{budget:,}'} | "
                     + " | ".join(_cell_text(c) if c else "—" for c in cells) + f" | {sb:,} |")
    return "\n".join(lines)


def plot(results, path, mix_budgets=False):
    """Accuracy against decoding-state bytes, one panel per (T, N, d_model) (Zoology's figure 2), the
    seeds' range as error bars; one colour and marker per mixer (and budget, where mixed) across panels, one
    legend below. Results of more than one step budget are refused unless ``mix_budgets=True``."""
    from subquad.bench import plots  # noqa: F401  (Agg backend)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    _single_budget(results, mix_budgets)
    best = best_per_cell(results)
    sizes = _columns(best)
    series = _rows(best)                                     # (label, budget)
    mixed = len({b for _, b in series}) > 1
    name = {(m, b): f"{m} ({'?' if b is None else f'{b:,}'} steps)" if mixed else m for m, b in series}
    cmap = plt.get_cmap("tab10")
    style = {s: (cmap(i % 10), "osD^vP*Xhp<>"[i % 12]) for i, s in enumerate(series)}
    cols = min(3, len(sizes))
    rows = -(-len(sizes) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows + 1.2), squeeze=False)
    for ax, (T, N, d) in zip(axes.flat, sizes):
        for m, b in series:
            r = best.get((m, T, N, d, b))
            if r is None:
                continue
            err = [[r["accuracy"] - r["low"]], [r["high"] - r["accuracy"]]]
            color, marker = style[m, b]
            ax.errorbar(r["state_bytes"], r["accuracy"], yerr=err, fmt=marker, color=color, ms=6, capsize=3,
                        label=name[m, b])
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e3:g} kB"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("decoding state at T (bytes, log)")
        ax.set_ylabel("MQAR accuracy (mean, seeds' range)")
        ax.set_title(f"MQAR T={T}, N={N} pairs, d_model={d}" + ("" if mixed else f", {_steps({series[0][1]})}"))
        ax.set_ylim(-0.02, 1.05)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(sizes):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=style[s][0], marker=style[s][1], ls="", ms=7) for s in series]
    fig.legend(handles, [name[s] for s in series], loc="lower center", ncol=min(4, len(series)), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * (-(-len(series) // 4)), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def grid(results, path, mix_budgets=False):
    """The table as a heat map: one row per mixer (and budget), one column per (T, N, d_model), each square
    coloured by the mean accuracy of its best learning rate and labelled with it and that learning rate
    (``†``: the only one run); an empty cell is left blank."""
    from subquad.bench import plots  # noqa: F401  (Agg backend)
    import matplotlib.pyplot as plt
    import numpy as np

    _single_budget(results, mix_budgets)
    best = best_per_cell(results)
    cols = _columns(best)
    rows = _rows(best)
    cells = {(i, j): best[m, T, N, d, b] for i, (m, b) in enumerate(rows) for j, (T, N, d) in enumerate(cols)
             if (m, T, N, d, b) in best}
    acc = np.full((len(rows), len(cols)), np.nan)
    for (i, j), c in cells.items():
        acc[i, j] = c["accuracy"]
    fig, ax = plt.subplots(figsize=(2.0 + 1.45 * len(cols) + 2.6, 1.2 + 0.34 * len(rows)))
    im = ax.imshow(np.ma.masked_invalid(acc), cmap="viridis", vmin=0, vmax=1, aspect="auto")
    for (i, j), c in cells.items():
        ax.text(j, i, _cell_text(c, spread=False), ha="center", va="center", fontsize=7.5,
                color="black" if c["accuracy"] > 0.6 else "white")
    mixed = len({b for _, b in rows}) > 1
    ax.set_yticks(range(len(rows)), [f"{m} ({b:,} steps)" if mixed and b else m for m, b in rows], fontsize=8)
    ax.set_xticks(range(len(cols)), [f"T={T}, N={N}\nd={d}" for T, N, d in cols], fontsize=8)
    ax.xaxis.tick_top()
    budget = "" if mixed else f", {_steps({rows[0][1]})}" if rows else ""
    ax.set_title(f"MQAR accuracy (mean over seeds, best learning rate; † one learning rate run){budget}",
                 fontsize=9, pad=28)
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
