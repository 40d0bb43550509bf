"""Row operations on decoding states: join the states of different sequences into one batch, pick rows out.

A ``ModelState`` holds one row per sequence along dim 0 of every tensor (fixed-size states: Mamba's
``ssm`` and ``conv``, linear attention's ``S`` and ``z``, retention's ``pos``) and a ``KVCache`` per
softmax-attention layer. Rows of different lengths live in a left-padded ragged cache
(``KVCache.stack``), and ``pos`` is then a (B,) tensor. A server that batches independent requests
(continuous batching, ``subquad.serve``) joins a request's state into the running batch when it
arrives and takes it out when it ends; both are these two functions.

    batch = cat_states([s1, s2, s3])         # three sequences, one batch: step them together
    s2_again = select_rows(batch, [1])       # one row back out, its padding dropped
    batch = with_capacity(batch, 4096)       # KV buffers sized once: steps up to 4096 tokens never reallocate
    batch = cat_states([batch, s4], 4096)    # the same in one copy (select_rows too)

The states passed in are never modified (the new state shares no buffer a later step writes to:
tensors are concatenated or indexed into new ones, caches re-stacked into new buffers).
"""

from __future__ import annotations

import torch

from subquad.models.state import ModelState
from subquad.ops import KVCache


def num_rows(state) -> int:
    """Rows (sequences) of a state: dim 0 of its first tensor or cache."""
    for layer in state:
        for v in layer.values():
            return v.k.shape[0] if isinstance(v, KVCache) else v.shape[0]
    raise ValueError("num_rows: the state holds no tensor")


def row_positions(state) -> torch.Tensor:
    """(B,) tokens each row has consumed (``state.pos`` as a per-row tensor on the CPU)."""
    pos = getattr(state, "pos", 0)
    if isinstance(pos, torch.Tensor):
        return pos.detach().to("cpu", torch.long).reshape(-1).expand(num_rows(state)).clone()
    return torch.full((num_rows(state),), int(pos), dtype=torch.long)


def _one_row_caches(cache: KVCache) -> list:
    """One one-row cache per row, without padding."""
    return cache.unstack() if cache.ragged or cache.k.shape[0] > 1 else [cache]


def _pos(positions: torch.Tensor, device):
    """``ModelState.pos`` for these per-row positions: an int for one row (as a lone ``prefill`` leaves it),
    a (B,) tensor otherwise."""
    return int(positions[0]) if len(positions) == 1 else positions.to(device)


def cat_states(states: list, capacity: int | None = None):
    """One state whose rows are the rows of ``states`` in order (each a ``ModelState`` of any rows and lengths).

    Fixed-size tensors are concatenated along dim 0; each attention layer's caches become one ragged cache,
    left-padded to the longest row (a single row stays unpadded, as a lone prefill leaves it), with room for
    ``capacity`` tokens per row when given (``with_capacity``'s, in the same copy)."""
    if not states:
        raise ValueError("cat_states needs at least one state")
    n_layers = len(states[0])
    if any(len(s) != n_layers for s in states):
        raise ValueError(f"cat_states: states of {sorted({len(s) for s in states})} layers; they must match")
    positions = torch.cat([row_positions(s) for s in states])
    layers = []
    for i in range(n_layers):
        keys = list(states[0][i])
        if any(set(s[i]) != set(keys) for s in states):          # by name: the order of a layer's entries is free
            raise ValueError(f"cat_states: layer {i} holds different keys across states")
        layer = {}
        for key in keys:
            parts = [s[i][key] for s in states]
            if isinstance(parts[0], KVCache):
                layer[key] = _caches(parts, [range(p.k.shape[0]) for p in parts], capacity)
            else:
                layer[key] = torch.cat(parts, 0)
        layers.append(layer)
    device = next(iter(layers[0].values())).k.device if isinstance(next(iter(layers[0].values())), KVCache) \
        else next(iter(layers[0].values())).device
    return ModelState(layers, pos=_pos(positions, device))


def _caches(caches: list, rows: list, capacity: int | None) -> KVCache:
    """One cache holding ``rows[i]`` of ``caches[i]`` in order: ``_gathered`` (one copy) where no cache has a
    window, else re-stacked from one-row caches (``KVCache.stack``) and given the room after."""
    if all(c.window is None for c in caches):
        return _gathered(caches, rows, capacity)
    singles = []
    for cache, r in zip(caches, rows):
        one = _one_row_caches(cache)
        singles += [one[j] for j in r]
    out = _stacked(singles)
    return out if capacity is None else out.reserve(capacity)


def _held(cache: KVCache, r: int) -> int:
    """The tokens row ``r`` of a cache without a window holds: its columns after its padding."""
    if cache.pad is None:
        return len(cache)
    return len(cache) - min(max(int(cache.pad[r]) - cache.offset, 0), len(cache))


def _gathered(caches: list, rows: list, capacity: int | None) -> KVCache:
    """``_caches`` without windows, in one copy: every row's entries right-aligned at the longest row's end
    (left padding zero, ``pad``/``row_seen`` as ``KVCache.stack`` sets them) in fresh buffers of ``capacity``
    columns (at least the longest row); one row comes out unpadded. Each cache's rows are copied as one block:
    its columns from its longest selected row's first (the other rows' padding there is the zeros it held)."""
    held = [[_held(c, r) for r in rs] for c, rs in zip(caches, rows)]
    L = max(max(h) for h in held)
    B = sum(len(rs) for rs in rows)
    first = caches[0]
    cap = max(L, capacity or 0)
    k = first._k.new_zeros(B, cap, *first._k.shape[2:])
    v = first._v.new_zeros(B, cap, *first._v.shape[2:])
    pads, seens, t = [], [], 0
    for c, rs, h in zip(caches, rows, held):
        if not rs:
            continue
        w = max(h)
        rs = list(rs)
        if rs == list(range(rs[0], rs[0] + len(rs))):
            ck, cv = c.k[rs[0]:rs[0] + len(rs)], c.v[rs[0]:rs[0] + len(rs)]
        else:
            index = torch.tensor(rs, dtype=torch.long, device=c.k.device)
            ck, cv = c.k.index_select(0, index), c.v.index_select(0, index)
        k[t:t + len(rs), L - w:L] = ck[:, len(c) - w:]
        v[t:t + len(rs), L - w:L] = cv[:, len(c) - w:]
        pads += [L - n for n in h]
        seens += [c.seen if c.row_seen is None else int(c.row_seen[r]) for r in rs]
        t += len(rs)
    if B == 1:                                  # one row: unpadded, its own position count
        out = KVCache(k, v, window=None, seen=seens[0])
    else:
        dev = first.k.device
        out = KVCache(k, v, window=None, seen=L, pad=torch.tensor(pads, dtype=torch.long, device=dev),
                      row_seen=torch.tensor(seens, dtype=torch.long, device=dev))
    out._len, out._tail = L, [L]
    return out


def _stacked(rows: list) -> KVCache:
    """One cache from one-row caches: ragged when there are several, a fresh copy of the lone one otherwise."""
    if len(rows) == 1:
        c = rows[0]
        return KVCache(c.k.clone(), c.v.clone(), window=c.window, seen=c.seen)
    return KVCache.stack(rows)


def select_rows(state, rows: list[int], capacity: int | None = None):
    """The state of the sequences in ``rows`` (indices into dim 0), in that order; padding no row needs is
    dropped, and each KV cache gets room for ``capacity`` tokens per row when given (in the same copy)."""
    B = num_rows(state)
    if not rows or any(not 0 <= r < B for r in rows):
        raise ValueError(f"select_rows: rows must be a non-empty list of indices in [0, {B}), got {rows}")
    positions = row_positions(state)[rows]
    index = None
    layers = []
    for layer in state:
        out = {}
        for key, v in layer.items():
            if isinstance(v, KVCache):
                out[key] = _caches([v], [rows], capacity)
            else:
                if index is None or index.device != v.device:
                    index = torch.tensor(rows, dtype=torch.long, device=v.device)
                out[key] = v.index_select(0, index)
        layers.append(out)
    device = index.device if index is not None else next(
        c for layer in layers for c in layer.values()).k.device
    return ModelState(layers, pos=_pos(positions, device))


def with_capacity(state, tokens: int):
    """The same state with room in each KV cache for ``tokens`` tokens (every row, padding included), so the
    appends of later steps and prefills write in place instead of doubling the buffers: the bytes a server
    counts for a batch are then the bytes it holds. Each cache is a fork of the input's (``KVCache.reserve``:
    new buffers when it lacks the room); a fixed-size tensor is shared with ``state`` unless it is a view of a
    larger buffer (a convolution's tail, sliced from its input), which is copied out so the state holds its
    own bytes only. ``state`` is not modified. A windowed cache keeps its 2W buffer."""
    def own(t):
        return t if t.untyped_storage().nbytes() <= t.nelement() * t.element_size() else t.clone()

    layers = [{key: v.fork().reserve(tokens) if isinstance(v, KVCache) else own(v) for key, v in layer.items()}
              for layer in state]
    return ModelState(layers, pos=getattr(state, "pos", 0))


def state_nbytes(state) -> int:
    """Bytes the state's tensors and caches occupy (a cache's allocated buffers, spare capacity included)."""
    from subquad.layers import tensor_bytes

    return tensor_bytes(list(state)) + (state.pos.nelement() * state.pos.element_size()
                                        if isinstance(getattr(state, "pos", None), torch.Tensor) else 0)
