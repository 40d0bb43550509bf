"""Prefix states in a radix tree over tokens: the state after a prompt's blocks, chat messages and whole turns.

A fixed-state model's whole past is a state of fixed size, so the state after some tokens can be kept and a
later request that begins with the same tokens resumes from it, prefilling only the rest. The server keeps
such checkpoints during prefill every ``block`` tokens and at the end of each chat message, and after each
finished turn (``Engine``), so two users with the same system prompt share it, even when their questions
differ (SGLang's MambaRadixCache; vLLM's "align" mode, one checkpoint at the prompt's last block, misses it).

The tree (a radix tree, compressed trie): each node is the path of tokens from the root to it; an edge holds
the tokens it adds. A node may hold a checkpoint:

- for a recurrent layer (any fixed-size tensor, or a sliding window's cache): its state after exactly the
  node's tokens - such states exist only where a checkpoint was taken;
- for an attention layer (a one-row KV cache without a window, one entry per token): nothing of its own - its
  keys and values are the concatenation of the KV *segments* stored on the edges from the root. An edge's
  segment holds the keys and values of the edge's tokens once, shared by every checkpoint below it (shared
  storage, not copies: a 2,048-token prompt with a checkpoint every 256 tokens holds its KV once).

A lookup walks the request's tokens down the tree and returns the deepest checkpoint it passes, its KV caches
assembled from the segments on the path (one concatenation: the engine writes past them anyway). Tokens are
compared exactly (no hash), so a hit is the state of exactly those tokens.

Bytes are exact: a checkpoint's tensors are compact copies (no view of a larger tensor, no spare capacity), a
segment holds its edge's entries only, and ``nbytes`` is the sum of every tensor the tree holds. The cache
never holds more than ``max_bytes``: the least recently used checkpoint goes first, and with it the segments
no checkpoint below needs any more. A server passes the room its memory budget leaves (``insert(room=)``).
The KV of a checkpoint that sits inside another's prefix is the same math on the same tokens; computed in
another batch it may differ from a lone run's by float rounding only.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from subquad.ops import KVCache


def compact(state):
    """A copy of a one-row state holding exactly its tensors' values: no view of a larger tensor, no cache
    buffer larger than its tokens, nothing shared with ``state``. Entries that are None stay None."""
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
                out[key] = None if v is None else v.clone()
        layers.append(out)
    pos = state.pos.clone() if isinstance(state.pos, torch.Tensor) else state.pos
    return ModelState(layers, pos=pos)


def exact_bytes(state) -> int:
    """Bytes of a compact state: every tensor's elements, each KV cache's live keys and values (of any state:
    what ``compact`` would hold). None entries count nothing."""
    total = 0
    for layer in state:
        for v in layer.values():
            if v is not None:
                parts = (v.k, v.v) if isinstance(v, KVCache) else (v,)
                total += sum(p.nelement() * p.element_size() for p in parts)
    if isinstance(state.pos, torch.Tensor):
        total += state.pos.nelement() * state.pos.element_size()
    return total


def _shareable(v, tokens: int) -> bool:
    """A KV cache whose entries are one per token consumed, from position 0: its prefix is any prefix's KV."""
    return (isinstance(v, KVCache) and v.window is None and not v.ragged and v.k.shape[0] == 1
            and v.seen == tokens == v.k.shape[1])


def _split(state, tokens: int):
    """(shared {(layer, key): cache}, rest): the state's shareable KV caches, and the state with None in
    their place (the checkpoint's own part)."""
    from subquad.models.state import ModelState

    shared, layers = {}, []
    for i, layer in enumerate(state):
        out = {}
        for key, v in layer.items():
            if _shareable(v, tokens):
                shared[(i, key)] = v
                out[key] = None
            else:
                out[key] = v
        layers.append(out)
    return shared, ModelState(layers, pos=state.pos)


class _Node:
    """A node of the tree: ``edge`` the tokens from its parent, ``depth`` the tokens from the root, ``kv``
    {(layer, key): (k, v)} the shared caches' entries for the edge's tokens, ``ckpt`` the checkpoint's own
    part (``_split``'s rest) or None."""

    __slots__ = ("children", "ckpt", "ckpt_bytes", "depth", "edge", "kv", "kv_bytes", "parent")

    def __init__(self, edge: tuple, parent, depth: int, kv: dict):
        self.edge, self.parent, self.depth, self.children = edge, parent, depth, {}
        self.kv = kv
        self.kv_bytes = sum(t.nelement() * t.element_size() for pair in kv.values() for t in pair)
        self.ckpt, self.ckpt_bytes = None, 0


class PrefixCache:
    """tokens -> state after those tokens, in a radix tree of at most ``max_bytes`` (0: nothing is kept)."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._root = _Node((), None, 0, {})
        self._lru: OrderedDict = OrderedDict()       # id(node) -> node holding a checkpoint, least recent first
        self._shared_keys: frozenset | None = None   # the (layer, key) caches kept as segments
        self.hits = self.misses = self.hit_tokens = 0

    def __len__(self) -> int:
        """Checkpoints held."""
        return len(self._lru)

    def tensors(self) -> list:
        """Every tensor the tree holds (segments and checkpoints), e.g. to measure its storage."""
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            stack += node.children.values()
            out += [t for pair in node.kv.values() for t in pair]
            if node.ckpt is not None:
                for layer in node.ckpt:
                    for v in layer.values():
                        out += [] if v is None else [v.k, v.v] if isinstance(v, KVCache) else [v]
                if isinstance(node.ckpt.pos, torch.Tensor):
                    out.append(node.ckpt.pos)
        return out

    def checkpoints(self) -> list[tuple]:
        """The token tuples of every checkpoint, least recently used first."""
        return [self._tokens_of(node) for node in self._lru.values()]

    # -- insert -----------------------------------------------------------------------------------------

    def insert(self, tokens, state, room: int | None = None, copy: bool = True) -> bool:
        """Keep ``state`` (one row, having consumed exactly ``tokens``) as a checkpoint; returns whether it
        was kept. What it adds: its own part compact (fixed-size tensors, windowed caches) and the keys and
        values of the tokens the tree does not hold yet. ``room``: the bytes the cache may hold in all after
        this insert, when less than ``max_bytes`` (a server's memory budget less its live states): least
        recently used checkpoints are evicted to make room, and a state that does not fit is not kept
        (nothing is copied then). ``copy=False``: the caller hands over a state that is already compact and
        shared with nothing (``select_rows`` of one row): its own part is kept as it is."""
        tokens = tuple(int(t) for t in tokens)
        limit = self.max_bytes if room is None else min(self.max_bytes, room)
        if not tokens or limit <= 0:
            return False
        shared, rest = _split(state, len(tokens))
        if self._shared_keys is None:
            self._shared_keys = frozenset(shared)
        elif frozenset(shared) != self._shared_keys:     # not this tree's layout: never guess
            return False
        node, child, j = self._descend(tokens)
        if child is None and node.depth == len(tokens) and node.ckpt is not None:
            self._lru.move_to_end(id(node))
            return True
        covered = node.depth + j
        per_token = sum(c.k[0, :1].nelement() * c.k.element_size() + c.v[0, :1].nelement() * c.v.element_size()
                        for c in shared.values())
        size = exact_bytes(rest) + per_token * (len(tokens) - covered)
        if size > limit:
            return False
        path = self._path(node) + ([child] if child is not None else [])
        self.evict(limit - size, protect={id(n) for n in path})
        if self.nbytes + size > limit:                   # the path's own segments left no room
            self._prune(path[-1])
            return False
        if child is not None:
            node = self._split_edge(child, j)
        if node.depth < len(tokens):
            start = node.depth
            seg = {key: (c.k[:, start:].clone(), c.v[:, start:].clone()) for key, c in shared.items()}
            leaf = _Node(tokens[start:], node, len(tokens), seg)
            node.children[tokens[start]] = leaf
            self.nbytes += leaf.kv_bytes
            node = leaf
        node.ckpt = compact(rest) if copy else rest
        node.ckpt_bytes = exact_bytes(node.ckpt)
        self.nbytes += node.ckpt_bytes
        self._lru[id(node)] = node
        return True

    def _descend(self, tokens: tuple):
        """(node, child, j): ``node`` the deepest whose tokens are all a prefix of ``tokens``; ``child`` its child
        along the next token whose edge matches only its first ``j`` tokens (0 < j < len(edge)), else None, 0."""
        node = self._root
        while node.depth < len(tokens):
            child = node.children.get(tokens[node.depth])
            if child is None:
                break
            edge, d = child.edge, node.depth
            j, n = 0, min(len(edge), len(tokens) - d)
            while j < n and edge[j] == tokens[d + j]:
                j += 1
            if j < len(edge):
                return node, child, j
            node = child
        return node, None, 0

    def _split_edge(self, child: _Node, j: int) -> _Node:
        """A new node ``j`` tokens into ``child``'s edge, between it and its parent; the segments split there
        (each part a compact copy: the bytes held stay the same)."""
        parent = child.parent
        mid = _Node(child.edge[:j], parent, parent.depth + j,
                    {key: (k[:, :j].clone(), v[:, :j].clone()) for key, (k, v) in child.kv.items()})
        child.edge = child.edge[j:]
        child.kv = {key: (k[:, j:].clone(), v[:, j:].clone()) for key, (k, v) in child.kv.items()}
        self.nbytes -= child.kv_bytes
        child.kv_bytes = sum(t.nelement() * t.element_size() for pair in child.kv.values() for t in pair)
        self.nbytes += mid.kv_bytes + child.kv_bytes
        child.parent = mid
        mid.children[child.edge[0]] = child
        parent.children[mid.edge[0]] = mid
        return mid

    # -- lookup -----------------------------------------------------------------------------------------

    def lookup(self, tokens, max_len: int | None = None):
        """(n, state) for the deepest checkpoint tokens[:n] with n <= max_len, or (0, None). The state's
        tensors belong to the cache: read them, never write to them (``with_capacity`` and ``prefill`` do not)."""
        tokens = tuple(int(t) for t in tokens)
        limit = len(tokens) if max_len is None else min(max_len, len(tokens))
        node, best = self._root, None
        while True:
            if node.ckpt is not None:
                best = node
            child = node.children.get(tokens[node.depth]) if node.depth < limit else None
            if child is None or child.depth > limit or tokens[node.depth:child.depth] != child.edge:
                break
            node = child
        if best is None:
            self.misses += 1
            return 0, None
        self._lru.move_to_end(id(best))
        self.hits += 1
        self.hit_tokens += best.depth
        return best.depth, self._assemble(best)

    def _assemble(self, node: _Node):
        """The checkpoint's state: its own part, and each shared cache the segments from the root, joined."""
        from subquad.models.state import ModelState

        path = self._path(node)[1:]
        layers = []
        for i, layer in enumerate(node.ckpt):
            out = {}
            for key, v in layer.items():
                if v is None:
                    k = torch.cat([n.kv[(i, key)][0] for n in path], 1)
                    vv = torch.cat([n.kv[(i, key)][1] for n in path], 1)
                    v = KVCache(k, vv, window=None, seen=node.depth)
                out[key] = v
            layers.append(out)
        return ModelState(layers, pos=node.ckpt.pos)

    # -- eviction ---------------------------------------------------------------------------------------

    def evict(self, keep_bytes: int, protect=frozenset()) -> int:
        """Drop least recently used checkpoints, and the segments no checkpoint needs any more, until at most
        ``keep_bytes`` remain (or only the segments of nodes whose id is in ``protect``); returns the bytes
        freed."""
        before = self.nbytes
        while self._lru and self.nbytes > max(keep_bytes, 0):
            _, node = self._lru.popitem(last=False)
            self.nbytes -= node.ckpt_bytes
            node.ckpt, node.ckpt_bytes = None, 0
            self._prune(node, protect)
        return before - self.nbytes

    def _prune(self, node: _Node, protect=frozenset()):
        """Remove ``node`` and its ancestors while each holds no checkpoint, no child and is not protected."""
        while (node is not self._root and node.ckpt is None and not node.children
               and id(node) not in protect):
            parent = node.parent
            del parent.children[node.edge[0]]
            self.nbytes -= node.kv_bytes
            node = parent

    def _path(self, node: _Node) -> list:
        """The nodes from the root to ``node``, both included."""
        path = []
        while node is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _tokens_of(self, node: _Node) -> tuple:
        return tuple(t for n in self._path(node) for t in n.edge)
