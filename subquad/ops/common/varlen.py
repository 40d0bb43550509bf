"""Variable-length batches: ``cu_seqlens`` for every op (flash-linear-attention's convention).

    o, final_state = op(q, k, v, ..., cu_seqlens=cu, initial_state=None or (N, ...))

Inputs arrive packed as one row (B = 1) of T = sum of the N lengths; ``cu_seqlens`` (N + 1,) holds
the cumulative lengths [0, l_1, l_1 + l_2, ..., T] as an integer tensor. Each sequence starts from
its own initial state (row i of ``initial_state``, or zeros) and nothing crosses a boundary: the
final state has one row per sequence, (N, ...); softmax attention's are N ``KVCache``s (a list),
its window stopping at each sequence's start.

How: the per-token inputs are split at the boundaries (``torch.split``: its backward is one
concatenation) and the op runs in the form asked for - chunked, so a boundary inside a chunk costs
nothing - once per distinct length, the sequences of one length stacked as a batch (a packed training
batch is mostly whole rows of one length), and the outputs are put back in order. The work is the sum
of the sequences' work, with no padding; the price is one op call per distinct length, which
``benchmarks/bench_varlen.py`` measures against padding (benchmarks/RESULTS.md). An op that can read the
packed row itself says when (``native``) and is then called once with ``cu_seqlens`` (Mamba's selective scan in
C: no copies of the inputs into a batch and back).
"""

from __future__ import annotations

import functools
import inspect

import torch


def seq_lengths(cu_seqlens, T: int | None, B: int) -> list[int]:
    """The N lengths of ``cu_seqlens`` after checking it against packed inputs of B rows and T tokens (``T`` None:
    as many tokens as its last entry says)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor (N + 1,) of cumulative lengths, got "
                         f"{getattr(cu_seqlens, 'shape', type(cu_seqlens).__name__)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device.type == "meta":
        raise ValueError("cu_seqlens must hold its lengths (a CPU or accelerator tensor), got a tensor on the meta "
                         "device, which has none")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold at least two entries (one sequence), got {cu_seqlens.numel()}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed into one row: the batch must be 1, got {B}")
    cu = cu_seqlens.tolist()
    T = cu[-1] if T is None else T
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu[0]} ... {cu[-1]}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if min(lengths) < 1:
        raise ValueError(f"cu_seqlens must be strictly increasing (every sequence holds a token), got {cu}")
    return lengths


def _split_state(state, N: int, kind: str) -> list:
    """Per-sequence initial states from (N, ...) tensors, a tuple of them, or (softmax) a list of caches."""
    if state is None:
        return [None] * N
    if kind == "caches":
        if not isinstance(state, (list, tuple)) or len(state) != N:
            raise ValueError(f"with cu_seqlens, initial_state must be a list of N={N} KV caches (or None entries)")
        return list(state)
    parts = state if isinstance(state, tuple) else (state,)
    for p in parts:
        if not isinstance(p, torch.Tensor) or p.dim() < 1 or p.shape[0] != N:
            raise ValueError(f"with cu_seqlens, initial_state must hold one state per sequence, (N={N}, ...); got "
                             f"{getattr(p, 'shape', type(p).__name__)}")
    rows = [p.split(1, 0) for p in parts]
    return [tuple(r[i] for r in rows) if isinstance(state, tuple) else rows[0][i] for i in range(N)]


def _groups(lengths: list, inits: list, kind: str) -> list:
    """Indices of sequences that run as one batched call: those of one length (a packed training batch is
    mostly whole rows of one length), except softmax sequences continuing a cache, which run alone."""
    by_length: dict = {}
    for i, L in enumerate(lengths):
        if kind == "caches" and inits[i] is not None:
            by_length[(L, i)] = [i]
        else:
            by_length.setdefault(L, []).append(i)
    return list(by_length.values())


def _rows(pieces, idxs):
    return pieces[idxs[0]] if len(idxs) == 1 else torch.cat([pieces[i] for i in idxs], 0)


def _rows_state(inits, idxs, kind):
    first = inits[idxs[0]]
    if first is None or len(idxs) == 1:
        return first
    if isinstance(first, tuple):
        return tuple(torch.cat([inits[i][j] for i in idxs], 0) for j in range(len(first)))
    return torch.cat([inits[i] for i in idxs], 0)


def _unrows(state, n: int, kind: str) -> list:
    """A batched call's final state as one state per row."""
    if state is None:
        return [None] * n
    if kind == "caches":
        return [state] if n == 1 else state.unstack()
    if isinstance(state, tuple):
        return list(zip(*(p.split(1, 0) for p in state)))
    return list(state.split(1, 0))


def _join_states(states: list, kind: str):
    if states[0] is None:
        return None
    if kind == "caches":
        return states
    if isinstance(states[0], tuple):
        return tuple(torch.cat(parts, 0) for parts in zip(*states))
    return torch.cat(states, 0)


def varlen(*token_args: str, states: str = "tensors", native=None):
    """Give an op the ``cu_seqlens`` keyword (see the module docstring). ``token_args``: the arguments
    with a time axis (dim 1) to split; ``states``: "tensors" ((N, ...) tensors or tuples of them) or
    "caches" (softmax attention: a list of N KV caches). ``native(arguments) -> bool``: whether the op takes
    these packed inputs itself in one call (its own ``cu_seqlens`` keyword, checked here first)."""
    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args, cu_seqlens=None, **kwargs):
            if cu_seqlens is None:
                return fn(*args, **kwargs)
            a = sig.bind(*args, **kwargs)
            a.apply_defaults()
            a = dict(a.arguments)
            first = a[token_args[0]]
            if not isinstance(first, torch.Tensor) or first.dim() < 3:
                raise ValueError(f"{token_args[0]} must be a packed tensor (1, T, ...), got "
                                 f"{getattr(first, 'shape', type(first).__name__)}")
            T = first.shape[1]
            lengths = seq_lengths(cu_seqlens, T, first.shape[0])
            N = len(lengths)
            pieces = {}
            for name in token_args:
                t = a.get(name)
                if t is None:
                    continue
                if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[:2] != first.shape[:2]:
                    raise ValueError(f"{name} must be packed as {token_args[0]}: (1, T={T}, ...), got "
                                     f"{getattr(t, 'shape', type(t).__name__)}")
                pieces[name] = t
            if native is not None and native(a):
                return fn(**{**a, "cu_seqlens": cu_seqlens})
            pieces = {name: t.split(lengths, 1) for name, t in pieces.items()}
            inits = _split_state(a.get("initial_state"), N, states)
            o_parts, finals, lse_parts = [None] * N, [None] * N, [None] * N
            for idxs in _groups(lengths, inits, states):
                call = {**a, **{n: _rows(p, idxs) for n, p in pieces.items()},
                        "initial_state": _rows_state(inits, idxs, states)}
                out = fn(**call)
                rows = out[0].split(1, 0)
                row_states = _unrows(out[1], len(idxs), states)
                for r, i in enumerate(idxs):
                    o_parts[i], finals[i] = rows[r], row_states[r]
                    if len(out) == 3:
                        lse_parts[i] = out[2][r:r + 1]
            o = torch.cat(o_parts, 1)
            final = _join_states(finals, states)
            if lse_parts[0] is not None:                             # softmax's lse (B, T, H)
                return o, final, torch.cat(lse_parts, 1)
            return o, final

        params = [p for p in sig.parameters.values() if p.name != "cu_seqlens"]
        run.token_args = token_args                     # read by the per-token backend of verification
        run.arg_names = tuple(p.name for p in params)   # (``layers.rollback.PerToken``)
        run.__signature__ = sig.replace(parameters=params + [
            inspect.Parameter("cu_seqlens", inspect.Parameter.KEYWORD_ONLY, default=None)])
        return run
    return deco
