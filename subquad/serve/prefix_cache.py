"""An LRU cache of one-sequence decoding states, keyed by the tokens they have consumed.

A fixed-state model's whole past is a state of fixed size, so the state after a prompt (or after a finished
chat turn) can be kept and a later request that begins with the same tokens resumes from it, prefilling only
the rest: turn k of a chat costs its new tokens only. llama.cpp keeps such checkpoints per slot; here they
are shared by all requests.

Bytes are counted exactly: every stored state is a compact copy (each tensor cloned, each KV cache cut to
the tokens it holds, no spare capacity), and an entry's size is the sum of its tensors' bytes. The cache
never holds more than ``max_bytes``: least recently used entries go first, and a state larger than the
whole budget is not kept. A server passes the room its memory budget leaves (``insert(..., room=)``).

Lookup is by rolling hash over the request's tokens, so finding the longest cached prefix costs one pass
over the prompt however many entries there are; a hash match is confirmed on the tokens themselves.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from subquad.ops import KVCache

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def _prefix_hashes(tokens) -> list[int]:
    """hashes[n] is the hash of tokens[:n] (n = 0 .. len(tokens))."""
    h, out = 0, [0]
    for t in tokens:
        h = (h * _BASE + int(t) + 1) % _MOD
        out.append(h)
    return out


def compact(state):
    """A copy of a one-row state holding exactly its tensors' values: no view of a larger tensor, no cache
    buffer larger than its tokens, nothing shared with ``state``."""
    from subquad.models.state import ModelState

    layers = []
    for layer in state:
        out = {}
        for key, v in layer.items():
            if isinstance(v, KVCache):
                if v.ragged:
                    raise ValueError("compact: the prefix cache keeps one-row states, not a ragged batch")
                out[key] = KVCache(v.k.clone(), v.v.clone(), window=v.window, seen=v.seen)
            else:
                out[key] = v.clone()
        layers.append(out)
    pos = state.pos.clone() if isinstance(state.pos, torch.Tensor) else state.pos
    return ModelState(layers, pos=pos)


def exact_bytes(state) -> int:
    """Bytes of a compact state: every tensor's elements, each KV cache's live keys and values (of any state:
    what ``compact`` would hold)."""
    total = 0
    for layer in state:
        for v in layer.values():
            parts = (v.k, v.v) if isinstance(v, KVCache) else (v,)
            total += sum(p.nelement() * p.element_size() for p in parts)
    if isinstance(state.pos, torch.Tensor):
        total += state.pos.nelement() * state.pos.element_size()
    return total


class PrefixCache:
    """tokens -> state after those tokens, at most ``max_bytes`` in all (0: nothing is kept)."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict = OrderedDict()     # (length, hash) -> (tokens tuple, state, bytes)
        self._lengths: dict[int, int] = {}             # length -> entries of that length
        self.hits = self.misses = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, tokens, state, room: int | None = None, copy: bool = True) -> bool:
        """Keep a compact copy of ``state`` (one row, having consumed exactly ``tokens``); returns whether
        it was kept. ``room``: the bytes the cache may hold in all after this insert, when less than
        ``max_bytes`` (a server's memory budget less its live states): least recently used entries are evicted
        to make room, and a state that does not fit is not kept (nothing is copied then). ``copy=False``: the
        caller hands over a state that is already compact and shared with nothing (``select_rows`` of one
        row), kept as it is instead of copied once more."""
        tokens = tuple(int(t) for t in tokens)
        limit = self.max_bytes if room is None else min(self.max_bytes, room)
        if not tokens or limit <= 0:
            return False
        key = (len(tokens), _prefix_hashes(tokens)[-1])
        if key in self._entries and self._entries[key][0] == tokens:
            self._entries.move_to_end(key)
            return True
        size = exact_bytes(state)                     # of the live entries: what the compact copy holds
        if size > limit:
            return False
        self._remove(key)
        self.evict(limit - size)
        if copy:
            state = compact(state)
        self._entries[key] = (tokens, state, size)
        self._lengths[len(tokens)] = self._lengths.get(len(tokens), 0) + 1
        self.nbytes += size
        return True

    def lookup(self, tokens, max_len: int | None = None):
        """(n, state) for the longest cached prefix tokens[:n] with n <= max_len, or (0, None)."""
        tokens = list(tokens)
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        if self._entries:
            hashes = _prefix_hashes(tokens[:limit])
            for n in sorted((n for n in self._lengths if n <= limit), reverse=True):
                entry = self._entries.get((n, hashes[n]))
                if entry is not None and list(entry[0]) == tokens[:n]:
                    self._entries.move_to_end((n, hashes[n]))
                    self.hits += 1
                    self.hit_tokens += n
                    return n, entry[1]
        self.misses += 1
        return 0, None

    def evict(self, keep_bytes: int) -> int:
        """Drop least recently used entries until at most ``keep_bytes`` remain; returns the bytes freed."""
        freed = 0
        while self._entries and self.nbytes > max(keep_bytes, 0):
            key = next(iter(self._entries))
            freed += self._remove(key)
        return freed

    def _remove(self, key) -> int:
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        n = key[0]
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
        self.nbytes -= entry[2]
        return entry[2]
