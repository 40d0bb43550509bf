"""Multi-query associative recall (MQAR), as defined by Zoology (Arora et al. 2023, arXiv:2312.04927).

A sequence of T tokens opens with N key-value pairs ``k1 v1 k2 v2 ...`` (keys from
the first half of the vocabulary, values from the second), then queries: each
key appears once more, at a position drawn with Zoology's power-law spacing (so
most queries come soon after the context, a few far later), the other positions
hold random tokens. The model must emit the key's value right after the query:
labels are -100 everywhere except at those N positions.

    inputs (n, T) int64, labels (n, T) int64 with exactly N labels >= 0 per row
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE = -100


def mqar(n: int, seq_len: int, num_kv_pairs: int, vocab_size: int, seed: int = 0, power_a: float = 0.01,
         random_non_queries: bool = True):
    if vocab_size <= seq_len:
        raise ValueError(f"MQAR needs vocab_size > seq_len, got vocab_size={vocab_size}, seq_len={seq_len}")
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(f"MQAR needs 4 * num_kv_pairs <= seq_len, got num_kv_pairs={num_kv_pairs}, seq_len={seq_len}")
    if seq_len % 2:
        raise ValueError(f"MQAR needs an even seq_len, got {seq_len}")
    if num_kv_pairs < 1 or n < 1:
        raise ValueError(f"num_kv_pairs and n must be >= 1, got {num_kv_pairs} and {n}")
    rng = np.random.default_rng(seed)
    half = vocab_size // 2
    context = 2 * num_kv_pairs
    keys = np.stack([rng.choice(np.arange(1, half), num_kv_pairs, replace=False) for _ in range(n)])
    values = np.stack([rng.choice(np.arange(half, vocab_size), num_kv_pairs, replace=False) for _ in range(n)])
    kvs = np.zeros((n, context), dtype=np.int64)
    kvs[:, 0::2], kvs[:, 1::2] = keys, values
    space = (seq_len - context) // 2
    p = power_a * np.arange(1, space + 1) ** (power_a - 1)
    p /= p.sum()
    gaps = np.stack([rng.choice(space, num_kv_pairs, replace=False, p=p) for _ in range(n)])
    queries = np.zeros((n, seq_len - context + 1), dtype=np.int64)
    np.put_along_axis(queries, gaps * 2, keys, axis=1)
    examples = np.concatenate([kvs, queries], axis=1)
    labels = np.full((n, seq_len + 1), IGNORE, dtype=np.int64)
    np.put_along_axis(labels, gaps * 2 + context + 1, values, axis=1)
    inputs, labels = torch.from_numpy(examples[:, :-1].copy()), torch.from_numpy(labels[:, 1:].copy())
    if random_non_queries:
        fill = torch.from_numpy(rng.integers(0, vocab_size, size=inputs.shape))
        inputs = torch.where(inputs == 0, fill, inputs)
    return inputs, labels


def answer_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of answer positions (labels != -100) whose argmax is the value; other positions do not count."""
    mask = labels != IGNORE
    if not mask.any():
        raise ValueError("labels hold no answer positions")
    return (logits.argmax(-1)[mask] == labels[mask]).float().mean().item()
