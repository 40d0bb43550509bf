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
3. Chunked, batched prefill (``serve.prefill``): up to ``prefill_chunk`` prompt tokens, the pieces of the
   requests due together packed in one forward, each resumed from the deepest checkpoint of its prompt in the
   prefix cache (``PrefixCache``, a radix tree) and keeping checkpoints every ``prefix_block`` tokens and at each
   chat message's end. A request whose prompt is done samples its first token and joins the batch
   (``rows.cat_states``).
4. One decoding step for every row together (``LanguageModel.step``); each row samples its token with
   its own generator (``RowSampler``), finished rows leave (``rows.select_rows``) and their state is kept
   in the prefix cache under the tokens it has consumed; a row whose state reaches a multiple of
   ``prefix_block`` tokens is kept there too, so the guarantee above covers answers as well as prompts.

Speculation (``Engine(speculative="ngram" | "mtp" | draft model)``): each row drafts and the batch verifies the
drafts in one forward, every row's tokens those it would draw without it (``serve.speculation``).

Memory: KV caches are sized once per batch for its longest row, and admission keeps the live rows' states (twice,
while the batch changes) and the prefix cache within ``memory_mb`` (``serve.memory``).

Faults. Every accepted request gets exactly one final event. A request whose own work fails (its prefill,
its sampling: say NaN logits) ends with finish_reason "error" and the others go on; a failure of the
batched step itself ends the rows in the batch with "error"; the loop never stops.

Each request's tokens equal ``model.generate(prompt, max_tokens, ...)`` run alone, greedy or seeded: the
same sampling calls on the same logits. The logits themselves agree to float rounding, not bit for bit - a
batched matrix product rounds differently from a one-row one, and a prompt prefilled in chunks or resumed
from a cached state sums in another order - so two tokens whose logits tie to ~1e-7 may differ.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque

import torch

from subquad import kernels
from subquad.models.constrain import FormatError, Grammar, check_format
from subquad.models.rows import cat_states, select_rows, state_nbytes, with_capacity
from subquad.models.speculative import (
    Pacer,
    capture_hidden,
    drafting_plan,
    keeps_states,
    pacer_for,
    verify,
)
from subquad.serve.drafting import BatchDraft
from subquad.serve.memory import Memory
from subquad.serve.prefill import Prefill
from subquad.serve.prefix_cache import PrefixCache
from subquad.serve.request import Event, NotAccepting, QueueFull, Sequence
from subquad.serve.sampling import OptionError, RowSampler, SamplingParams, logprobs_of
from subquad.serve.speculation import Speculating
from subquad.serve.text import TextStream

__all__ = ["Engine", "Event", "NotAccepting", "QueueFull", "Sequence", "PREFIX_BLOCK"]

PREFIX_BLOCK = 256    # prompt tokens between two prefix checkpoints (benchmarks/RESULTS.md, "Prefix checkpoints")


class Engine(Prefill, Speculating, Memory):
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
                             f"(context_length={model.config.context_length}): at most that")
        draft = speculative if speculative is not None and not isinstance(speculative, str) else None
        if draft is not None and getattr(draft, "config", None) is not None and draft.config.pos_emb == "learned" \
                and max_context + draft_tokens > draft.config.context_length:      # it reads its drafts ahead too
            raise ValueError(f"max_context={max_context} and draft_tokens={draft_tokens} pass the draft model's "
                             f"learned positions (context_length={draft.config.context_length}): max_context at most "
                             f"{draft.config.context_length - draft_tokens}, or a draft without learned positions")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = model.embed.weight.device
        self.max_batch, self.max_queue, self.max_context = max_batch, max_queue, max_context
        self.prefill_chunk = prefill_chunk
        self.budget = None if memory_mb is None else int(memory_mb * 2 ** 20)
        self.cache = PrefixCache(int(state_cache_mb * 2 ** 20))
        self.prefix_block = prefix_block
        self.speculative, self.draft_tokens = speculative, draft_tokens
        # a draft model: its state follows the batch's rows (serve.drafting)
        self.draft = None if speculative is None or isinstance(speculative, str) else BatchDraft(speculative, model)
        # speculation: verify only while it pays against a plain step (the model's pacer, as generate's)
        self.pacer = pacer_for(model, speculative, draft_tokens) if speculative is not None else Pacer()
        self._kept: dict = {}              # (rows > 1, drafts) -> keeps_states (``_keeps``)
        self.eos = set(model.config.eos_token_ids if eos_ids is None else eos_ids)
        self._fixed_bytes, self._fixed_held, self._kv_layers = self._measure_row()
        self._inbox: deque = deque()       # submitted, not yet seen by the loop
        self._unfinished: dict = {}        # id -> every accepted Sequence without its final event yet
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # the plain steps' kernels.steady span: renewed where code not the loop's own ran (a caller's ``step``, an
        # ``on_event`` callback not marked ``subquad_internal``); a step with hooks or drafts runs outside it
        self._span = kernels.Steady()
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
        if not isinstance(prompt, (list, tuple)):
            hint = " (text: encode it with the tokenizer first, e.g. tok.encode(text).ids)" if isinstance(prompt, str) \
                else ""
            raise ValueError(f"prompt must be a list of token ids, got {type(prompt).__name__}{hint}")
        if not prompt:
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
        too (metrics, submit): ``list`` copies the deque in one step, where iterating it could meet a change. A row
        whose final event is sent is not counted, though the step removes it only after its last row's event: a
        consumer that has its final event reads its row gone."""
        return sum(s.rows for s in list(self.prefilling)) + sum(s.finish_reason is None for s in list(self.running))

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
                busy = self._iterate()
            except Exception:                       # a bug outside any one request's work: end them all, go on
                traceback.print_exc()
                self._fail_all()
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()

    def _run(self):
        self.run()

    def step(self) -> bool:
        """One iteration (module doc); returns whether any request is left to work on."""
        self._span.renew()                  # called from outside the loop: the caller's code ran since the last
        return self._iterate()

    @torch.no_grad()
    def _iterate(self) -> bool:
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

    def _join(self, joiners: list):
        """The requests whose prompt is done join the batch, its KV caches sized for the new longest row in the
        same copy (``cat_states(.., capacity)``)."""
        if not joiners:
            return
        try:
            if self.batch_state is None and len(joiners) == 1:
                joined = joiners[0].state                   # already sized for its own max_len
            else:
                joined = cat_states(([self.batch_state] if self.batch_state is not None else [])
                                    + [s.state for s in joiners], max(s.max_len for s in self.running + joiners))
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
        self.batch_state = joined
        del joined
        for s in joiners:
            s.state = None
        self.running += joiners

    def _keeps(self, rows: int, k: int) -> bool:
        """``models.speculative.keeps_states`` for rows x (k + 1) tokens, asked once: it reads only whether rows > 1,
        the token count and the model's structure (~70 us a call over a 24-layer hybrid, at every step of a row of
        prompt lookup running alone)."""
        key = (rows > 1, k)
        if key not in self._kept:
            self._kept[key] = keeps_states(self.model, torch.zeros(rows, k + 1, dtype=torch.long))
        return self._kept[key]

    def _decode(self):
        """One step of every running row (with speculation: a verification of each row's drafts); a row whose
        sampling fails ends with "error", finished rows leave."""
        if not self.running:
            return
        started = self.pacer.start()
        feed = [s.tokens[-1] for s in self.running]
        mtp = self.speculative == "mtp"                     # eager forwards: the head reads their hidden states
        drafts, fixed, key = [], False, None
        # one row of prompt lookup drafts first and the pacer judges it by its match's n, as generate's one row
        # (models.speculative.Pacer: keys), without the row's own pause after failed drafts
        keyed = self.speculative == "ngram" and len(self.running) == 1
        if self.speculative is not None and (keyed or self.pacer.want()):
            fixed, per_row = drafting_plan(self.model, len(feed), self.draft_tokens, mtp, self._keeps)
            drafts = self._drafts(per_row, keyed)
            if keyed:
                key = self.running[0].lookup.n if self.running[0].lookup is not None else 0
                if not self.pacer.verifies(bool(drafts[0]), key):
                    drafts = [[]]
        k = max(map(len, drafts), default=0)
        if k and fixed:
            k = per_row if self._draft_cap >= per_row else 0    # compiled: a graph per count (compiled_budget)
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
                    with kernels.steady(self._span):        # plain steps: the kept calls checked once a span
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
        self.pacer.measured(time.perf_counter() - started, sum(emitted) / len(emitted) if k else None, len(emitted),
                            key)
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
        if seq.on_event is not None and not getattr(seq.on_event, "subquad_internal", False):
            self._span.renew()              # another's code runs here: what it may change is checked again
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
        self.batch_state = select_rows(self.batch_state, keep, max(s.max_len for s in self.running))

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
