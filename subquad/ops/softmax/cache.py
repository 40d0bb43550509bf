"""The KV cache: softmax attention's "state", which grows by one key and value per token.

With a sliding window W only the last W entries are kept (a query sees itself and
the W tokens before it), so the cache is bounded. Buffers grow by doubling, so
appending one token is amortised O(1) copies; a window keeps a 2W buffer and
slides it when full, however many tokens are appended at once.

A cache passed to a layer is never changed: the layer appends to a ``fork()``, a
new cache object over the same buffers. Forks write only past the furthest
position any fork of the buffer has written (``_tail``, shared), so every
fork's live entries stay intact; a fork that is not at that tail (its sibling
appended first) moves to fresh buffers before it writes. Decoding one token at
a time stays amortised O(1), and a state reused for several continuations
gives the same answers each time.

A batch of sequences of different lengths (after a packed prefill, ``stack``) is held left-padded:
every row ends at the same column, so one token per row appends as for any batch, and ``pad`` (B,)
says how many leading columns of each row are padding (in columns since the cache began).
``row_seen`` (B,) counts each row's own tokens, the position its next token takes. Attention over
such a cache masks the padding (``softmax_attention``'s ragged route).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys (B, L, H, K) and values (B, L, H, V) seen so far, and how many tokens came before them.

    ``offset`` is the absolute position of the first cached token (non-zero once a
    window has dropped old entries); ``seen`` is the number of tokens ever appended.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, window: int | None = None, seen: int | None = None,
                 pad: torch.Tensor | None = None, row_seen: torch.Tensor | None = None):
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise ValueError(f"KVCache needs tensors k (B, L, H, K) and v (B, L, H, V), got {type(k).__name__} and "
                             f"{type(v).__name__}")
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"KVCache needs k (B, L, H, K) and v (B, L, H, V), got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.device != v.device:        # dtypes may differ: MLA caches float32 latents beside 16-bit rope keys
            raise ValueError(f"KVCache needs k and v on one device, got {k.device} and {v.device}")
        if window is not None and window < 0:
            raise ValueError(f"window must be >= 0 or None, got {window!r}")
        self.window = window
        self.seen = k.shape[1] if seen is None else seen
        if window is not None and k.shape[1] > window:   # hold exactly the window, not the tensor it came from
            k, v = k[:, k.shape[1] - window:].clone(), v[:, v.shape[1] - window:].clone()
        self._k, self._v = k, v
        self._start, self._len = 0, k.shape[1]
        self._tail = [k.shape[1]]          # furthest position written in these buffers, shared by forks
        if (pad is None) != (row_seen is None):
            raise ValueError("a ragged KVCache needs both pad and row_seen (B,), or neither")
        self.pad, self.row_seen = pad, row_seen

    @classmethod
    def empty(cls, B, H, K, V, *, dtype=torch.float32, device=None, window=None, capacity=16):
        if window is not None:
            capacity = max(2 * window, 1)
        k = torch.empty(B, capacity, H, K, dtype=dtype, device=device)
        v = torch.empty(B, capacity, H, V, dtype=dtype, device=device)
        c = cls(k, v, window=window)
        c._len, c.seen, c._tail = 0, 0, [0]
        return c

    def fork(self) -> "KVCache":
        """A new cache object over the same buffers and entries: appending to it leaves this one as it is."""
        c = KVCache.__new__(KVCache)
        c.window, c.seen, c.pad, c.row_seen = self.window, self.seen, self.pad, self.row_seen
        c._k, c._v, c._start, c._len, c._tail = self._k, self._v, self._start, self._len, self._tail
        return c

    @property
    def k(self) -> torch.Tensor:
        return self._k[:, self._start:self._start + self._len]

    @property
    def v(self) -> torch.Tensor:
        return self._v[:, self._start:self._start + self._len]

    def __len__(self) -> int:
        return self._len

    @property
    def offset(self) -> int:
        return self.seen - self._len

    @property
    def ragged(self) -> bool:
        return self.pad is not None

    @property
    def next_position(self):
        """The position the next token takes: an int, or (B,) per row for a ragged cache."""
        return self.seen if self.pad is None else self.row_seen

    def key_mask(self) -> torch.Tensor | None:
        """(B, L) True where a cached column holds a token (not padding); None when nothing is padded."""
        if self.pad is None:
            return None
        cols = self.offset + torch.arange(self._len, device=self._k.device)
        return cols.unsqueeze(0) >= self.pad.to(self._k.device).unsqueeze(1)

    @classmethod
    def stack(cls, caches: list) -> "KVCache":
        """One ragged batch from caches of one row each (the same window), left-padded to the longest."""
        if not caches or any(c.k.shape[0] != 1 for c in caches):
            raise ValueError("KVCache.stack takes a non-empty list of one-row caches")
        window = caches[0].window
        L = max(len(c) for c in caches)
        ks, vs = [], []
        for c in caches:
            fill = L - len(c)
            ks.append(torch.cat([c.k.new_zeros(1, fill, *c.k.shape[2:]), c.k], 1))
            vs.append(torch.cat([c.v.new_zeros(1, fill, *c.v.shape[2:]), c.v], 1))
        dev = caches[0].k.device
        pad = torch.tensor([L - len(c) for c in caches], dtype=torch.long, device=dev)
        row_seen = torch.tensor([c.seen for c in caches], dtype=torch.long, device=dev)
        return cls(torch.cat(ks, 0), torch.cat(vs, 0), window=window, seen=L, pad=pad, row_seen=row_seen)

    def unstack(self) -> list:
        """One-row caches, each without its padding (the inverse of ``stack``)."""
        out = []
        for b in range(self.k.shape[0]):
            first = 0 if self.pad is None else max(0, int(self.pad[b]) - self.offset)
            seen = self.seen if self.row_seen is None else int(self.row_seen[b])
            out.append(KVCache(self.k[b:b + 1, first:], self.v[b:b + 1, first:], window=self.window, seen=seen))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers this cache holds (allocated, including spare capacity)."""
        return self._k.nelement() * self._k.element_size() + self._v.nelement() * self._v.element_size()

    def _trim(self):
        if self.window is not None and self._len > self.window:
            drop = self._len - self.window
            self._start += drop
            self._len -= drop

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> "KVCache":
        """Append (B, t, H, K) keys and (B, t, H, V) values in place; returns self."""
        if self.window is not None:
            return self._append_window(k_new, v_new)
        t = k_new.shape[1]
        end = self._open(t)
        self._k[:, end:end + t] = k_new
        self._v[:, end:end + t] = v_new
        return self

    def _open(self, t: int) -> int:
        """Count ``t`` more tokens at the end, in place (no window) -> the buffer column the first goes to."""
        end = self._start + self._len
        if end + t > self._k.shape[1] or end != self._tail[0]:       # full, or a fork wrote past our end
            self._realloc(max(2 * (self._len + t), 16))
            end = self._len
        self._len += t
        self._tail[0] = end + t
        self._advance(t)
        return end

    def opened(self, t: int = 1) -> "KVCache":
        """A fork with ``t`` more columns at its end, counted as appended but not yet written: ``append``'s fork
        without its copy, for a caller that writes the keys and values there itself (``models.layer_stack``'s
        C call). Until they are written the fork's last ``t`` entries are undefined; this cache is unchanged."""
        if self.window is not None:
            raise ValueError("a windowed cache slides its entries as it appends: append to it instead")
        c = self.fork()
        c._open(t)
        return c

    def reserve(self, capacity: int) -> "KVCache":
        """Room for the cache to reach ``capacity`` tokens by appends that never reallocate (in place; returns
        self): fresh buffers of exactly that capacity unless the current ones already have the room past the
        live entries and no fork has written past them. A windowed cache keeps its fixed 2W buffer. A server
        sizes a batch's caches once with it, so the bytes it counts are the bytes allocated."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        if self.window is not None:
            return self
        end = self._start + self._len
        if self._k.shape[1] - self._start < capacity or end != self._tail[0]:
            self._realloc(max(capacity, self._len))
        return self

    def for_step(self, t: int = 1) -> "KVCache":
        """A fork that appends ``t`` tokens in place, for a compiled decoding step (``models.decode``): its
        buffers have room past the live entries (doubled, or a window's slid to the front, here rather than
        inside the graph) and, with several rows, it is ragged (no padding: ``pad`` 0, ``row_seen`` = ``seen``).
        So every step of a batch of >= 2 rows meets one structure and the graph compiles once, not again for
        a full buffer or for a batch that became ragged. Same entries and positions; this cache is unchanged."""
        c = self.fork()
        end = c._start + c._len
        cap = max(2 * c.window, 1) if c.window is not None else None
        if cap is not None:       # a window's entries start past column 0 (inductor guards on a start of 0)
            if c._k.shape[1] != cap + 1 or c._start == 0 or end + t > cap + 1 or end != c._tail[0]:
                c._realloc(cap + 1, lead=1)
        elif end + t >= c._k.shape[1] or end != c._tail[0]:     # a column to spare after the append: a buffer
            c._realloc(max(2 * (c._len + t), 16))                # filled to its end is a layout of its own
        B = c._k.shape[0]
        if c.pad is None and B > 1:
            c.pad = torch.zeros(B, dtype=torch.long, device=c._k.device)
            c.row_seen = torch.full((B,), c.seen, dtype=torch.long, device=c._k.device)
        return c

    def _advance(self, t: int):
        self.seen += t
        if self.row_seen is not None:
            self.row_seen = self.row_seen + t

    def _realloc(self, capacity: int, lead: int = 0):
        """Move the live entries to the front of fresh buffers of ``capacity`` tokens (after ``lead`` unused
        columns)."""
        k_buf = self._k.new_empty(self._k.shape[0], capacity, *self._k.shape[2:])
        v_buf = self._v.new_empty(self._v.shape[0], capacity, *self._v.shape[2:])
        k_buf[:, lead:lead + self._len] = self.k
        v_buf[:, lead:lead + self._len] = self.v
        self._k, self._v, self._start, self._tail = k_buf, v_buf, lead, [lead + self._len]

    def _append_window(self, k_new, v_new):
        """A windowed cache lives in a buffer of 2W tokens (W >= 1; 2W + 1 after ``for_step``): bounded whatever
        is appended."""
        W, t = self.window, k_new.shape[1]
        cap = max(2 * W, 1)
        if self._k.shape[1] not in (cap, cap + 1):
            self._realloc(cap)
        cap = self._k.shape[1]
        if t >= W:                                   # the new block alone fills the window: fresh buffers
            self._k, self._v = self._k.new_empty(self._k.shape), self._v.new_empty(self._v.shape)
            self._k[:, :W] = k_new[:, t - W:]
            self._v[:, :W] = v_new[:, t - W:]
            self._start, self._len, self._tail = 0, W, [W]
        else:
            end = self._start + self._len
            if end + t > cap or end != self._tail[0]:   # slide the live entries to the front (fresh buffers)
                self._realloc(cap)
            end = self._start + self._len
            self._k[:, end:end + t] = k_new
            self._v[:, end:end + t] = v_new
            self._len += t
            self._tail[0] = end + t
        self._advance(t)
        self._trim()
        return self

    def rollback(self, drop: int) -> "KVCache":
        """A fork without the last ``drop`` tokens (speculative decoding's rejected drafts:
        ``subquad.layers.rollback``), in O(1) and without copying. The buffer positions past the fork's end are
        given back, so its next append writes there in place: this cache, which still holds the dropped tokens,
        must not be read after that (caches forked before those tokens were appended are untouched). A windowed
        cache may have let older tokens go to make room for the dropped ones: ValueError then (append the kept
        tokens to the cache before them instead)."""
        if isinstance(drop, bool) or not isinstance(drop, int) or not 0 <= drop <= self._len:
            raise ValueError(f"drop must be an int in [0, {self._len}] (the cached tokens), got {drop!r}")
        if self.window is not None and self._len - drop != min(self.seen - drop, self.window):
            raise ValueError(f"a window of {self.window} has let go of tokens the {drop} dropped ones displaced")
        c = self.fork()
        c._len -= drop
        c.seen -= drop
        if c.row_seen is not None:
            c.row_seen = c.row_seen - drop
        c._tail[0] = c._start + c._len
        return c

    def rollback_rows(self, drops) -> "KVCache":
        """``rollback`` by a different number of tokens per row, ``drops`` (B ints): the common part in O(1), then
        each row that drops more moves its entries right by the rest, its leading columns becoming padding
        (``pad``, ``row_seen``, zeros), so every row still ends at the last column: each row's live entries copied
        once, into fresh buffers as large as this cache's, so the room a server reserved stays (a window cannot
        take it: ValueError). This cache and its buffers are left as they are."""
        B = self._k.shape[0]
        if (not isinstance(drops, (list, tuple)) or len(drops) != B
                or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= self._len for d in drops)):
            raise ValueError(f"drops must be {B} ints in [0, {self._len}] (one per row), got {drops!r}")
        base = min(drops)
        c = self.rollback(base)
        extra = [d - base for d in drops]
        if not any(extra):
            return c
        if self.window is not None:
            raise ValueError("a windowed cache cannot drop a different number of tokens per row")
        L, dev = len(c), self._k.device
        e = torch.tensor(extra, dtype=torch.long, device=dev)
        cap = max(self._k.shape[1], L)
        out = []
        for old in (c.k, c.v):
            buf = old.new_empty(B, cap, *old.shape[2:])
            for b, x in enumerate(extra):                      # a row at a time: each row's entries copied once
                buf[b, x:L] = old[b, :L - x]
                if x:
                    buf[b, :x] = 0
            out.append(buf)
        pad = (torch.zeros(B, dtype=torch.long, device=dev) if c.pad is None else c.pad.to(dev)).clamp(min=c.offset) + e
        row_seen = (torch.full((B,), c.seen, dtype=torch.long, device=dev) if c.row_seen is None else c.row_seen) - e
        res = KVCache(out[0][:, :L], out[1][:, :L], window=None, seen=c.seen, pad=pad, row_seen=row_seen)
        res._k, res._v, res._start, res._len, res._tail = out[0], out[1], 0, L, [L]
        return res

    def clone(self) -> "KVCache":
        return KVCache(self.k.clone(), self.v.clone(), window=self.window, seen=self.seen, pad=self.pad,
                       row_seen=self.row_seen)
