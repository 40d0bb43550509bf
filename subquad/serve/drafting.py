"""A draft model inside the continuous batch (``Engine(speculative=draft_model)``, ``subquad serve --speculative
DIR``): its state holds one row per running row of the engine's batch, in the same order, and covers the same
tokens as that row's state (its prompt and every token it has emitted but the last, which the next step feeds).

    rows join      ``join(prompts)``: the draft model prefills the joining rows' prompts (packed, one forward)
                   and their states go after the batch's rows (``rows.cat_states``)
    rows leave     ``keep(rows)``: the rows that stay (``rows.select_rows``); ``clear()`` when none do
    a step         ``propose(feed, k)``: its greedy continuation, k tokens for every row (k draft steps from the
                   batch's state; the state after each is kept), then ``settle(feed, keeps)``: the state after the
                   ``keeps[i]`` tokens of [feed[i], drafts[i]...] row i kept (``keeps`` None: a plain step, which
                   kept feed alone)

``settle`` is ``models.speculative.ModelDrafter``'s - the kept draft state when every row kept the same count, a
verification of the draft itself rolled back per row when they differ - so the engine's rows and ``generate``'s
keep their draft states the same way. A plain step's fed tokens wait in ``pending`` and are prefilled in one
forward at the next proposal, or before rows join or leave (``catch_up``): the draft model does not run while
drafting waits. Its states are not counted in the engine's memory budget.
"""

from __future__ import annotations

import torch

from subquad.models.rows import cat_states, select_rows
from subquad.models.speculative import ModelDrafter, check_speculative


class BatchDraft(ModelDrafter):
    """The draft model's state over the engine's running rows (module doc)."""

    def __init__(self, draft, target):
        check_speculative(draft, target)
        self.model, self.dev, self.was_training = draft, draft.embed.weight.device, draft.training
        draft.eval()
        self.state, self.states, self.pending, self.rows = None, [], [], 0

    @torch.no_grad()
    def catch_up(self) -> None:
        ModelDrafter.catch_up(self)

    @torch.no_grad()
    def join(self, prompts: list[list[int]]) -> None:
        """The draft states of ``prompts`` (one packed prefill) join after the rows there are."""
        self.catch_up()
        lens = torch.tensor([len(p) for p in prompts])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(self.dev)
        packed = torch.tensor([t for p in prompts for t in p], device=self.dev).view(1, -1)
        if len(prompts) == 1:
            _, new = self.model.prefill(packed, logits="last")
        else:
            _, new = self.model.prefill(packed, cu_seqlens=cu, logits="last")
        self.state = new if self.state is None else cat_states([self.state, new])
        self.rows += len(prompts)

    def keep(self, rows: list[int]) -> None:
        """Only these rows stay, in this order."""
        if not rows:
            self.clear()
            return
        self.catch_up()
        self.state, self.rows = select_rows(self.state, rows), len(rows)

    def clear(self) -> None:
        self.state, self.states, self.pending, self.rows = None, [], [], 0

    @torch.no_grad()
    def propose(self, feed: list[int], k: int) -> list[list[int]]:
        """k greedy draft tokens for every row (``feed``: each row's token to feed)."""
        return ModelDrafter.propose(self, feed, list(range(len(feed))), k)

    @torch.no_grad()
    def settle(self, feed: list[int], keeps: list[int] | None) -> None:
        """Row i kept ``keeps[i]`` tokens of [feed[i], its drafts...] (None: a plain step: feed alone)."""
        if keeps is None:
            ModelDrafter.settle(self, feed, None, 1)
        else:
            ModelDrafter.settle(self, feed, self.drafted, keeps if len(keeps) > 1 else keeps[0])
