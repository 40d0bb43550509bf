"""What the engine's states hold (``Memory``, a part of ``serve.engine.Engine``). Every KV cache the engine holds is
sized once for the longest ``prompt + max_tokens`` among the rows it serves (``rows.with_capacity``: a left-padded
batch holds every row as long as its longest), so steps and prefill chunks append in place and never double a
buffer. A row then holds ``held_bytes``: its fixed-size state plus those KV buffers (a sliding window's buffer is
2W). Joining, leaving and each step hold the old and the new state at once for a moment, so admission keeps ``2 x
held_bytes(live rows) + prefix cache <= memory budget``, and a state goes into the prefix cache only within what
that leaves (LRU entries are evicted first, else it is not kept). The budget covers states and the cache, not the
weights nor a step's activations (an attention layer's keys and values, its grouped heads repeated, one layer at a
time).
"""

from __future__ import annotations

import torch

from subquad.ops import KVCache


class Memory:
    """One row's bytes, measured once (``_measure_row``), and what rows hold batched (module doc)."""

    def _measure_row(self):
        """(bytes of one row's fixed-size state compact, bytes it holds, [(bytes per token, window)] per attention
        cache), measured from a one-token prefill and one more token. "Holds" counts whole storages: a step's
        convolution tail is a view of its (1, W, C) input, a third larger than the tail; and a batched row has
        an int64 position and, per cache, an int64 pad and row count."""
        zero = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with torch.no_grad():
            first = self.model.prefill(zero)[1]
            states = [first, self.model.prefill(zero, first)[1]]    # eager: the step as prefill of one token
        fixed, kv, held = 0, [], []
        for state in states:
            storages = {}
            for layer in state:
                for v in layer.values():
                    if not isinstance(v, KVCache):
                        storages[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
            held.append(sum(storages.values()))
        for layer in first:
            for v in layer.values():
                if isinstance(v, KVCache):
                    kv.append((v.k[0, 0].nelement() * v.k.element_size() + v.v[0, 0].nelement() * v.v.element_size(),
                               v.window))
                else:
                    fixed += v.nelement() * v.element_size()
        return fixed, max(held) + 8 * (1 + 2 * len(kv)), kv

    def row_bytes(self, tokens: int) -> int:
        """Bytes of one row's compact state after ``tokens`` tokens (its fixed-size state plus its KV caches'
        live entries): what the prefix cache keeps for it."""
        return self._fixed_bytes + sum(per * (tokens if w is None else min(tokens, w)) for per, w in self._kv_layers)

    def held_bytes(self, max_lens: list[int]) -> int:
        """Bytes the rows of these ``prompt + max_tokens`` hold at most, batched (module doc): each row's
        fixed-size state as allocated (``_measure_row``) and KV buffers sized for the longest of them (a
        window's: 2W, its fixed buffer)."""
        if not max_lens:
            return 0
        longest = max(max_lens)
        kv = sum(per * (longest if w is None else max(2 * w, 1)) for per, w in self._kv_layers)
        return len(max_lens) * (self._fixed_held + kv)

    def _committed(self, extra=()) -> int:
        """Bytes admission sets aside for the live rows (and ``extra`` more): twice ``held_bytes``, the old and
        the new state while the batch changes or steps."""
        return 2 * self.held_bytes([s.max_len for s in self._live()] + list(extra))
