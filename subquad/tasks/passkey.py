"""Passkey retrieval: a number hidden at a chosen depth in filler text, then asked for (Mohtashami & Jaggi 2023,
"Landmark attention"; the needle-in-a-haystack family). Where a fixed-state model is weakest: the key must
survive every token after it in a state of fixed size, while attention's cache keeps it verbatim.

A prompt of ``length`` tokens, built in tokens so its length is exact:

    filler ... "The pass key is 48213. Remember it. 48213 is the pass key." ... filler
    "What is the pass key? The pass key is"

with the needle starting at ``depth`` (0: the start, 1: just before the question) of the filler. A trial is
right when the greedy continuation's first tokens are the key's tokens (" 48213"). The model reads the
prompt in pieces of ``piece`` tokens with its state carried, so any length runs in bounded memory.
"""

from __future__ import annotations

import random

import torch

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"


def passkey_prompt(encode, length: int, depth: float, key: int) -> tuple[list[int], list[int], int]:
    """(prompt ids of exactly ``length`` tokens, the key's answer ids, where the needle starts). ``encode``:
    text -> ids."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth!r}")
    needle, question, answer = encode(NEEDLE.format(key=key)), encode(QUESTION), encode(f" {key}")
    room = length - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"length {length} is shorter than the needle and question ({len(needle) + len(question)} "
                         f"tokens)")
    unit = encode(FILLER)
    filler = (unit * (room // len(unit) + 1))[:room]
    at = round(depth * room)
    return filler[:at] + needle + filler[at:] + question, answer, at


def passkey_batch(encode, length: int, batch: int, rng: random.Random, pad: int = 0,
                  repeat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch for the task: ``batch`` prompts of ``length`` tokens, each with a random 5-digit key at a
    depth drawn uniformly from [0, 1], followed by the key's answer tokens. (x (B, T), y (B, T)) with
    T = ``length`` + the longest answer - 1: x the tokens, y the next token where it is an answer token and -100
    everywhere else, so the loss is the retrieval alone (the filler is trivially predictable and would only dilute
    it). With ``repeat`` the key's second copy inside the needle ("Remember it. 48213 is ...") is a target too:
    the same retrieval a few tokens back, a denser signal while the copying circuit forms. Rows with a shorter
    answer end in ``pad`` tokens, which no target reads and causal models never see before their answer."""
    rows, repeats = [], []
    for _ in range(batch):
        ids, want, at = passkey_prompt(encode, length, rng.random(), rng.randrange(10000, 100000))
        rows.append((ids + want, len(want)))
        hits = [i for i in range(at, length - len(want) + 1) if ids[i:i + len(want)] == want]
        repeats.append(hits[1] if repeat and len(hits) > 1 else None)     # hits[0]: the first copy, unknowable
    T = length + max(n for _, n in rows) - 1
    x = torch.full((batch, T), pad, dtype=torch.long)
    y = torch.full((batch, T), -100, dtype=torch.long)
    for b, (seq, n) in enumerate(rows):
        x[b, :len(seq) - 1] = torch.tensor(seq[:-1])
        y[b, length - 1:length - 1 + n] = torch.tensor(seq[length:])   # the question's last token predicts the first
        if repeats[b] is not None:
            r = repeats[b]
            y[b, r - 1:r - 1 + n] = torch.tensor(seq[r:r + n])
    return x, y


@torch.no_grad()
def answer(model, ids: list[int], n: int, piece: int = 2048) -> tuple[list[int], int]:
    """(the ``n`` greedy tokens after ``ids``, the state's bytes after the prompt)."""
    from subquad.models.rows import state_nbytes

    dev = model.embed.weight.device
    state, logits = None, None
    for s in range(0, len(ids), piece):
        logits, state = model.prefill(torch.tensor(ids[s:s + piece], device=dev).view(1, -1), state)
    nbytes = state_nbytes(state)
    out = [int(logits[0, -1].argmax())]
    while len(out) < n:
        logits, state = model.step(torch.tensor([out[-1]], device=dev), state)
        out.append(int(logits[0].argmax()))
    return out, nbytes


def passkey_sweep(model, encode, lengths: list[int], depths: list[float], trials: int = 5, seed: int = 0,
                  piece: int = 2048, progress=None) -> list[dict]:
    """Accuracy per (length, depth) over ``trials`` random 5-digit keys, and the state's bytes at that length."""
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        for depth in depths:
            right, nbytes = 0, 0
            for _ in range(trials):
                ids, want, _ = passkey_prompt(encode, length, depth, rng.randrange(10000, 100000))
                got, nbytes = answer(model, ids, len(want), piece)
                right += got == want
            rows.append({"length": length, "depth": depth, "accuracy": right / trials, "trials": trials,
                         "state_bytes": nbytes})
            if progress is not None:
                progress(rows[-1])
    return rows


def heatmap(rows: list[dict], path, title: str = "passkey retrieval") -> None:
    """A PNG of accuracy by length (columns) and depth (rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    acc = {(r["length"], r["depth"]): r["accuracy"] for r in rows}
    grid = [[acc.get((n, d), float("nan")) for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.5 * len(depths)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
