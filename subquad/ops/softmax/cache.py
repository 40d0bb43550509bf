"""The KV cache: softmax attention's "state", which grows by one key and value per token.

With a sliding window W only the last W entries are kept (a query sees itself and
the W tokens before it), so the cache is bounded. Buffers grow by doubling, so
appending one token is amortised O(1) copies; a window keeps a 2W buffer and
slides it when full.
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
        self._k, self._v = k, v
        self._start, self._len = 0, k.shape[1]
        self.seen = self._len if seen is None else seen
        self._trim()

    @classmethod
    def empty(cls, B, H, K, V, *, dtype=torch.float32, device=None, window=None, capacity=16):
        k = torch.empty(B, capacity, H, K, dtype=dtype, device=device)
        v = torch.empty(B, capacity, H, V, dtype=dtype, device=device)
        c = cls(k, v, window=window)
        c._len, c.seen = 0, 0
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
        t = k_new.shape[1]
        end = self._start + self._len
        if end + t > self._k.shape[1]:
            need = self._len + t
            cap = max(2 * need, 16) if self.window is None else max(2 * min(self.window, need), need, 16)
            k_buf = self._k.new_empty(self._k.shape[0], cap, *self._k.shape[2:])
            v_buf = self._v.new_empty(self._v.shape[0], cap, *self._v.shape[2:])
            k_buf[:, :self._len] = self.k
            v_buf[:, :self._len] = self.v
            self._k, self._v, self._start = k_buf, v_buf, 0
            end = self._len
        self._k[:, end:end + t] = k_new
        self._v[:, end:end + t] = v_new
        self._len += t
        self.seen += t
        self._trim()
        return self

    def clone(self) -> "KVCache":
        c = KVCache(self.k.clone(), self.v.clone(), window=self.window, seen=self.seen)
        return c
