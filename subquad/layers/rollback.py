"""Rolling a state back to an accepted prefix: speculative decoding's verification (``models.speculative``).

A verification runs k tokens through a layer from its state ``before`` in one forward (y, ``after``); the
caller then accepts the first j <= k of them and needs the state after exactly those j, as if only they had
been fed. How each mixer gets it is declared in the table of mechanisms (``MixerEntry.rollback``):

    "truncate"   attention: the cache after verification without the last k - j entries (``KVCache.rollback``,
                 O(1)); a sliding window, which may have let older entries go, appends the j kept entries to
                 the cache before (at most 2W copied). A cache whose window is shorter than the k new tokens
                 has lost some of them: replayed.
    "replay"     a fixed-size state (a recurrence, a convolution's tail): the layer runs the j accepted tokens
                 again from ``before`` - exact for every recurrent form, and it holds no state per position.

Either way the result equals the state after a forward over those j tokens from ``before`` (float64: to
rounding), which is what ``subquad.testing.check_rollback`` checks for every entry of the table.
"""

from __future__ import annotations

import torch

from subquad.ops import KVCache

ROLLBACKS = ("truncate", "replay")


def truncate(before: dict, after: dict, T: int, keep: int) -> dict | None:
    """The state after the first ``keep`` of the ``T`` tokens that took ``before`` to ``after``, from the KV caches
    alone; None when the state holds anything else or a window has lost some of the T new entries (replay)."""
    out = {}
    for key, a in after.items():
        b = before[key]
        if not isinstance(a, KVCache) or len(a) < T:
            return None
        if a.window is None:
            out[key] = a.rollback(T - keep)
        else:                                         # the window may have slid: rebuild from the cache before
            n = len(a) - T
            out[key] = b.fork().append(a.k[:, n:n + keep], a.v[:, n:n + keep]) if keep else b
    return out


def roll_back(kind: str, before, after, T: int, keep: int, replay) -> dict:
    """The state after the first ``keep`` (0..T) of the ``T`` tokens a forward took from ``before`` to ``after``.

    ``kind``: the mixer's ``MixerEntry.rollback``; ``replay(keep)`` runs the kept tokens from ``before`` and
    returns the state (the way every kind falls back to). ``after`` must not be used once the result has been
    extended (its cache's positions past ``keep`` are given back)."""
    if kind not in ROLLBACKS:
        raise ValueError(f"rollback must be one of {ROLLBACKS}, got {kind!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= T:
        raise ValueError(f"keep must be an int in [0, {T}], got {keep!r}")
    if keep == T:
        return after
    if keep == 0 and before is not None:
        return before
    if kind == "truncate" and before is not None:
        s = truncate(before, after, T, keep)
        if s is not None:
            return s
    return replay(keep)


def same_state(a, b, atol: float = 1e-10) -> str | None:
    """None when two layer states hold the same values (KV caches: their live entries and counters), else what
    differs - for the checks of rollback."""
    if isinstance(a, KVCache) or isinstance(b, KVCache):
        if not (isinstance(a, KVCache) and isinstance(b, KVCache)):
            return "a KV cache against something else"
        if (a.seen, len(a), a.window) != (b.seen, len(b), b.window):
            return f"KV caches of (seen, length, window) {(a.seen, len(a), a.window)} != {(b.seen, len(b), b.window)}"
        for x, y in ((a.k, b.k), (a.v, b.v), (a.pad, b.pad), (a.row_seen, b.row_seen)):
            why = same_state(x, y, atol)
            if why:
                return why
        return None
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"state entries {sorted(a)} != {sorted(b) if isinstance(b, dict) else b!r}"
        for key in a:
            why = same_state(a[key], b[key], atol)
            if why:
                return f"{key}: {why}"
        return None
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return f"{tuple(a.shape)} {a.dtype} != {getattr(b, 'shape', b)} {getattr(b, 'dtype', '')}"
        if a.dtype in (torch.long, torch.int32, torch.bool):
            return None if torch.equal(a, b) else "integer entries differ"
        err = (a - b).abs().max().item() if a.numel() else 0.0
        return None if err <= atol else f"differ by {err:.3g}"
    return None if a == b else f"{a!r} != {b!r}"
