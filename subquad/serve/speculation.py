"""Speculation inside the batch (``Engine(speculative="ngram")``, ``subquad serve --speculative ngram``; a draft model:
``Engine(speculative=draft)``, ``--speculative DIR``; or the checkpoint's MTP head: ``"mtp"``). Each decoding step,
a row drafts up to ``draft_tokens`` tokens by prompt lookup over its prompt and output
(``models.speculative.PromptLookup``), as the draft model's greedy continuation (``serve.drafting.BatchDraft``: its
state has a row per running row, joins and leaves with them, and keeps what each row kept), or from the MTP head (a
``models.speculative.MTPDrafter`` per row, fed the model's hidden states - so the model's steps and verifications
run eagerly, where hooks see them - from the prompt tokens this request prefilled: a prefix taken from the cache has
none, and the head drafts from the rest), and the batch runs [last token, drafts] through the model in one forward
(``models.speculative.verify``; rows with fewer drafts are padded, a step without any draft is a plain step). Each
row then samples its tokens in order with its own sampler, one position at a time, and goes on past position j only
while the token it drew is the draft there: a token drawn at a position whose context (the drafts before it) is its
own history is a plain step's token, so every row's tokens - greedy or sampled, with penalties, a grammar or
logprobs - are the ones it would draw without speculation, from the same draws of its generator. (With a one-hot
draft this is the standard rule: it keeps draft d with probability p(d), and otherwise draws from p without d.) The
state keeps each row's consumed tokens (``Verification.accept``, a different count per row). A row whose drafts keep
failing drafts again after 1, 2, 4, ... up to ``MAX_PAUSE`` plain steps, and the whole batch takes plain steps while
a verification costs more wall time per emitted token than a plain step (``models.speculative.Pacer``); a row of
prompt lookup running alone drafts first and the pacer judges it by its match's length, with no pause of its own
(as ``generate``'s one row). A row may
pass a multiple of ``prefix_block`` inside one verification; no checkpoint is kept there.
"""

from __future__ import annotations

import traceback

import torch

from subquad.models.speculative import MAX_PAUSE, PromptLookup
from subquad.serve.request import Sequence


class Speculating:
    """Each running row's drafts and the tokens it keeps of a verification (module doc); a part of
    ``serve.engine.Engine``, whose ``_decode`` verifies the drafts."""

    def _drafts(self, budget: int, keyed: bool = False) -> list[list[int]]:
        """Each running row's drafts by prompt lookup or from the draft model: up to ``budget`` (``draft_tokens``,
        or fewer at a large batch: ``models.speculative.draft_budget``), fewer where its max_tokens or the
        context would end first, none while it pauses after failed drafts (module doc) - unless ``keyed`` (the
        pacer judges the drafts by their match: no row pauses)."""
        rooms = []
        for s in self.running:
            room = min(s.params.max_tokens - len(s.tokens), self.max_context - len(s.prompt) - len(s.tokens)) - 1
            if keyed:
                s.wait = s.pause = 0
            if s.wait or room < 1 or s.finish_reason is not None:
                s.wait = max(0, s.wait - 1)
                room = 0
            rooms.append(min(budget, max(room, 0)))
        if self.speculative == "mtp":
            out = [s.mtp.propose([s.tokens[-1]], [0], room)[0] if room and s.mtp is not None else []
                   for s, room in zip(self.running, rooms)]
        elif self.draft is not None:                # the draft model runs for every row, or for none
            k = max(rooms)
            self.draft.matchers = [getattr(s.sampler, "matcher", None) for s in self.running]   # a row's grammar
            proposed = self.draft.propose([s.tokens[-1] for s in self.running], k) if k else []
            out = [p[:r] for p, r in zip(proposed, rooms)] if k else [[] for _ in rooms]
        else:
            out = []
            for s, room in zip(self.running, rooms):
                if room and s.lookup is None:
                    s.lookup = PromptLookup(s.prompt + s.tokens)
                out.append(s.lookup.draft(room) if room else [])
        # a row with fewer drafts is padded to the longest: no row's positions may pass max_context (learned
        # positions end there)
        cap = self._draft_cap = max(min(self.max_context - len(s.prompt) - len(s.tokens) for s in self.running), 0)
        return [d[:cap] for d in out]

    def _emit_drafted(self, seq: Sequence, rows: torch.Tensor, drafts: list[int]) -> int:
        """Sample the row's tokens from its logits at each verified position (rows (k + 1, vocab)), going on
        past position j only while the token drawn there is draft j and the request goes on; returns how many
        it emitted (>= 1: the tokens of [fed, drafts...] its state keeps). A failed sampling ends it ("error")."""
        n = 0
        try:
            while True:
                self._emit(seq, rows[n:n + 1])
                n += 1
                if seq.lookup is not None:
                    seq.lookup.append(seq.tokens[-1])
                if n > len(drafts) or seq.tokens[-1] != drafts[n - 1] or seq.finish_reason is not None:
                    break
        except Exception:
            traceback.print_exc()
            self._end(seq, "error", "errors")
        if drafts:
            self.counters["drafted"] += len(drafts)
            self.counters["accepted"] += n - 1
            seq.pause = 0 if n > 1 else min(2 * seq.pause or 1, MAX_PAUSE)
            seq.wait = seq.pause
        return max(n, 1)
