"""The serving engine: continuous batching of independent requests over one model, without HTTP.

    engine = Engine(model, tokenizer, max_batch=16)
    engine.start()                                   # the decoding loop, in a thread of its own (or engine.run())
    seq = engine.submit(prompt_ids, SamplingParams(max_tokens=64, temperature=0))
    for event in engine.stream(seq):                 # Event(token, text, logprob, ..., finish_reason)
        print(event.text, end="")
    engine.cancel(seq)                               # from any thread; its row is freed at the next step

A request with ``n`` choices (``SamplingParams.n``) is prefilled once: at the prompt's end its state is copied
for choices 1..n-1 (``seq.choices``; each has its own events, ``Event.index`` its choice, and draws from
``seed + i``), and the n rows join the batch together.

One loop iteration (``step``), vLLM's scheduler in miniature:

1. Cancelled requests leave (their rows are dropped from the batch state).
2. Admission: waiting requests join while the batch has room and the memory budget (below) allows.
3. Chunked, batched prefill: at most ``prefill_chunk`` prompt tokens are prefilled per iteration, so a long
   prompt is spread over many iterations and never stalls the rows that are decoding. The tokens go in rounds:
   each round takes the next piece of every prefilling request in order while the budget lasts and runs them in
   one packed forward (``cu_seqlens``; the pieces that start from a state and those that start from none in one
   each), so prompts admitted together share their forwards and a lone prompt still takes several pieces in
   one iteration. A request resumes from the deepest checkpoint of its prompt in the prefix cache (``PrefixCache``,
   a radix tree) when its first piece is due - not at admission, and a round later when a piece beside it ends
   inside the prefix they share, so the requests admitted together behind one that prefills a shared system
   prompt find it. It prefills in pieces that end at every multiple of ``prefix_block`` tokens and at each end
   of a chat message (``submit(boundaries=)``), and keeps its state at each as a checkpoint: a later prompt
   sharing N tokens with this one resumes at least ``N - N % prefix_block`` tokens in (the prompt's last token
   is always prefilled: it gives the first token's logits). A request whose prompt is done samples its first
   token and joins the batch (``rows.cat_states``).
4. One decoding step for every row together (``LanguageModel.step``); each row samples its token with
   its own generator (``RowSampler``), finished rows leave (``rows.select_rows``) and their state is kept
   in the prefix cache under the tokens it has consumed; a row whose state reaches a multiple of
   ``prefix_block`` tokens is kept there too, so the guarantee above covers answers as well as prompts.

Speculation (``Engine(speculative="ngram")``, ``subquad serve --speculative ngram``; a draft model:
``Engine(speculative=draft)``, ``--speculative DIR``; or the checkpoint's MTP head: ``"mtp"``). Each decoding step,
a row drafts up to ``draft_tokens`` tokens by prompt lookup over its prompt and output
(``models.speculative.PromptLookup``), as the draft model's greedy continuation (``serve.drafting.BatchDraft``: its
state has a row per running row, joins and leaves with them, and keeps what each row kept), or from the MTP head (a
``models.speculative.MTPDrafter`` per row, fed the model's hidden states - so the model's steps and verifications
run eagerly, where hooks see them - from the prompt tokens this request prefilled: a prefix taken from the cache
has none, and the head drafts from the rest), and the batch runs [last token, drafts] through the model in one
forward (``models.speculative.verify``; rows with fewer drafts are padded, a step without any draft is a plain
step). Each row then samples its tokens in order with its own sampler, one position at a time, and goes on past
position j only while the token it drew is the draft there: a token drawn at a position whose context (the drafts
before it) is its own history is a plain step's token, so every row's tokens - greedy or sampled, with penalties, a
grammar or logprobs - are the ones it would draw without speculation, from the same draws of its generator. (With a
one-hot draft this is the standard rule: it keeps draft d with probability p(d), and otherwise draws from p without
d.) The state keeps each row's consumed tokens (``Verification.accept``, a different count per row). A row whose
drafts keep failing drafts again after 1, 2, 4, ... up to ``MAX_PAUSE`` plain steps, and the whole batch takes
plain steps while a verification costs more wall time per emitted token than a plain step
(``models.speculative.Pacer``). A row may pass a multiple of ``prefix_block`` inside one verification; no
checkpoint is kept there.

Memory. Every KV cache the engine holds is sized once for the longest ``prompt + max_tokens`` among the rows
it serves (``rows.with_capacity``: a left-padded batch holds every row as long as its longest), so steps and
prefill chunks append in place and never double a buffer. A row then holds ``held_bytes``: its fixed-size
state plus those KV buffers (a sliding window's buffer is 2W). Joining, leaving and each step hold the old
and the new state at once for a moment, so admission keeps ``2 x held_bytes(live rows) + prefix cache <=
memory budget``, and a state goes into the prefix cache only within what that leaves (LRU entries are
evicted first, else it is not kept). The budget covers states and the cache, not the weights nor a step's
activations (an attention layer's keys and values, its grouped heads repeated, one layer at a time).

Faults. Every accepted request gets exactly one final event. A request whose own work fails (its prefill,
its sampling: say NaN logits) ends with finish_reason "error" and the others go on; a failure of the
batched step itself ends the rows in the batch with "error"; the loop never stops.

Each request's tokens equal ``model.generate(prompt, max_tokens, ...)`` run alone, greedy or seeded: the
same sampling calls on the same logits. The logits themselves agree to float rounding, not bit for bit - a
batched matrix product rounds differently from a one-row one, and a prompt prefilled in chunks or resumed
from a cached state sums in another order - so two tokens whose logits tie to ~1e-7 may differ.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch

from subquad.models.rows import cat_states, select_rows, state_nbytes, with_capacity
from subquad.models.speculative import (MAX_PAUSE, MTPDrafter, Pacer, PromptLookup, capture_hidden, keeps_states,
                                        verify)
from subquad.ops import KVCache
from subquad.serve.drafting import BatchDraft
from subquad.serve.prefix_cache import PrefixCache
from subquad.models.constrain import FormatError, Grammar, check_format
from subquad.serve.sampling import OptionError, RowSampler, SamplingParams, logprobs_of
from subquad.serve.text import TextStream

PREFIX_BLOCK = 256    # prompt tokens between two prefix checkpoints (benchmarks/RESULTS.md, "Prefix checkpoints")


def _shared(a: list, b: list, limit: int) -> int:
    """How many leading tokens ``a`` and ``b[:limit]`` have in common."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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


class Engine:
    """Continuous batching over ``model`` (see the module doc). ``tokenizer``: a ``tokenizers.Tokenizer``
    for text and stop strings (None: tokens only). ``memory_mb``: the budget for live states plus the
    prefix cache (module doc; None: no limit but ``state_cache_mb``; ``subquad serve`` defaults it to half
    the memory available, ``available_memory_bytes``). ``eos_ids``: default the model's
    ``config.eos_token_ids``. ``prefix_block``: prefill keeps a checkpoint every this many prompt tokens
    (module doc; ``PREFIX_BLOCK`` by default). ``speculative="ngram"``, ``"mtp"`` (the model's own MTP head) or a
    draft model (a ``LanguageModel`` with the same vocabulary): each row drafts up to ``draft_tokens`` tokens per
    step by prompt lookup, from the head or from the draft model (module doc, "Speculation")."""

    def __init__(self, model, tokenizer=None, *, max_batch: int = 16, max_queue: int = 64, max_context: int = 4096,
                 prefill_chunk: int = 512, state_cache_mb: float = 256.0, memory_mb: float | None = None,
                 eos_ids=None, prefix_block: int | None = None, speculative: str | None = None,
                 draft_tokens: int = 4):
        """Check the limits, measure one row's state and set up the queues (the loop starts with ``start``)."""
        prefix_block = PREFIX_BLOCK if prefix_block is None else prefix_block
        if isinstance(speculative, str) and speculative not in ("ngram", "mtp"):
            raise ValueError(f"speculative must be None, 'ngram' (prompt lookup), 'mtp' (the model's MTP head) or a "
                             f"draft model, got {speculative!r}")
        if speculative == "mtp" and getattr(model, "mtp", None) is None:
            raise ValueError("speculative='mtp': this model has no MTP head (model.mtp); use 'ngram' or a draft model")
        for name, v in (("max_batch", max_batch), ("max_context", max_context), ("prefill_chunk", prefill_chunk),
                        ("prefix_block", prefix_block), ("draft_tokens", draft_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        if not isinstance(state_cache_mb, (int, float)) or state_cache_mb < 0:
            raise ValueError(f"state_cache_mb must be a number >= 0, got {state_cache_mb!r}")
        if memory_mb is not None and (not isinstance(memory_mb, (int, float)) or memory_mb <= 0):
            raise ValueError(f"memory_mb must be a positive number or None, got {memory_mb!r}")
        if model.config.pos_emb == "learned" and max_context > model.config.context_length:
            raise ValueError(f"max_context={max_context} passes the model's learned positions "
                             f"(context_length={model.config.context_length})")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = model.embed.weight.device
        self.max_batch, self.max_queue, self.max_context, self.prefill_chunk = max_batch, max_queue, max_context, prefill_chunk
        self.budget = None if memory_mb is None else int(memory_mb * 2 ** 20)
        self.cache = PrefixCache(int(state_cache_mb * 2 ** 20))
        self.prefix_block = prefix_block
        self.speculative, self.draft_tokens = speculative, draft_tokens
        # a draft model: its state follows the batch's rows (serve.drafting)
        self.draft = None if speculative is None or isinstance(speculative, str) else BatchDraft(speculative, model)
        self.pacer = Pacer()               # speculation: verify only while it pays against a plain step
        self.eos = set(model.config.eos_token_ids if eos_ids is None else eos_ids)
        self._fixed_bytes, self._fixed_held, self._kv_layers = self._measure_row()
        self._inbox: deque = deque()       # submitted, not yet seen by the loop
        self._unfinished: dict = {}        # id -> every accepted Sequence without its final event yet
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.waiting: deque = deque()
        self.prefilling: deque = deque()
        self.running: list[Sequence] = []
        self.batch_state = None
        self.accepting, self._deadline, self._thread, self._stop = True, None, None, False
        self.drained = threading.Event()
        self.counters = dict(requests=0, prefill_tokens=0, generated_tokens=0, finished=0, cancelled=0, errors=0,
                             decode_steps=0, decode_rows=0, verifications=0, drafted=0, accepted=0,
                             prefill_forwards=0)
        self.state_bytes = 0
        self._recent: deque = deque()      # (time, tokens generated) over the last seconds: tokens/s

    # -- the public interface -------------------------------------------------------------------------

    def submit(self, prompt, params: SamplingParams | None = None, on_event=None, boundaries=()) -> Sequence:
        """Queue a request; returns its handle. ``on_event(Event)`` is called from the loop's thread for each
        event (else read them with ``stream``). With ``params.n`` > 1 the handle is choice 0 and ``seq.choices``
        holds all n. ``boundaries``: token counts in (0, len(prompt)) where the prompt's chat messages end
        (``chat.message_ends``); the prefix cache keeps a checkpoint at each. ValueError names what is wrong
        with the request (``OptionError`` its option); QueueFull when ``max_queue`` requests already wait;
        NotAccepting while draining."""
        params = params or SamplingParams()
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must hold at least one token")
        V = self.model.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in prompt):
            raise ValueError(f"prompt must hold token ids in [0, {V})")
        if len(prompt) > self.max_context:
            raise ValueError(f"prompt is {len(prompt)} tokens, over the server's max context of {self.max_context}")
        if len(prompt) + params.max_tokens > self.max_context:
            raise OptionError("max_tokens", f"max_tokens={params.max_tokens} plus the prompt's {len(prompt)} tokens "
                                            f"passes the max context of {self.max_context}")
        if params.stop and self.tokenizer is None:
            raise OptionError("stop", "stop strings need a tokenizer; this model has none")
        if params.n > self.max_batch:
            raise OptionError("n", f"n={params.n} choices are over the server's max batch of {self.max_batch}")
        params.check_vocab(V)
        grammar = self._grammar(params.response_format)
        if any(isinstance(b, bool) or not isinstance(b, int) or not 0 < b < len(prompt) for b in boundaries):
            raise ValueError(f"boundaries must be token counts in (0, {len(prompt)}), got {list(boundaries)}")
        rows = [len(prompt) + params.max_tokens] * params.n
        if self.budget is not None and 2 * self.held_bytes(rows) > self.budget:
            raise OptionError("max_tokens", f"max_tokens={params.max_tokens}: the prompt and max_tokens need "
                                            f"{self.held_bytes(rows):,} bytes of state for n={params.n} (twice that "
                                            f"while the batch changes), over the memory budget of {self.budget:,}")
        seqs = []
        for i in range(params.n):
            text = None
            if self.tokenizer is not None:
                text = TextStream(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), params.stop)
            sampler = RowSampler(params, self.device, list(prompt), i, None if grammar is None else grammar.matcher())
            seqs.append(Sequence(list(prompt), params, sampler, text, on_event, index=i, boundaries=boundaries))
        seq = seqs[0]
        seq.choices, seq.forks = seqs, seqs[1:]
        with self._lock:
            if not self.accepting:
                raise NotAccepting("the server is shutting down")
            if len(self.waiting) + len(self._inbox) >= self.max_queue + max(0, self.max_batch - self.active):
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            self._inbox.append(seq)
            self._unfinished.update((s.id, s) for s in seqs)
            self.counters["requests"] += 1
        self._wake.set()
        return seq

    def stream(self, seq: Sequence, timeout: float | None = None):
        """Yield the events of a request submitted without ``on_event``, until its final one."""
        while True:
            event = seq.events.get(timeout=timeout)
            yield event
            if event.finish_reason is not None:
                return

    def cancel(self, seq: Sequence) -> None:
        """Stop a request (from any thread); its row and state are dropped at the next step."""
        seq.cancelled = True
        self._wake.set()

    @property
    def active(self) -> int:
        """Rows holding (or about to hold) a state: prefilling, their forks, decoding. Read from other threads
        too (metrics, submit): ``list`` copies the deque in one step, where iterating it could meet a change."""
        return sum(s.rows for s in list(self.prefilling)) + len(self.running)

    @property
    def queue_length(self) -> int:
        """Requests accepted and waiting for a slot."""
        return len(self.waiting) + len(self._inbox)

    def start(self) -> "Engine":
        """Run the loop in a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="subquad-engine", daemon=True)
            self._thread.start()
        return self

    def drain(self, timeout: float) -> None:
        """Stop accepting; requests already accepted run on for up to ``timeout`` seconds, then end with a final
        "abort" event. ``drained`` is set when none is left.

        Safe in a signal handler: it only sets two attributes - no lock, no ``Event.set`` (uvicorn runs its
        SIGTERM handler on the main thread, which may be inside ``submit`` holding ``_lock`` or inside
        ``_wake.set()`` holding the event's lock, and neither is reentrant). The loop sees it within its
        0.05 s poll; a request that passed ``submit``'s check just before is still served or aborted."""
        self._deadline = time.monotonic() + max(0.0, timeout)
        self.accepting = False

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop's thread (after ``drain``, once drained)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Tokens generated per second over the last ``window`` seconds."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window]
        return sum(n for _, n in recent) / window if recent else 0.0

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self, until=None) -> None:
        """The loop on the calling thread (``start`` gives it a thread of its own) until ``stop`` or ``until()``:
        step while there is work, else wait for a submit (or 0.05 s).

        ``subquad serve`` runs it on the main thread, where the model was loaded and compiled, and the HTTP
        server in another: with GNU OpenMP, the thread that first ran a parallel region keeps fast ones, and a
        second thread that runs them gets its own team whose workers sleep between regions (tens of us to wake
        each) - a compiled step took 29 ms on a thread against 20 ms on the main thread at mamba-130m's shape
        (benchmarks/RESULTS.md, "The engine on the main thread")."""
        while not self._stop and (until is None or not until()):
            try:
                busy = self.step()
            except Exception:                       # a bug outside any one request's work: end them all, go on
                traceback.print_exc()
                self._fail_all()
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def _run(self):
        self.run()

    @torch.no_grad()
    def step(self) -> bool:
        """One iteration (module doc); returns whether any request is left to work on."""
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        self._drop_cancelled()
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self._abort_all()
        self._admit()
        self._join(self._prefill())
        self._decode()
        self._measure()
        if not self.accepting and not (self.waiting or self.active or self._inbox):
            self.drained.set()
        return bool(self.waiting or self.active or self._inbox)

    def _admit(self):
        """Move waiting requests to prefilling while the batch and the memory budget have room."""
        while self.waiting and self.active + self.waiting[0].rows <= self.max_batch:
            seq = self.waiting[0]
            if self.budget is not None:
                need = self._committed([seq.max_len] * seq.rows)
                if need + self.cache.nbytes > self.budget:
                    self.cache.evict(self.budget - need)
                    if need + self.cache.nbytes > self.budget:
                        break                       # wait until a row leaves
            self.waiting.popleft()
            self.prefilling.append(seq)

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
        return [(seq, n, select_rows(state, [i]), last[i:i + 1], seen[-1][0, bounds[i]:bounds[i + 1]] if seen else None)
                for i, (seq, n) in enumerate(pieces)]

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
                f.state = with_capacity(select_rows(seq.state, [0]), f.max_len)
                f.prefilled, f.cached_tokens = seq.prefilled, seq.cached_tokens
            if seq.hidden:                          # the MTP head drafts from the prompt tokens prefilled here
                hidden, start = torch.cat(seq.hidden)[None], seq.prefilled - sum(len(h) for h in seq.hidden)
                for s in [seq, *seq.forks]:
                    s.mtp = MTPDrafter(self.model, [seq.prompt[start:]], hidden)
                seq.hidden = []
            for s in [seq, *seq.forks]:
                self._emit(s, last)

    def _join(self, joiners: list):
        """The requests whose prompt is done join the batch, its KV caches sized for the new longest row."""
        if not joiners:
            return
        try:
            if self.batch_state is None and len(joiners) == 1:
                joined = joiners[0].state                   # already sized for its own max_len
            else:
                joined = cat_states(([self.batch_state] if self.batch_state is not None else [])
                                    + [s.state for s in joiners])
            if self.draft is not None:
                rows = self.draft.rows
                try:
                    self.draft.join([s.prompt for s in joiners])
                except Exception:
                    self.draft.keep(list(range(rows)))      # the draft's rows as they were
                    raise
        except Exception:                                   # the batch is as it was: the joiners fail
            traceback.print_exc()
            for s in joiners:
                self._end(s, "error", "errors")
            return
        self.batch_state = joined                           # the old states go before the new one is sized
        del joined
        for s in joiners:
            s.state = None
        self.running += joiners
        try:
            self.batch_state = with_capacity(self.batch_state, max(s.max_len for s in self.running))
        except Exception:                                   # still a valid state: its appends reallocate
            traceback.print_exc()

    def _decode(self):
        """One step of every running row (with speculation: a verification of each row's drafts); a row whose
        sampling fails ends with "error", finished rows leave."""
        if not self.running:
            return
        started = time.perf_counter()
        drafts = self._drafts() if self.speculative is not None and self.pacer.want() else []
        feed = [s.tokens[-1] for s in self.running]
        k = max(map(len, drafts), default=0)
        mtp = self.speculative == "mtp"                     # eager forwards: the head reads their hidden states
        if k and not mtp and getattr(self.model, "_decode_step", None) is not None and keeps_states(
                self.model, torch.zeros(len(feed), self.draft_tokens + 1, dtype=torch.long)):
            k = self.draft_tokens if self._draft_cap >= self.draft_tokens else 0  # compiled: one graph, k fixed
        try:
            with capture_hidden(self.model, mtp) as seen:
                if k:
                    ids = [[t] + d + [t] * (k - len(d)) for t, d in zip(feed, drafts)]    # padding: never read
                    logits, ver = verify(self.model, torch.tensor(ids, device=self.device), self.batch_state,
                                         how="replay" if mtp else None)
                elif mtp:
                    logits, self.batch_state = self.model.prefill(torch.tensor(feed, device=self.device)[:, None],
                                                                  self.batch_state, logits="last")
                    logits = logits.unsqueeze(1)
                else:
                    logits, self.batch_state = self.model.step(torch.tensor(feed, device=self.device),
                                                               self.batch_state)
                    logits = logits.unsqueeze(1)
        except Exception:                                   # the batched step: no one row to blame
            traceback.print_exc()
            for s in self.running:
                self._end(s, "error", "errors")
            self._clear_batch()
            return
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(self.running)
        emitted = [self._emit_drafted(seq, logits[i], drafts[i] if k else []) for i, seq in enumerate(self.running)]
        try:
            if k:
                self.counters["verifications"] += 1
                self.batch_state = ver.accept(emitted if len(emitted) > 1 else emitted[0])
                self.batch_state = with_capacity(self.batch_state, max(s.max_len for s in self.running))
            if self.draft is not None:                      # the draft model keeps what the rows kept
                self.draft.settle(feed, emitted if k else None)
            if mtp:                                         # each row's head: the hidden states of what it kept
                for i, seq in enumerate(self.running):
                    if seq.mtp is not None:
                        seq.mtp.settle(None, None, emitted[i], seen[-1][i:i + 1])
        except Exception:
            traceback.print_exc()
            for s in self.running:
                self._end(s, "error", "errors")
            self._clear_batch()
            return
        self._recent.append((time.monotonic(), sum(emitted)))
        self.pacer.measured(time.perf_counter() - started, sum(emitted) / len(emitted) if k else None, len(emitted))
        if self.cache.max_bytes:                            # a row's state at a block's end: a checkpoint too
            for i, seq in enumerate(self.running):
                at = len(seq.prompt) + len(seq.tokens) - 1      # tokens its state has consumed
                if seq.finish_reason is None and at % self.prefix_block == 0:
                    self._keep(seq.prompt + seq.tokens[:-1], select_rows(self.batch_state, [i]), copy=False)
        done = [i for i, s in enumerate(self.running) if s.finish_reason is not None]
        ended = {i: self.running[i] for i in done}
        finals = {}
        if self.cache.max_bytes:                            # one-row copies, compact: the cache takes them as they are
            finals = {i: select_rows(self.batch_state, [i]) for i in done if ended[i].finish_reason != "error"}
        self._remove_rows(done)
        for i, seq in ended.items():
            if seq.finish_reason != "error":
                self._finished(seq, finals.get(i))

    def _drafts(self) -> list[list[int]]:
        """Each running row's drafts by prompt lookup or from the draft model: up to ``draft_tokens``, fewer where
        its max_tokens or the context would end first, none while it pauses after failed drafts (module doc)."""
        rooms = []
        for s in self.running:
            room = min(s.params.max_tokens - len(s.tokens), self.max_context - len(s.prompt) - len(s.tokens)) - 1
            if s.wait or room < 1 or s.finish_reason is not None:
                s.wait = max(0, s.wait - 1)
                room = 0
            rooms.append(min(self.draft_tokens, max(room, 0)))
        if self.speculative == "mtp":
            out = [s.mtp.propose([s.tokens[-1]], [0], room)[0] if room and s.mtp is not None else []
                   for s, room in zip(self.running, rooms)]
        elif self.draft is not None:                # the draft model runs for every row, or for none
            k = max(rooms)
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

    def _grammar(self, response_format):
        """The compiled ``response_format`` of a request (``models.constrain.Grammar``), None for plain text;
        OptionError naming it without a tokenizer or when the grammar library refuses its schema."""
        if check_format(response_format) is None:
            return None
        if self.tokenizer is None:
            raise OptionError("response_format", "response_format needs a tokenizer; this model has none")
        try:
            return Grammar(response_format, self.tokenizer, self.model.config.vocab_size, sorted(self.eos))
        except (FormatError, ImportError) as e:
            raise OptionError("response_format", str(e)) from None

    def _emit(self, seq: Sequence, row: torch.Tensor):
        """Sample the request's next token from its (1, vocab) logits and send the event."""
        tok = seq.sampler(row)
        lp, top = (None, None)
        if seq.params.logprobs is not None:
            lp, top = logprobs_of(row, tok, seq.params.logprobs)
        seq.tokens.append(tok)
        if seq.mtp is not None:
            seq.mtp.append(0, tok)
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        self.counters["generated_tokens"] += 1
        text, stopped = "", False
        stop_token = tok in seq.params.stop_ids
        if seq.text is not None and not stop_token:     # a stop token's own text is not output (as vLLM)
            text, stopped = seq.text.push(seq.tokens)
        finish = None
        matcher = getattr(seq.sampler, "matcher", None)
        done = matcher is not None and matcher.done                     # the response_format is complete
        if stopped or stop_token or done or (tok in self.eos and not seq.params.ignore_eos):
            finish = "stop"
        elif len(seq.tokens) >= seq.params.max_tokens or len(seq.prompt) + len(seq.tokens) >= self.max_context:
            finish = "length"
        if finish is not None and not stopped and seq.text is not None:
            text += seq.text.flush()
        self._send(seq, Event(tok, text, lp, top, finish))

    def _send(self, seq: Sequence, event: Event):
        """Deliver an event; the final one takes the request off the books. A consumer that raises loses its
        request (cancelled), not the loop."""
        event.index = seq.index
        if event.finish_reason is not None:
            self._unfinished.pop(seq.id, None)
        try:
            seq._push(event)
        except Exception:
            traceback.print_exc()
            seq.cancelled = True

    def _finished(self, seq: Sequence, state):
        """A request ended by itself: keep its state (prompt and every token but the last) for the next turn."""
        self.counters["finished"] += 1
        if state is not None and seq.tokens:
            self._keep(seq.prompt + seq.tokens[:-1], state, copy=False)

    def _keep(self, tokens, state, copy: bool = True):
        """Put a one-row state in the prefix cache within the room the memory budget leaves (module doc)."""
        room = None if self.budget is None else self.budget - self._committed()
        self.cache.insert(tokens, state, room=room, copy=copy)

    def _remove_rows(self, rows: list[int]):
        """Take these rows out of the batch; the rest keep KV buffers sized for their own longest."""
        if not rows:
            return
        keep = [i for i in range(len(self.running)) if i not in set(rows)]
        self.running = [self.running[i] for i in keep]
        if self.draft is not None:
            self.draft.keep(keep)
        if not keep:
            self.batch_state = None
            return
        self.batch_state = select_rows(self.batch_state, keep)
        self.batch_state = with_capacity(self.batch_state, max(s.max_len for s in self.running))

    def _drop_cancelled(self):
        """End the cancelled requests wherever they are; their rows leave the batch."""
        for q in (self.waiting, self.prefilling):
            for seq in list(q):
                for f in [f for f in seq.forks if f.cancelled]:
                    seq.forks.remove(f)
                    self._end(f, "abort", "cancelled")
                if seq.cancelled:                   # choice 0 carries the prefill: its forks end with it
                    q.remove(seq)
                    for s in [seq, *seq.forks]:
                        self._end(s, "abort", "cancelled")
        rows = [i for i, s in enumerate(self.running) if s.cancelled]
        for i in rows:
            self._end(self.running[i], "abort", "cancelled")
        self._remove_rows(rows)

    def _end(self, seq: Sequence, reason: str, counter: str):
        """Send a request's final event without a token ("abort" or "error") and drop its state."""
        if seq.id not in self._unfinished:
            return                                          # it has had its final event
        seq.state = None
        self.counters[counter] += 1
        self._send(seq, Event(None, "", finish_reason=reason))

    def _fault(self, seq: Sequence, where: deque):
        """A request's own work raised: it leaves ``where`` with a final "error" event; the others go on."""
        traceback.print_exc()
        if seq in where:
            where.remove(seq)
        for s in [seq, *seq.forks]:
            self._end(s, "error", "errors")

    def _abort_all(self, reason: str = "abort", counter: str = "cancelled"):
        """End every request the loop has seen (waiting, prefilling, running)."""
        for seq in list(self.waiting) + list(self.prefilling) + list(self.running):
            for s in [seq, *seq.forks]:
                self._end(s, reason, counter)
        self.waiting.clear()
        self.prefilling.clear()
        self._clear_batch()

    def _clear_batch(self):
        """No row runs: the batch's state (and the draft model's) goes."""
        self.running, self.batch_state = [], None
        if self.draft is not None:
            self.draft.clear()

    def _fail_all(self):
        """After an error no request can be blamed for: end every accepted request that has not had its final
        event - including any between two queues when it struck - with "error"."""
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            pending = list(self._unfinished.values())
        self._abort_all("error", "errors")
        for seq in pending:
            self._end(seq, "error", "errors")

    def _live(self):
        """The rows holding a state, or about to: prefilling, their forks, decoding."""
        return [s for seq in self.prefilling for s in [seq, *seq.forks]] + self.running

    # -- memory -----------------------------------------------------------------------------------------

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

    def _measure(self):
        """Update the state-bytes gauge (allocated, from the tensors) and forget tokens/s samples over 60 s old."""
        total = state_nbytes(self.batch_state) if self.batch_state is not None else 0
        total += sum(state_nbytes(s.state) for s in self.prefilling if s.state is not None)
        self.state_bytes = total
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > 60:
            self._recent.popleft()

    def metrics(self) -> dict:
        """Counters and gauges for /metrics."""
        c = self.cache
        return {**{f"{k}_total": v for k, v in self.counters.items()},
                "queue_length": self.queue_length, "active_sequences": self.active,
                "generated_tokens_per_second": self.tokens_per_second(),
                "prefix_cache_hits_total": c.hits, "prefix_cache_misses_total": c.misses,
                "prefix_cache_hit_tokens_total": c.hit_tokens, "prefix_cache_bytes": c.nbytes,
                "prefix_cache_entries": len(c), "prefix_cache_max_bytes": c.max_bytes,
                "state_bytes": self.state_bytes, "memory_budget_bytes": self.budget or 0}
