"""The engine's prefill (``Prefill``, a part of ``serve.engine.Engine``): chunked, batched, resumed from the prefix
cache.

At most ``prefill_chunk`` prompt tokens are prefilled per iteration, so a long prompt is spread over many iterations
and never stalls the rows that are decoding. The tokens go in rounds: each round takes the next piece of every
prefilling request in order while the budget lasts and runs them in one packed forward (``cu_seqlens``; the pieces
that start from a state and those that start from none in one each), so prompts admitted together share their
forwards and a lone prompt still takes several pieces in one iteration. A request resumes from the deepest
checkpoint of its prompt in the prefix cache (``PrefixCache``, a radix tree) when its first piece is due - not at
admission, and a round later when a piece beside it ends inside the prefix they share, so the requests admitted
together behind one that prefills a shared system prompt find it. It prefills in pieces that end at every multiple
of ``prefix_block`` tokens and at each end of a chat message (``submit(boundaries=)``), and keeps its state at each
as a checkpoint: a later prompt sharing N tokens with this one resumes at least ``N - N % prefix_block`` tokens in
(the prompt's last token is always prefilled: it gives the first token's logits). A request whose prompt is done
samples its first token and joins the batch (``rows.cat_states``).
"""

from __future__ import annotations

import torch

from subquad.models.rows import cat_states, select_rows, with_capacity
from subquad.models.speculative import MTPDrafter, capture_hidden
from subquad.serve.request import Sequence


def _shared(a: list, b: list, limit: int) -> int:
    """How many leading tokens ``a`` and ``b[:limit]`` have in common."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Prefill:
    """The prefill steps of ``Engine.step`` (module doc); they read and write the engine's queues, cache and
    counters."""

    def _prefill(self) -> list:
        """Spend up to ``prefill_chunk`` prompt tokens in rounds; returns the requests whose prompt is done and who
        go on. Each round takes one piece of each prefilling request in order while the budget lasts
        (``_plan``) and runs them together (``_run_pieces``), so a lone request still takes several pieces in one
        iteration and several requests share each forward. A request stays in ``prefilling`` until it has its
        first token, so a failure finds it there."""
        budget, joiners = self.prefill_chunk, []
        while budget > 0:
            pieces = self._plan(budget)
            if not pieces:
                break
            self._run_pieces(pieces)
            budget -= sum(n for _, n in pieces)
            for seq, _ in pieces:
                if seq.prefilled < len(seq.prompt) or seq not in self.prefilling:
                    continue
                self.prefilling.remove(seq)
                group, seq.forks = [seq, *seq.forks], []
                for s in group:
                    if s.finish_reason is None:
                        joiners.append(s)
                    else:                                   # done at its first token (its prompt state is kept)
                        s.state = None
                        self._finished(s, None)
        return joiners

    def _plan(self, budget: int) -> list:
        """One round's pieces [(request, tokens)]: the next piece of each prefilling request in order, within
        ``budget`` tokens. A request's first piece starts from the deepest checkpoint of its prompt in the prefix
        cache now; a request that has not looked yet waits for the next round when a piece planned before it ends
        inside the prefix they share (it will find that piece's checkpoint there, instead of prefilling the same
        tokens beside it)."""
        pieces = []
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            try:
                if not seq.resumed:                     # its first piece: from the deepest checkpoint there is now
                    if self.cache.max_bytes and any(
                            _shared(seq.prompt, p.prompt, p.prefilled + n) >= p.prefilled + n for p, n in pieces):
                        continue
                    seq.resumed = True
                    seq.prefilled, seq.state = self.cache.lookup(seq.prompt, max_len=len(seq.prompt) - 1)
                    seq.cached_tokens = seq.prefilled
                n = min(self._next_stop(seq), seq.prefilled + budget) - seq.prefilled
            except Exception:
                self._fault(seq, self.prefilling)
                continue
            pieces.append((seq, n))
            budget -= n
        return pieces

    def _run_pieces(self, pieces: list):
        """Prefill each request's piece: one packed forward (``cu_seqlens``) for the pieces that start from a state
        and one for those that start from none. A forward that fails is run again piece by piece (the states it
        read are unchanged), so only the request whose own work fails - its forward or its ``_after_piece`` -
        ends with "error", and the others go on."""
        for group in ([p for p in pieces if p[0].state is not None], [p for p in pieces if p[0].state is None]):
            if not group:
                continue
            try:
                done = self._forward_pieces(group)
            except Exception:
                done = []
                for piece in group:
                    try:
                        done += self._forward_pieces([piece])
                    except Exception:
                        self._fault(piece[0], self.prefilling)
            for seq, *result in done:
                try:
                    self._after_piece(seq, *result)
                except Exception:
                    self._fault(seq, self.prefilling)

    def _next_stop(self, seq: Sequence) -> int:
        """Where the request's next prefill piece ends: the next multiple of ``prefix_block``, the next end of
        a chat message or the prompt's end, whichever comes first (the prompt's end only without a cache)."""
        end = len(seq.prompt)
        if not self.cache.max_bytes:
            return end
        block = (seq.prefilled // self.prefix_block + 1) * self.prefix_block
        message = next((b for b in seq.boundaries if b > seq.prefilled), end)
        return min(end, block, message)

    def _forward_pieces(self, pieces: list) -> list:
        """The next ``n`` prompt tokens of each (request, n) in one forward -> [(request, n, state, last logits
        (1, vocab), hidden states or None)]: a lone piece as a (1, n) row from its own state, several packed in
        one row with their states' rows joined (``cat_states``) and taken apart after (``select_rows``)."""
        mtp = self.speculative == "mtp"
        self.counters["prefill_forwards"] += 1
        if len(pieces) == 1:
            seq, n = pieces[0]
            ids = torch.tensor([seq.prompt[seq.prefilled:seq.prefilled + n]], dtype=torch.long, device=self.device)
            state = None if seq.state is None else with_capacity(seq.state, seq.max_len)  # chunks append in place
            with capture_hidden(self.model, mtp) as seen:
                last, state = self.model.prefill(ids, state, logits="last")
            return [(seq, n, state, last, seen[-1][0] if seen else None)]
        tokens = [t for seq, n in pieces for t in seq.prompt[seq.prefilled:seq.prefilled + n]]
        cu = torch.tensor([0] + [n for _, n in pieces], device=self.device).cumsum(0)
        state = None if pieces[0][0].state is None else cat_states([seq.state for seq, _ in pieces])
        with capture_hidden(self.model, mtp) as seen:
            last, state = self.model.prefill(torch.tensor([tokens], dtype=torch.long, device=self.device), state,
                                             cu_seqlens=cu, logits="last")
        bounds = cu.tolist()
        return [(seq, n, select_rows(state, [i], seq.max_len), last[i:i + 1],
                 seen[-1][0, bounds[i]:bounds[i + 1]] if seen else None) for i, (seq, n) in enumerate(pieces)]

    def _after_piece(self, seq: Sequence, n: int, state, last: torch.Tensor, hidden):
        """The request's state after ``n`` more prompt tokens (``last``: (1, vocab) logits at its last; ``hidden``
        the model's hidden states over them, for the MTP head): at a block's or a message's end keep it in the
        prefix cache; at the prompt's end keep it too and sample its first token."""
        if hidden is not None:
            seq.hidden.append(hidden)
        seq.state = with_capacity(state, seq.max_len)
        seq.prefilled += n
        self.counters["prefill_tokens"] += n
        at = seq.prefilled
        if at < len(seq.prompt) and self.cache.max_bytes and (at % self.prefix_block == 0 or at in seq.boundaries):
            self._keep(seq.prompt[:at], seq.state)
        if seq.prefilled == len(seq.prompt):
            self._keep(seq.prompt, seq.state)
            for f in seq.forks:                     # the other choices: copies of the prompt's state
                f.state = select_rows(seq.state, [0], f.max_len)
                f.prefilled, f.cached_tokens = seq.prefilled, seq.cached_tokens
            if seq.hidden:                          # the MTP head drafts from the prompt tokens prefilled here
                hidden, start = torch.cat(seq.hidden)[None], seq.prefilled - sum(len(h) for h in seq.hidden)
                for s in [seq, *seq.forks]:
                    s.mtp = MTPDrafter(self.model, [seq.prompt[start:]], hidden)
                seq.hidden = []
            for s in [seq, *seq.forks]:
                self._emit(s, last)
