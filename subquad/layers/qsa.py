"""Indexed softmax attention (Qwen4-Exp's QSA): each query attends to the tokens a small indexer selects.

The indexer projects x to Hi query heads and one key head of D dims (``index_qk_proj``), RMS-normed per head;
keys are pooled over consecutive blocks of c tokens (``index_block``), then normed and rotated at the block's
first position. For the query at position p (it sees tokens 0..p):

    n_p    = (p + 1) // c                                   complete blocks it sees
    kbar_b = rotary(norm(mean(ik_{bc .. bc+c-1})), bc)       (b < n_p)        block keys (D,)
    s_b    = sum_h relu(rotary(norm(iq_{p,h}), p) . kbar_b) / sqrt(D)
    S_p    = the tokens of the top min(budget / c, n_p) blocks by s_b + the tail n_p c .. p (always)
    o_p    = softmax over S_p of q_p k_j / sqrt(K), times v_j                (else as ``SoftmaxAttention``)

A query whose own block is complete may not select it (transformers' rule, kept). Ties among the s_b (relu
makes zeros common) are ``torch.topk``'s over the n_p scores, as transformers calls it: the queries are taken in
groups of equal n_p (contiguous: n_p grows with p), one ``topk`` over the first n_p blocks each.
Shapes: q (B, T, H, K), iq (B, T, Hi, D), ik (B, T, D), the selection (B, T, L + T) over the L cached and T new
tokens.
Two paths: the dense masked one, O(T (L + T)) per call - the reference, and prefill's -, and for one token
(decoding) the selected keys gathered, O(budget + c) attention after the O(L / c) block scores
(``gather_one``; the decoding checks compare the two, prefill then steps). A ragged batch (rows at different
positions: a server's batch, ``generate`` from prompts of different lengths, a compiled step at >= 2 rows) runs
either path for all rows at once, each at its own position over its own keys (``_ragged``; row by row, the
reference, with ``batch_ragged = False``; tests/layers/test_qsa.py compares them) - ties at the budget's edge
aside (``_ragged``'s doc).

State: {"kv": the KV cache (rotated keys, values), "ik": a ``KVCache`` of the indexer's raw keys (B, L, 1, D)
with no values}: the block keys are pooled again from them each call, O(L D) - at long contexts more than the
gathered attention. A cache of the pooled block keys would make that O(L D / c), but it grows by one entry every
c tokens, which speculative decoding's rollback by truncation (a KV cache entry per token) cannot undo.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from subquad.layers.attention import SoftmaxAttention
from subquad.layers.norm import RMSNorm
from subquad.layers.rotary import apply_rotary
from subquad.ops import KVCache


class IndexedAttention(SoftmaxAttention):
    """``SoftmaxAttention`` (no window) whose queries see only the tokens the indexer selects (module doc):
    o_t = softmax over S_t of q_t k_j, times v_j.
    Args beyond the parent's: index_heads (Hi), index_head_dim (D, at least the rotating dims; None: 16, or the
    rotating dims where there are more - a model's pattern "qsa" at head_dim 32 once failed to build), index_budget
    (tokens selected from complete blocks, a multiple of index_block), index_block (c).
    State: {"kv": the KV cache, "ik": the indexer's raw keys (a ``KVCache`` without values)}."""

    def __init__(self, d_model: int, n_heads: int = 4, n_kv_heads: int | None = None, index_heads: int = 2,
                 index_head_dim: int | None = None, index_budget: int = 16, index_block: int = 4, rotary: bool = True,
                 rotary_base: float = 10000.0, rotary_fraction: float = 1.0, head_dim: int | None = None,
                 qk_norm: str | None = None, qk_norm_eps: float = 1e-6, output_gate: bool = False,
                 scale: float | None = None, mode: str = "parallel", chunk_size: int = 64):
        if qk_norm == "all":
            raise ValueError("IndexedAttention takes qk_norm None or 'head', got 'all'")
        super().__init__(d_model, n_heads, n_kv_heads, rotary=rotary, rotary_base=rotary_base,
                         rotary_fraction=rotary_fraction, head_dim=head_dim, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
                         output_gate=output_gate, scale=scale, mode=mode, chunk_size=chunk_size)
        if index_head_dim is None:
            index_head_dim = max(16, self.rotary_dim if self.rotary else 0)
        for name, v in (("index_heads", index_heads), ("index_head_dim", index_head_dim),
                        ("index_budget", index_budget), ("index_block", index_block)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if index_budget % index_block:
            raise ValueError(f"index_budget={index_budget} must be a multiple of index_block={index_block}")
        if self.rotary and self.rotary_dim > index_head_dim:
            raise ValueError(f"index_head_dim={index_head_dim} must hold the {self.rotary_dim} rotating dims")
        self.index_heads, self.index_head_dim = index_heads, index_head_dim
        self.index_budget, self.index_block = index_budget, index_block
        eps = qk_norm_eps
        self.index_qk_proj = nn.Linear(d_model, (index_heads + 1) * index_head_dim, bias=False)
        self.index_q_norm = RMSNorm(index_head_dim, eps)
        self.index_k_norm = RMSNorm(index_head_dim, eps)

    gather_one = True            # one token attends to its gathered keys (``_gathered``); False: the dense mask
    query_chunk = 512            # the dense path's queries per block of scores
    batch_ragged = True          # a ragged batch at once (``_ragged``); False: row by row (``_rows``), the reference

    def mix_flops(self, T):
        """On average over the T queries: q k^T and p v over the |S_p| keys each attends to (module doc), and the
        indexer's Hi scores of D dims over its n_p complete blocks."""
        c, total = self.index_block, 0
        for p in range(T):
            n = (p + 1) // c
            keys = min(self.index_budget // c, n) * c + p + 1 - n * c
            total += 4.0 * self.n_heads * self.head_dim * keys + 2.0 * self.index_heads * self.index_head_dim * n
        return total / T

    def empty_state(self, batch_size, device=None, dtype=torch.float32):
        return {**super().empty_state(batch_size, device, dtype),
                "ik": KVCache.empty(batch_size, 1, self.index_head_dim, 0, dtype=dtype, device=device)}

    def _rotate(self, x, pos):
        return apply_rotary(x, pos, self.rotary_base, self.rotary_dim) if self.rotary else x

    def select(self, iq, ik, L: int) -> torch.Tensor:
        """iq (B, T, Hi, D) normed and rotated, ik (B, L + T, D) raw keys -> (B, T, L + T) bool: the tokens each
        of the T queries (at positions L .. L + T - 1) attends to (module doc)."""
        B, T, _, D = iq.shape
        S, c = ik.shape[1], self.index_block
        dev = iq.device
        p = L + torch.arange(T, device=dev)                                    # (T,) query positions
        n = (p + 1) // c                                                       # complete blocks each sees
        cols = torch.arange(S, device=dev)
        keep = (cols >= (n * c)[:, None]) & (cols <= p[:, None])              # the tail, (T, S)
        keep = keep.expand(B, T, S)
        nb = S // c
        if nb:
            s = self.block_scores(iq, ik)                                                  # (B, T, nb)
            chosen = torch.zeros(B, T, nb, dtype=torch.bool, device=dev)
            # the queries that see m complete blocks; one token sees all nb, and no loop or guard on its size
            # (sym_min: compiled decoding keeps one graph as the cache grows)
            groups = [(nb, slice(0, 1))] if T == 1 else [
                (m, slice(max(0, m * c - L - 1), min(T, (m + 1) * c - L - 1)))
                for m in range(max(1, (L + 1) // c), (L + T) // c + 1)]
            for m, ts in groups:
                top = s[:, ts, :m].topk(torch.sym_min(self.index_budget // c, m), dim=-1).indices
                chosen[:, ts] = chosen[:, ts].scatter(-1, top, True)
            blocks = chosen.repeat_interleave(c, -1)                                   # (B, T, nb c)
            keep = keep | torch.nn.functional.pad(blocks, (0, S - nb * c))
        return keep

    def block_scores(self, iq, ik):
        """iq (B, T, Hi, D) normed and rotated, ik (B, S, D) raw keys -> s (B, T, S // c): every query's score of
        every complete block (module doc)."""
        B, S, D = ik.shape
        c = self.index_block
        nb = S // c
        kbar = self.index_k_norm(ik[:, :nb * c].reshape(B, nb, c, D).mean(2))
        kbar = self._rotate(kbar[:, :, None], torch.arange(nb, device=ik.device) * c)[:, :, 0]     # (B, nb, D)
        return torch.einsum("bthd,bnd->bthn", iq, kbar).relu().sum(2) / math.sqrt(D)

    def selected(self, iq, ik, L: int):
        """One query at position L (T = 1): iq (B, 1, Hi, D), ik (B, L + 1, D) -> (idx (B, W), valid (B, W)): the
        tokens it attends to, W = min(budget / c, n) c + c - 1 slots (the tail's unused ones invalid)."""
        B, c = iq.shape[0], self.index_block
        nb = (L + 1) // c
        dev = iq.device
        blocks = torch.zeros(B, 0, dtype=torch.long, device=dev)
        if nb:
            top = self.block_scores(iq, ik)[:, 0].topk(torch.sym_min(self.index_budget // c, nb), dim=-1).indices
            blocks = (top[..., None] * c + torch.arange(c, device=dev)).flatten(1)
        tail = nb * c + torch.arange(c - 1, device=dev)
        idx = torch.cat([blocks, tail.clamp(max=L).expand(B, c - 1)], 1)
        valid = torch.cat([torch.ones_like(blocks, dtype=torch.bool), (tail <= L).expand(B, c - 1)], 1)
        return idx, valid

    def _gathered(self, q, K_all, V_all, iq, ik_all, L: int):
        """The fast path of one token: attention over the W <= budget + c - 1 selected keys, gathered (O(budget)
        where ``select``'s dense mask is O(L)); q (B, 1, H, K) rotated -> o (B, 1, H, K)."""
        return self._attend_slots(q, K_all, V_all, *self.selected(iq, ik_all, L))

    def _attend_slots(self, q, K_all, V_all, idx, valid):
        """One query per row over the keys of columns idx (B, W) where valid (B, W): q (B, 1, H, K) rotated,
        K_all, V_all (B, S, Hk, K) -> o (B, 1, H, K)."""
        B, W = idx.shape
        take = idx[:, :, None, None].expand(B, W, *K_all.shape[2:])
        Kg, Vg = self._repeat(K_all.gather(1, take)), self._repeat(V_all.gather(1, take))      # (B, W, H, K)
        scale = self.scale if self.scale is not None else self.head_dim ** -0.5
        scores = torch.einsum("bhk,bwhk->bhw", q[:, 0], Kg) * scale
        p = scores.masked_fill(~valid[:, None], float("-inf")).softmax(-1)
        return torch.einsum("bhw,bwhk->bhk", p, Vg)[:, None]

    def _rows(self, q, k, v, iq, ik, past, pastik, L: int):
        """One group of rows at a common position L: q, k, iq normed (unrotated), v, ik raw; past the cached
        rotated keys and values (or None) -> (o (B, T, H, K), the new tokens' rotated keys)."""
        T = q.shape[1]
        pos = torch.arange(L, L + T, device=q.device)
        q, k, iq = self._rotate(q, pos), self._rotate(k, pos), self._rotate(iq, pos)
        K_all, V_all, ik_all = (k, v, ik) if past is None else (
            torch.cat([past.k, k], 1), torch.cat([past.v, v], 1), torch.cat([pastik.k[:, :, 0], ik], 1))
        if T == 1 and self.gather_one:
            return self._gathered(q, K_all, V_all, iq, ik_all, L), k
        scale = self.scale if self.scale is not None else self.head_dim ** -0.5
        outs = []
        for a in range(0, T, self.query_chunk):          # the scores (B, H, chunk, S): memory O(chunk S), not O(T S)
            b = min(T, a + self.query_chunk)
            S = L + b                                    # the keys these queries can see
            keep = self.select(iq[:, a:b], ik_all[:, :S], L + a)                             # (B, b - a, S)
            scores = torch.einsum("bthk,bshk->bhts", q[:, a:b], self._repeat(K_all[:, :S])) * scale
            scores = scores.masked_fill(~keep[:, None], float("-inf"))
            outs.append(torch.einsum("bhts,bshk->bthk", scores.softmax(-1), self._repeat(V_all[:, :S])))
        return torch.cat(outs, 1), k

    def _ragged(self, q, k, v, iq, ik, cache, icache):
        """A ragged batch (``KVCache.ragged``: rows at different positions, left-padded) at once, no loop over rows
        and no read of a tensor's value (a compiled step traces it whole): row b's cached tokens are the columns
        f_b .. Lc - 1 (f_b: its padding), its token i column f_b + i, its T new tokens at positions
        p = L_b .. L_b + T - 1 (L_b = Lc - f_b) - as ``_rows`` of that row alone, the reference (``batch_ragged``
        False). The raw index keys are gathered into each row's own order, so one pooling makes every row's
        blocks; each query takes the top of its own n = (p + 1) // c complete blocks (``_own_blocks``), and the
        selection is read back at the columns: padding is never selected.
        Ties: ``topk`` runs over the S // c blocks of the longest row, the scores past a query's n -inf, not over
        its n as the reference (transformers' call): the same blocks unless two of a query's scores tie at the
        budget's edge (relu's zeros), and then still a top set; one token of a row without padding is the
        reference's call exactly.
        q, k, iq normed (unrotated), v, ik raw; cache: rotated keys and values, icache: raw index keys ->
        (o (B, T, H, K), the new tokens' rotated keys)."""
        B, T = q.shape[:2]
        c, dev = self.index_block, q.device
        Lc = cache.k.shape[1]
        first = (cache.pad.to(dev) - cache.offset).clamp(0, Lc)                # (B,) f_b
        pos = (Lc - first)[:, None] + torch.arange(T, device=dev)              # (B, T) p
        q, k, iq = self._rotate(q, pos), self._rotate(k, pos), self._rotate(iq, pos)
        K_all, V_all = torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1)
        ik_all = torch.cat([icache.k[:, :, 0], ik], 1)                          # (B, S, D) by column
        S, D = ik_all.shape[1:]
        nb = S // c
        # each row's tokens 0 .. nb c - 1 in its own order (past its end: its last token, in no block it sees);
        # nb c of them, not S and a slice (a guard on S's parity: a second graph)
        at = (first[:, None] + torch.arange(nb * c, device=dev)).clamp(max=S - 1)           # (B, nb c)
        ik_own = ik_all.gather(1, at[..., None].expand(B, nb * c, D))                       # (B, nb c, D)
        if T == 1 and self.gather_one:
            top, n = self._own_blocks(iq, ik_own, pos)                          # (B, 1, kk), (B, 1)
            blocks = (top * c)[..., None] + torch.arange(c, device=dev)       # (B, 1, kk, c) in row order
            tail = (n * c)[..., None] + torch.arange(c - 1, device=dev)        # (B, 1, c - 1)
            idx = torch.cat([blocks.flatten(2), tail], -1)[:, 0]
            valid = torch.cat([(top < n[..., None]).repeat_interleave(c, -1), tail <= pos[..., None]], -1)[:, 0]
            return self._attend_slots(q, K_all, V_all, (first[:, None] + idx).clamp(max=S - 1), valid), k
        j = torch.arange(S, device=dev)
        own = j - first[:, None]                                                # (B, S) each column's i (< 0: padding)
        scale = self.scale if self.scale is not None else self.head_dim ** -0.5
        outs = []
        for a in range(0, T, self.query_chunk):          # the scores (B, H, chunk, S): memory O(chunk S), not O(T S)
            b = min(T, a + self.query_chunk)
            top, n = self._own_blocks(iq[:, a:b], ik_own, pos[:, a:b])          # (B, t, kk), (B, t)
            keep = (j >= n[..., None] * c) & (j <= pos[:, a:b, None])          # (B, t, S) the tail, in row order
            if nb:
                chosen = torch.zeros(B, b - a, nb, dtype=torch.bool, device=dev).scatter(-1, top, True)
                chosen = chosen & (torch.arange(nb, device=dev) < n[..., None])
                keep = keep | torch.nn.functional.pad(chosen.repeat_interleave(c, -1), (0, S - nb * c))
            keep = keep.gather(-1, own.clamp(min=0)[:, None].expand(B, b - a, S)) & (own >= 0)[:, None]  # by column
            scores = torch.einsum("bthk,bshk->bhts", q[:, a:b], self._repeat(K_all)) * scale
            scores = scores.masked_fill(~keep[:, None], float("-inf"))
            outs.append(torch.einsum("bhts,bshk->bthk", scores.softmax(-1), self._repeat(V_all)))
        return torch.cat(outs, 1), k

    def _own_blocks(self, iq, ik_own, pos):
        """iq (B, t, Hi, D) rotated, ik_own (B, nb c, D) raw keys in each row's order, pos (B, t) -> (top (B, t, kk)
        block indices by ``topk`` of the nb blocks' scores, those past each query's n -inf (picked only where
        n < kk = min(budget / c, nb)), n (B, t) = (p + 1) // c)."""
        B, t = pos.shape
        c = self.index_block
        n = (pos + 1) // c
        nb = ik_own.shape[1] // c
        if not nb:
            return torch.zeros(B, t, 0, dtype=torch.long, device=pos.device), n
        s = self.block_scores(iq, ik_own)                                      # (B, t, nb)
        s = s.masked_fill(torch.arange(nb, device=pos.device) >= n[..., None], float("-inf"))
        return s.topk(torch.sym_min(self.index_budget // c, nb), dim=-1).indices, n

    def mix(self, x, state, seq):
        if not seq.whole_sequence:
            raise ValueError("qsa selects among all of a sequence's keys: it runs no shard of a sequence (context "
                             "parallelism)")
        B, T, _ = x.shape
        H, Hk, K, Hi, D = self.n_heads, self.n_kv_heads, self.head_dim, self.index_heads, self.index_head_dim
        q, k, v = self.project(x)
        iq, ik = self.index_qk_proj(x).split([Hi * D, D], -1)
        gate = None
        if self.output_gate:
            q, gate = q.view(B, T, H, 2 * K).chunk(2, dim=-1)
        q, k, v = q.reshape(B, T, H, K), k.view(B, T, Hk, K), v.view(B, T, Hk, K)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        iq = self.index_q_norm(iq.reshape(B, T, Hi, D))
        cache, icache = (None, None) if state is None else (state["kv"], state["ik"])
        if cache is not None and not len(cache) and not cache.ragged:
            cache = icache = None
        if cache is not None and cache.ragged and seq.cu_seqlens is None and self.batch_ragged:
            o, k = self._ragged(q, k, v, iq, ik, cache, icache)
        elif seq.cu_seqlens is not None or (cache is not None and cache.ragged):
            if seq.cu_seqlens is not None:                 # packed: one row per sequence
                spans = list(zip(*(t.split(seq.lengths, 1) for t in (q, k, v, iq, ik))))
            else:                                          # a ragged batch: row by row
                spans = list(zip(*(t.split(1, 0) for t in (q, k, v, iq, ik))))
            pasts = [None] * len(spans) if cache is None else list(zip(cache.unstack(), icache.unstack()))
            outs = [self._rows(*span, *(past or (None, None)), 0 if past is None else len(past[0]))
                    for span, past in zip(spans, pasts)]
            o = torch.cat([a for a, _ in outs], 1 if seq.cu_seqlens is not None else 0)
            k = torch.cat([b for _, b in outs], 1 if seq.cu_seqlens is not None else 0)
        else:
            o, k = self._rows(q, k, v, iq, ik, cache, icache, 0 if cache is None else len(cache))
        if gate is not None:
            o = o * torch.sigmoid(gate)
        ik4 = ik[:, :, None]
        new = {"kv": self._extend(state and state["kv"], k, v, seq),
               "ik": self._extend(state and state["ik"], ik4, ik4.new_zeros(*ik4.shape[:3], 0), seq)}
        return self.o_proj(o.reshape(B, T, H * K)), new
