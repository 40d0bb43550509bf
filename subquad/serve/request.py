"""A request as the engine holds it (``Sequence``), the events it sends (``Event``), and the two refusals
``submit`` raises for load rather than for the request (``QueueFull``: HTTP 429, ``NotAccepting``: 503)."""

from __future__ import annotations

import itertools
import queue
import time
from dataclasses import dataclass

from subquad.models.speculative import PromptLookup
from subquad.serve.sampling import RowSampler, SamplingParams


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue``: try again later (HTTP 429)."""


class NotAccepting(RuntimeError):
    """The engine is draining or stopped (HTTP 503)."""


@dataclass
class Event:
    """One step of a request's output. ``token`` is None only on a final event that carries no token
    (cancelled, aborted at shutdown, or an error); ``finish_reason`` is set on the last event only:
    "stop" (end-of-text, a stop token or a stop string), "length" (max_tokens or the context), "abort",
    "error". ``index``: the choice of the request it belongs to."""

    token: int | None
    text: str = ""
    logprob: float | None = None
    top_logprobs: list | None = None
    finish_reason: str | None = None
    index: int = 0


class Sequence:
    """One request as the engine holds it."""

    _ids = itertools.count()

    def __init__(self, prompt: list[int], params: SamplingParams, sampler: RowSampler, text, on_event, index=0,
                 boundaries=()):
        """Its prompt ids, parameters, sampler, text stream (None without a tokenizer), event callback, choice
        and the prompt's chat-message ends (token counts: checkpoints are kept there)."""
        self.id = next(Sequence._ids)
        self.prompt, self.params, self.sampler, self.text, self.index = prompt, params, sampler, text, index
        self.boundaries = sorted(set(boundaries))
        self.resumed = False               # has it looked for its prefix in the cache (at its first piece)
        self.choices: list[Sequence] = [self]   # every choice of the request (on choice 0)
        self.forks: list[Sequence] = []         # choices 1..n-1 until the prompt is done and they are copied
        self.tokens: list[int] = []
        self.state = None                  # while prefilling: this request's own state
        self.prefilled = 0                 # prompt tokens the state has consumed
        self.cached_tokens = 0             # of them, taken from the prefix cache
        self.finish_reason: str | None = None
        self.cancelled = False
        self.on_event = on_event
        self.events: queue.Queue = queue.Queue()
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None
        self.lookup: PromptLookup | None = None   # speculation: prompt lookup over its prompt and tokens
        self.mtp = None                           # or its MTP drafter (made when its prompt is done)
        self.hidden: list = []                    # the model's hidden states over the prompt tokens it prefilled
        self.pause = self.wait = 0                # plain steps after failed drafts: the next pause, left of it

    @property
    def rows(self) -> int:
        """Batch rows it will take: itself and its forks not yet copied."""
        return 1 + len(self.forks)

    @property
    def max_len(self) -> int:
        """Tokens its state can reach: the prompt and every token it may generate (what memory is sized for)."""
        return len(self.prompt) + self.params.max_tokens

    def _push(self, event: Event):
        """Hand an event to its consumer (the callback, else the queue ``Engine.stream`` reads)."""
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
        (self.on_event or self.events.put)(event)
