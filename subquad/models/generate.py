"""Sampling from a language model, decoding with its recurrent state.

    new_ids, state = generate(model, prompt, max_new_tokens, temperature=0)    # or model.generate(...)

A batch of prompts is prefilled in one packed call (``prefill(..., cu_seqlens=...)``), then decoded one
token per sequence per step with ``model.step`` (the compiled step when ``models.decode`` set one).
``models.sampling.Sampler`` draws the next token of each row (penalties, logit bias, temperature, min_p, top_k,
top_p); the server draws with it too, so a request's tokens equal a lone ``generate`` call's. Speculative
decoding (``models.speculative``) verifies drafted tokens against the distributions the same ``Sampler`` gives.
"""

from __future__ import annotations

import time

import torch

from subquad import kernels
from subquad.models.constrain import Grammar, check_format
from subquad.models.rows import cat_states, select_rows
from subquad.models.sampling import (  # noqa: F401
    GREEDY_BELOW,
    Sampler,
    SamplingOptions,
    check_sampling,
    probabilities,  # (re-exported)
    sample,
    sample_batch,
)
from subquad.models.speculative import (
    MAX_PAUSE,
    Pacer,
    SpeculationStats,
    accept_drafts,
    capture_hidden,
    check_speculative,
    drafter,
    drafting_plan,
    draw_in_order,
    pacer_for,
    verify,
)


def _fits_learned_positions(model, prompts, max_new_tokens: int, state, ahead: int = 0, who: str = "") -> None:
    """Learned positions end at ``context_length``: a generation that would pass it is refused before its
    first token (it failed part-way, its tokens lost). Each prompt and every new token but the last take a
    position, after the ones a state passed in holds; a draft model (``who`` names it) reads its drafts
    ``ahead`` of them too."""
    if getattr(model, "pos_embed", None) is None:
        return
    pos = 0 if state is None else getattr(state, "pos", 0)
    start = int(pos.max()) if isinstance(pos, torch.Tensor) else int(pos or 0)
    longest = max(len(p) for p in prompts)
    end = start + longest + max(max_new_tokens - 1, 0) + ahead
    ctx = model.config.context_length
    if end > ctx:
        room = ctx - start - longest + 1 - ahead
        raise ValueError(f"{who}learned positions end at context_length={ctx}; this generation would reach position "
                         f"{end} ({start} before, the longest prompt, max_new_tokens={max_new_tokens}"
                         + (f", {ahead} drafts ahead" if ahead else "") + "): "
                         + (f"ask for at most {room} new tokens" if room > 0 else "the prompt alone does not fit")
                         + (" or use a draft model without learned positions" if who else ""))


@torch.no_grad()
def generate(model, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, state=None, on_token=None, stop_ids=None, *,
             min_p: float | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, logit_bias: dict | None = None, ignore_eos: bool = False,
             speculative=None, draft_tokens: int = 4, response_format: dict | None = None, tokenizer=None):
    """Sample up to ``max_new_tokens`` after each prompt, decoding with the recurrent state.

    ``prompt``: one sequence (a list of ids, or a (T,) / (1, T) tensor) -> returns (new ids, state), or a
    batch (a list of id lists of any lengths, or a (B, T) tensor) -> returns (list of new id lists, state).
    A batch is prefilled in one packed call (``prefill(..., cu_seqlens=...)``: no padding, nothing
    crossing between prompts), then decoded together, one token per sequence per step, each from its
    own state (a ragged KV cache for softmax layers). A sequence finishes when it has emitted
    ``max_new_tokens`` or a token in ``stop_ids`` or the checkpoint's end-of-text ids
    (``config.eos_token_ids``; not with ``ignore_eos``) - emitted, then it stops; finished sequences are fed
    a pad token until all are done (their rows of the returned state are taken as they finished).
    ``temperature=0`` is greedy. The sampling options (``temperature``, ``top_k``, ``top_p``, ``min_p``, the
    penalties, ``logit_bias``: ``{token id: value}``) are
    ``models.sampling.SamplingOptions``, checked and applied there for every row; one generator seeded with
    ``seed`` draws for the whole batch. ``on_token(id)`` (one sequence) or ``on_token(i, id)`` (a batch)
    streams tokens as they come; returning exactly True (other values are ignored) ends that sequence there
    (the token emitted: ``subquad generate``'s stop strings, matched on the decoded text). Everything runs on
    the model's device.

    The returned state has consumed each prompt and every new token but the last:
    ``generate(model, [new[-1]], n, state=state)`` continues exactly where a one-sequence call stopped.

    ``speculative="ngram"``: speculative decoding (``models.speculative``) - up to ``draft_tokens`` tokens
    drafted per step by prompt lookup, verified in one forward; greedy output is plain greedy decoding's and
    sampled output is distributed as plain sampling's (one row: the tokens plain sampling draws with the same
    seed, ``draw_in_order``), with every sampling option: each verified position's
    distribution is processed with the history up to it (the drafts before it included), a stop id or the
    end of text inside an accepted run ends the row there. ``speculative=draft`` (a ``LanguageModel`` with
    the same vocabulary, on the same device): the draft model's greedy continuation is the draft, its own state
    kept in step (``models.speculative.ModelDrafter``); the same guarantees. ``model.speculation_stats`` holds
    the call's statistics (``tokens_per_step``, ``acceptance``).

    ``response_format`` (OpenAI's: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
    {"schema": ...}}``; needs ``tokenizer``, the model's ``tokenizers.Tokenizer``): each row's output is held to
    the grammar (``models.constrain``: tokens it does not allow get -inf before sampling) and the row ends when
    the grammar is complete; with ``speculative`` each verified position is held to the grammar as it stands
    after the drafts before it.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    options = SamplingOptions(temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty,
                              repetition_penalty, logit_bias, list(stop_ids or ()), ignore_eos)
    options.check_vocab(model.config.vocab_size)
    check_speculative(speculative, model)
    grammar = None
    if check_format(response_format) is not None:
        grammar = Grammar(response_format, tokenizer, model.config.vocab_size, model.config.eos_token_ids)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ValueError(f"draft_tokens must be an int >= 1, got {draft_tokens!r}")
    prompts, single = _as_prompts(prompt)
    _fits_learned_positions(model, prompts, max_new_tokens, state)
    if speculative is not None and not isinstance(speculative, str):     # a draft model reads every token too
        _fits_learned_positions(speculative, prompts, max_new_tokens, None, draft_tokens, "speculative: the draft "
                                "model's ")
    stop = options.ends(model.config.eos_token_ids)
    was_training = model.training
    model.eval()
    dev = model.embed.weight.device                 # prompt, tokens and sampler follow the model
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    B = len(prompts)
    matchers = None if grammar is None else [grammar.matcher() for _ in range(B)]
    sampler = Sampler(options, prompts, gen, matchers)
    given = state
    with capture_hidden(model, speculative == "mtp") as seen:      # the MTP head reads the prompts' hidden states
        last, state, cu = _prefill(model, prompts, state)
    out = [[] for _ in range(B)]
    done = [max_new_tokens == 0] * B
    if speculative is not None and not all(done):
        def emit(i, t) -> bool:                      # t already recorded: its grammar's end is known
            out[i].append(t)
            ended = on_token is not None and (on_token(t) if single else on_token(i, t)) is True
            return ended or len(out[i]) >= max_new_tokens or t in stop \
                or (matchers is not None and matchers[i].done)

        drafts_by = drafter(speculative, model, prompts, hidden=seen[-1] if seen else None, cu_seqlens=cu)
        early = set()
        try:
            state, model.speculation_stats = _speculate(model, last, state, max_new_tokens, sampler, emit,
                                                        draft_tokens, drafts_by, speculative, early)
        finally:
            getattr(drafts_by, "close", lambda: None)()
        if early:           # rows fed padding after they finished: their state again from what they consumed
            rows, rest = sorted(early), [i for i in range(B) if i not in early]
            again = _prefill(model, [prompts[i] + out[i][:-1] for i in rows],
                             None if given is None else select_rows(given, rows))[1]
            state = _assemble([(again, rows)] + ([(select_rows(state, rest), rest)] if rest else []))
        model.train(was_training)
        return (out[0] if single else out), state
    finished = {}                                   # row -> the state when it finished (before the others)
    with kernels.steady() as span:                  # the kept calls' checks once, not at every token
        while not all(done):
            nxt = sampler(last).tolist()
            feed = []
            for i in range(B):
                if done[i]:
                    feed.append(0)                  # padding after the end: its outputs are never read
                    continue
                out[i].append(nxt[i])
                ended = on_token is not None and (on_token(nxt[i]) if single else on_token(i, nxt[i])) is True
                done[i] = ended or len(out[i]) >= max_new_tokens or nxt[i] in stop \
                    or (matchers is not None and matchers[i].done)
                feed.append(nxt[i])
                if done[i] and B > 1:
                    finished[i] = state             # all it consumed: its prompt and every new token but this
            if all(done):
                break                               # the last tokens are not fed: continue from them
            if on_token is not None:
                span.renew()                        # the callback may have changed the model: check again
            last, state = model.step(torch.tensor(feed, device=dev), state)
    if any(finished[i] is not state for i in finished):     # rows that finished before the last step, then padded
        groups = {}                                 # the states rows finished at, each with its rows
        for i in range(B):
            groups.setdefault(id(finished.get(i, state)), (finished.get(i, state), []))[1].append(i)
        state = _assemble([(select_rows(st, rows), rows) for st, rows in groups.values()])
    model.train(was_training)
    return (out[0] if single else out), state


def _prefill(model, seqs: list[list[int]], state):
    """Each of ``seqs`` after its row of ``state`` (None: from nothing) -> (each one's last logits (B, vocab),
    the state after them, the cu_seqlens of the packed call, None for one length: an ordinary batch). Sequences
    of different lengths go in one packed call (no padding, nothing crossing between them)."""
    dev = model.embed.weight.device
    if len({len(q) for q in seqs}) == 1:
        last, state = model.prefill(torch.tensor(seqs, dtype=torch.long, device=dev), state, logits="last")
        return last, state, None
    lens = torch.tensor([len(q) for q in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(dev)
    packed = torch.tensor([t for q in seqs for t in q], dtype=torch.long, device=dev).view(1, -1)
    last, state = model.prefill(packed, state, cu_seqlens=cu, logits="last")
    return last, state, cu


def _assemble(parts: list):
    """(state, rows) pairs, each state holding its rows in that order and every row of the batch in one pair ->
    one state with the batch's rows in order."""
    order = [i for _, rows in parts for i in rows]
    whole = cat_states([st for st, _ in parts]) if len(parts) > 1 else parts[0][0]
    at = {i: n for n, i in enumerate(order)}
    return whole if order == sorted(order) else select_rows(whole, [at[i] for i in range(len(order))])


class _Never:
    """A drafter that proposes nothing (every step plain), wrapping one whose hooks still run."""

    def __init__(self, inner):
        self.inner, self.needs_hidden = inner, inner.needs_hidden

    def propose(self, feed, active, k):
        return [[] for _ in feed]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _speculate(model, last, state, max_new_tokens, sampler, emit, draft_tokens, drafts_by, speculative, early):
    """``generate``'s decoding loop with speculation (``models.speculative``), after the prefill: ``last`` (B,
    vocab) the prompts' last logits, ``sampler`` the plain loop's ``Sampler``, ``emit(i, token) -> done`` records
    row i's token, ``drafts_by`` the drafter made for ``speculative``. Each verified position is processed as the
    plain loop would process it (``Sampler.process_drafts``: penalties and logit bias with the drafts before it in
    the history), and the acceptance rule reads that position's ``Sampler.probabilities``; only emitted tokens
    join the history. Drafting pauses after a verification that kept nothing (but one row of prompt lookup,
    judged by its matches' lengths), and while verifying costs more wall time per emitted token than a plain step
    (``Pacer``: the model's, ``pacer_for``). Returns the state (every emitted token consumed but each row's last)
    and the ``SpeculationStats``; ``early`` (a set) gets the rows that finished while others went on (fed
    padding after: their rows of the state are not theirs)."""
    hooked = drafts_by.needs_hidden
    B, dev = last.shape[0], last.device
    if sampler.matchers is not None and hasattr(drafts_by, "matchers"):
        drafts_by.matchers = sampler.matchers           # a draft model drafts within each row's grammar
    fixed, budget = drafting_plan(model, B, draft_tokens, hooked)   # compiled: every verification padded to budget
    stats = SpeculationStats()
    t0 = sampler(last).tolist()
    done = [False] * B
    count = [0] * B
    for i in range(B):
        drafts_by.append(i, t0[i])
        count[i] += 1
        done[i] = emit(i, t0[i])
    if not all(done):
        early.update(i for i in range(B) if done[i])
    # drafting waits 1, 2, 4, ... steps after verifications that kept nothing - except one row of a drafter whose
    # drafts cost nothing (prompt lookup: ``keyed``): it drafts first and the pacer judges its drafts by their
    # key (the n of the match), each key by its own gain against the verification's measured cost (failed
    # 1-token matches do not hold back the 3-token ones, and a failure that costs little waits little)
    pause, wait = 0, 0
    keyed = getattr(drafts_by, "keyed", False) and B == 1
    # verify only while it pays against a plain step's time (the model's pacer: its judgements kept between calls)
    pacer = pacer_for(model, speculative, draft_tokens)
    moved = [None] * B                           # each row's tokens per verification, a moving average
    # Each row drafts up to its own room (rows that accept more finish sooner: the others go on verifying), the
    # verification padded past a row's end. Learned positions end at context_length: there a compiled
    # verification's k padded positions must fit in the row's room, and in a batch a row that finished early is
    # fed padding at every later step, up to max_new_tokens more positions - so a batch that could walk past the
    # end that way decodes without speculation.
    limit = model.config.context_length if getattr(model, "pos_embed", None) is not None else None
    if limit is not None and B > 1 and int(torch.as_tensor(getattr(state, "pos", 0)).max()) + 2 * max_new_tokens \
            + draft_tokens > limit:
        drafts_by = _Never(drafts_by)
    while not all(done):
        started = pacer.start()
        active = [i for i in range(B) if not done[i]]
        rooms = [max_new_tokens - count[i] if not done[i] else 0 for i in range(B)]   # tokens row i may emit
        room = max(rooms)
        feed = [t0[i] if not done[i] else 0 for i in range(B)]              # finished rows: padding
        drafts, key = [[] for _ in range(B)], None
        may = room > (budget if fixed and limit is not None else 1)
        if may and keyed:
            drafted = [d[:max(rooms[i] - 1, 0)] for i, d in enumerate(drafts_by.propose(feed, active,
                                                                                        min(budget, room - 1)))]
            key = drafts_by.key(0)
            if pacer.verifies(bool(drafted[0]), key):
                drafts = drafted
        elif may and wait == 0 and pacer.want():
            drafts = drafts_by.propose(feed, active, min(budget, room - 1))
            drafts = [d[:max(rooms[i] - 1, 0)] for i, d in enumerate(drafts)]
        else:
            wait = max(0, wait - 1)
        k = max(len(d) for d in drafts)
        if k and fixed:                         # a compiled verification: one graph, for k = budget
            k = budget
        stats.steps += 1
        stats.row_steps += len(active)
        if k == 0:                                                         # nothing drafted: a plain step
            with capture_hidden(model, hooked) as seen:                    # (the eager step: hooks fire)
                if hooked:
                    logits, state = model.prefill(torch.tensor(feed, device=dev)[:, None], state, logits="last")
                else:
                    logits, state = model.step(torch.tensor(feed, device=dev), state)
            drafts_by.settle(feed, None, 1, seen[-1] if seen else None)
            tokens = sampler(logits).view(B, 1)                           # counted for the penalties
            keeps = [1] * B
        else:
            rows = [[feed[i]] + d + [d[-1] if d else feed[i]] * (k - len(d)) for i, d in enumerate(drafts)]
            ids = torch.tensor(rows, device=dev)                           # (B, k + 1); any padding is a valid draft
            with capture_hidden(model, hooked) as seen:
                logits, ver = verify(model, ids, state, how="replay" if hooked else None)
            x = sampler.process_drafts(logits, ids[:, 1:])                 # (B, k + 1, vocab)
            probs = sampler.probabilities(x)
            if probs is not None and B == 1:            # one row: the draws plain sampling makes, in order
                tokens, accepted = draw_in_order(ids[:, 1:], probs, sampler.generator)
            else:
                tokens, accepted = accept_drafts(x, ids[:, 1:], probs, sampler.generator)
            stats.verifications += 1
            keeps = [n + 1 for n in accepted.tolist()]                     # row i emits keeps[i] tokens
        tokens, was_active, kept = tokens.tolist(), set(active), []
        for i in range(B):
            if i not in was_active:
                keeps[i] = 1                                               # finished before: fed padding
                continue
            for n, t in enumerate(tokens[i][:keeps[i]]):                   # a row that finishes sooner stops there
                drafts_by.append(i, t)
                count[i] += 1
                if k and sampler.matchers is not None:                      # recorded now: the grammar ends it
                    sampler.record(torch.tensor([t], device=dev), torch.tensor([i], device=dev))
                done[i] = emit(i, t)
                kept.append((i, t))
                if done[i]:
                    keeps[i] = n + 1
                    break
            stats.emitted += keeps[i]
            if k:
                stats.drafted += len(drafts[i])
                stats.accepted += min(keeps[i] - 1, len(drafts[i]))
        if not all(done):
            early.update(i for i in active if done[i])
        # the pacer's gain: the batch ends with its slowest row, and a row that finished first only pads the
        # steps after it - so the least of the rows' average tokens per verification; the least of one
        # verification's would be too low (rows that take turns at accepting all move faster). One row: its own
        # tokens (the pacer averages them, and judges the last verification by itself too).
        if k:
            for i in active:
                moved[i] = keeps[i] if moved[i] is None else (1 - Pacer.ALPHA) * moved[i] + Pacer.ALPHA * keeps[i]
        gain = None if not k else keeps[active[0]] if len(active) == 1 else min(moved[i] for i in active)
        if k and kept and sampler.matchers is None:  # the emitted tokens join the history (a plain step's did)
            row, tok = torch.tensor(kept, device=dev).T
            sampler.record(tok, row)
        if k:
            live = {keeps[i] for i in range(B) if not done[i]}
            if len(live) == 1:                  # a finished row's state is never read: keep the others' length
                keeps = [live.pop()] * B
            drafts_by.settle(feed, drafts, keeps if B > 1 else keeps[0], seen[-1] if seen else None)
            state = ver.accept(keeps if B > 1 else keeps[0])
            if not keyed and max(keeps[i] for i in active) == 1:          # nothing accepted: draft less often
                pause = min(2 * pause or 1, MAX_PAUSE)
                wait = pause
            else:
                pause = 0
        pacer.measured(time.perf_counter() - started, gain, B, key)
        t0 = [tokens[i][keeps[i] - 1] if not done[i] else 0 for i in range(B)]
    return state, stats


def _as_prompts(prompt) -> tuple[list[list[int]], bool]:
    """(list of id lists, whether it was one sequence); ValueError for anything else or an empty prompt."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 1 or (prompt.dim() == 2 and prompt.shape[0] == 1):
            prompts, single = [prompt.reshape(-1).tolist()], True
        elif prompt.dim() == 2:
            prompts, single = prompt.tolist(), False
        else:
            raise ValueError(f"prompt must be (T,) or (B, T) token ids, got shape {tuple(prompt.shape)}")
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, (list, tuple)) for p in prompt):
        prompts, single = [list(p) for p in prompt], False
    elif isinstance(prompt, (list, tuple)):
        prompts, single = [list(prompt)], True
    else:
        raise ValueError(f"prompt must be token ids (a list, a list of lists or a tensor), got {type(prompt).__name__}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must hold at least one token")
    if not all(isinstance(t, int) and not isinstance(t, bool) for p in prompts for t in p):
        raise ValueError("prompt must hold integer token ids")
    return prompts, single
