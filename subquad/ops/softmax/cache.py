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
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys (B, L, H, K) and values (B, L, H, V) seen so far, and how many tokens came before them.

    ``offset`` is the absolute position of the first cached token (non-zero once a
    window has dropped old entries); ``seen`` is the number of tokens ever appended.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, window: int | None = None, seen: int | None = None):
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"KVCache needs k (B, L, H, K) and v (B, L, H, V), got {tuple(k.shape)} and {tuple(v.shape)}")
        if window is not None and window < 0:
            raise ValueError(f"window must be >= 0 or None, got {window!r}")
        self.window = window
        self.seen = k.shape[1] if seen is None else seen
        if window is not None and k.shape[1] > window:   # hold exactly the window, not the tensor it came from
            k, v = k[:, k.shape[1] - window:].clone(), v[:, v.shape[1] - window:].clone()
        self._k, self._v = k, v
        self._start, self._len = 0, k.shape[1]
        self._tail = [k.shape[1]]          # furthest position written in these buffers, shared by forks

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
        c.window, c.seen = self.window, self.seen
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
        end = self._start + self._len
        if end + t > self._k.shape[1] or end != self._tail[0]:       # full, or a fork wrote past our end
            self._realloc(max(2 * (self._len + t), 16))
            end = self._len
        self._k[:, end:end + t] = k_new
        self._v[:, end:end + t] = v_new
        self._len += t
        self._tail[0] = end + t
        self.seen += t
        return self

    def _realloc(self, capacity: int):
        """Move the live entries to the front of fresh buffers of ``capacity`` tokens."""
        k_buf = self._k.new_empty(self._k.shape[0], capacity, *self._k.shape[2:])
        v_buf = self._v.new_empty(self._v.shape[0], capacity, *self._v.shape[2:])
        k_buf[:, :self._len] = self.k
        v_buf[:, :self._len] = self.v
        self._k, self._v, self._start, self._tail = k_buf, v_buf, 0, [self._len]

    def _append_window(self, k_new, v_new):
        """A windowed cache lives in a buffer of 2W tokens (W >= 1): bounded whatever is appended."""
        W, t = self.window, k_new.shape[1]
        cap = max(2 * W, 1)
        if self._k.shape[1] != cap:
            self._realloc(cap)
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
        self.seen += t
        self._trim()
        return self

    def clone(self) -> "KVCache":
        c = KVCache(self.k.clone(), self.v.clone(), window=self.window, seen=self.seen)
        return c
