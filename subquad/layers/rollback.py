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
    "states"     a fixed-size state built only by ``seq.recurrence`` and ``seq.causal_conv``: the compiled
                 verification (``models.decode``) runs the layer under ``PerToken``, which keeps the state
                 after each of the k tokens, (B, k, ...) per entry, and accepting j takes the j-th
                 (``pick``) - no second pass over the layer's weights. Outside it such a layer is replayed.

Either way the result equals the state after a forward over those j tokens from ``before`` (float64: to
rounding), which is what ``subquad.testing.check_rollback`` checks for every entry of the table.
"""

from __future__ import annotations

import torch

from subquad.layers.sequence import SingleDevice
from subquad.ops import KVCache

ROLLBACKS = ("truncate", "replay", "states")


class PerToken(SingleDevice):
    """The sequence backend of a verification that keeps the state after every token ("states" above): each
    recurrence runs one token at a time from the state before (its recurrent form: a few fused loops per token
    in a compiled graph, while the layer's projections still run over all k tokens at once) and returns the
    states after each, stacked on dim 1; a causal convolution returns its tail after each token, (B, k, reach,
    ...), cut from [tail, x]. Outputs are those of ``SingleDevice``. An op with a ``per_token`` function (the
    selective scan's C kernel) gives the states after every token in one call where it can (else None)."""

    def recurrence(self, op, *inputs, initial_state=None, **options):
        every = getattr(op, "per_token", None)
        out = None if every is None or torch.compiler.is_compiling() else \
            every(*inputs, initial_state=initial_state, **options)
        if out is not None:
            return out
        timed, names = getattr(op, "token_args", None), getattr(op, "arg_names", None)
        if timed is None:
            raise ValueError(f"{getattr(op, '__name__', op)!r} does not declare its per-token arguments "
                             "(ops.common.varlen): a verification cannot keep its states per token")
        args = list(inputs)
        at = [i for i, a in enumerate(args) if names[i] in timed and a is not None]
        kw = [k for k, v in options.items() if k in timed and v is not None]
        T = (args[at[0]] if at else options[kw[0]]).shape[1]
        ys, states, S = [], [], initial_state
        for t in range(T):
            a = [x[:, t:t + 1] if i in at else x for i, x in enumerate(args)]
            o = {k: (v[:, t:t + 1] if k in kw else v) for k, v in options.items()}
            y, S = op(*a, initial_state=S, output_final_state=True, **o)
            ys.append(y)
            states.append(S)
        if isinstance(S, tuple):
            S = tuple(torch.stack([s[i] for s in states], 1) for i in range(len(S)))
        else:
            S = torch.stack(states, 1)
        return torch.cat(ys, 1), S

    def causal_conv(self, conv, x, reach: int, tail=None):
        y, new = conv(x, tail)
        if tail is None:                  # from an empty state: nothing before x (a verification has a state)
            tail = torch.zeros_like(new)
        full = torch.cat([tail.to(new.dtype), x.to(new.dtype)], 1)          # (B, reach + T, ...)
        return y, torch.stack([full[:, t + 1:t + 1 + reach] for t in range(x.shape[1])], 1)


PER_TOKEN = PerToken()


def pick(before, after, keep):
    """The entry of a "states" part after the first ``keep`` verified tokens: ``after`` (B, k, ...) holds it
    after each; ``keep`` an int (0: ``before``) or one count >= 1 per row ((B,) long tensor)."""
    if isinstance(keep, torch.Tensor):
        return after[torch.arange(after.shape[0], device=after.device), keep.to(after.device) - 1]
    return before if keep == 0 else after[:, keep - 1].contiguous()


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
