"""Sampling from a language model, decoding with its recurrent state.

    new_ids, state = generate(model, prompt, max_new_tokens, temperature=0)    # or model.generate(...)

A batch of prompts is prefilled in one packed call (``prefill(..., cu_seqlens=...)``), then decoded one
token per sequence per step with ``model.step`` (the compiled step when ``models.decode`` set one).
``sample_batch`` draws the next token of each row; the server draws with it too, so a request's tokens
equal a lone ``generate`` call's.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from subquad.models.speculative import (MAX_NGRAM, MAX_PAUSE, SPECULATIVE, PromptLookup, SpeculationStats,
                                        accept_drafts, verify)

GREEDY_BELOW = 1e-5    # a temperature under this is greedy (vLLM's _SAMPLING_EPS): logits / T would overflow


@torch.no_grad()
def generate(model, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, state=None, on_token=None, stop_ids=None,
             speculative: str | None = None, draft_tokens: int = 4):
    """Sample up to ``max_new_tokens`` after each prompt, decoding with the recurrent state.

    ``prompt``: one sequence (a list of ids, or a (T,) / (1, T) tensor) -> returns (new ids, state), or a
    batch (a list of id lists of any lengths, or a (B, T) tensor) -> returns (list of new id lists, state).
    A batch is prefilled in one packed call (``prefill(..., cu_seqlens=...)``: no padding, nothing
    crossing between prompts), then decoded together, one token per sequence per step, each from its
    own state (a ragged KV cache for softmax layers). A sequence finishes when it has emitted
    ``max_new_tokens`` or a token in ``stop_ids`` or the checkpoint's end-of-text ids
    (``config.eos_token_ids``) - emitted, then it stops; finished sequences are fed
    a pad token until all are done. ``temperature=0`` is greedy. ``on_token(id)`` (one sequence) or
    ``on_token(i, id)`` (a batch) streams tokens as they come. Everything runs on the model's device.

    The returned state has consumed each prompt and every new token but the last:
    ``generate(model, [new[-1]], n, state=state)`` continues exactly where a one-sequence call stopped.

    ``speculative="ngram"``: speculative decoding (``models.speculative``) - up to ``draft_tokens`` tokens
    drafted per step by prompt lookup, verified in one forward; greedy output is plain greedy decoding's and
    sampled output is distributed as plain sampling's. ``model.speculation_stats`` holds the call's
    statistics (``tokens_per_step``, ``acceptance``).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if speculative is not None and speculative not in SPECULATIVE:
        raise ValueError(f"speculative must be None or one of {SPECULATIVE}, got {speculative!r}")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ValueError(f"draft_tokens must be an int >= 1, got {draft_tokens!r}")
    temperature = check_sampling(temperature, top_k, top_p)
    prompts, single = _as_prompts(prompt)
    stop = set(int(t) for t in (stop_ids or ())) | set(model.config.eos_token_ids)
    was_training = model.training
    model.eval()
    dev = model.embed.weight.device                 # prompt, tokens and sampler follow the model
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    B = len(prompts)
    if len({len(p) for p in prompts}) == 1:         # one length: an ordinary batch
        last, state = model.prefill(torch.tensor(prompts, dtype=torch.long, device=dev), state, logits="last")
    else:
        lens = torch.tensor([len(p) for p in prompts])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(dev)
        packed = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev).view(1, -1)
        last, state = model.prefill(packed, state, cu_seqlens=cu, logits="last")   # each prompt's last: (B, vocab)
    out = [[] for _ in range(B)]
    done = [max_new_tokens == 0] * B
    if speculative is not None and not all(done):
        def emit(i, t) -> bool:
            out[i].append(t)
            if on_token is not None:
                on_token(t) if single else on_token(i, t)
            return len(out[i]) >= max_new_tokens or t in stop

        state, model.speculation_stats = _decode_speculative(model, last, state, prompts, max_new_tokens,
                                                             temperature, top_k, top_p, gen, emit, draft_tokens)
        model.train(was_training)
        return (out[0] if single else out), state
    while not all(done):
        nxt = sample_batch(last, temperature, top_k, top_p, gen).tolist()
        feed = []
        for i in range(B):
            if done[i]:
                feed.append(0)                      # padding after the end: its outputs are never read
                continue
            out[i].append(nxt[i])
            if on_token is not None:
                on_token(nxt[i]) if single else on_token(i, nxt[i])
            done[i] = len(out[i]) >= max_new_tokens or nxt[i] in stop
            feed.append(nxt[i])
        if all(done):
            break                                   # the last tokens are not fed: continue from them
        last, state = model.step(torch.tensor(feed, device=dev), state)
    model.train(was_training)
    return (out[0] if single else out), state


def _decode_speculative(model, last, state, prompts, max_new_tokens, temperature, top_k, top_p, gen, emit,
                        draft_tokens, max_ngram=MAX_NGRAM):
    """``generate``'s decoding loop with prompt-lookup speculation (``models.speculative``), after the prefill:
    ``last`` (B, vocab) the prompts' last logits, ``emit(i, token) -> done`` records row i's token. Returns the
    state (every emitted token consumed but each row's last) and the ``SpeculationStats``."""
    B, dev = len(prompts), last.device
    hist = [PromptLookup(p, max_ngram) for p in prompts]               # each row's prompt and output, indexed
    stats = SpeculationStats()
    t0 = sample_batch(last, temperature, top_k, top_p, gen).tolist()
    done = [False] * B
    count = [0] * B
    for i in range(B):
        hist[i].append(t0[i])
        count[i] += 1
        done[i] = emit(i, t0[i])
    pause, wait = 0, 0
    while not all(done):
        active = [i for i in range(B) if not done[i]]
        room = min(max_new_tokens - count[i] for i in active)             # every active row may emit this many
        drafts = [[] for _ in range(B)]
        if wait == 0 and room > 1:
            for i in active:
                drafts[i] = hist[i].draft(min(draft_tokens, room - 1))
        else:
            wait = max(0, wait - 1)
        k = max(len(d) for d in drafts)
        feed = [t0[i] if not done[i] else 0 for i in range(B)]              # finished rows: padding
        stats.steps += 1
        stats.row_steps += len(active)
        if k == 0:                                                         # nothing drafted: a plain step
            logits, state = model.step(torch.tensor(feed, device=dev), state)
            tokens = sample_batch(logits, temperature, top_k, top_p, gen).view(B, 1)
            keeps = [1] * B
        else:
            rows = [[feed[i]] + d + [d[-1] if d else feed[i]] * (k - len(d)) for i, d in enumerate(drafts)]
            ids = torch.tensor(rows, device=dev)                           # (B, k + 1); any padding is a valid draft
            logits, ver = verify(model, ids, state)
            if temperature == 0:
                tokens, accepted = accept_drafts(logits, ids[:, 1:])
                _refuse_nan(logits.gather(-1, tokens.unsqueeze(-1)))
            else:
                probs = probabilities(logits.flatten(0, 1), temperature, top_k, top_p).view(logits.shape)
                tokens, accepted = accept_drafts(logits, ids[:, 1:], probs, gen)
            stats.verifications += 1
            keeps = [n + 1 for n in accepted.tolist()]                     # row i emits keeps[i] tokens
        tokens, was_active = tokens.tolist(), set(active)
        for i in range(B):
            if i not in was_active:
                keeps[i] = 1                                               # finished before: fed padding
                continue
            for n, t in enumerate(tokens[i][:keeps[i]]):                   # a row that finishes sooner stops there
                hist[i].append(t)
                count[i] += 1
                done[i] = emit(i, t)
                if done[i]:
                    keeps[i] = n + 1
                    break
            stats.emitted += keeps[i]
            if k:
                stats.drafted += len(drafts[i])
                stats.accepted += min(keeps[i] - 1, len(drafts[i]))
        if k:
            live = {keeps[i] for i in range(B) if not done[i]}
            if len(live) == 1:                  # a finished row's state is never read: keep the others' length
                keeps = [live.pop()] * B
            state = ver.accept(keeps if B > 1 else keeps[0])
            if max(keeps[i] for i in active) == 1:                         # nothing accepted: draft less often
                pause = min(2 * pause or 1, MAX_PAUSE)
                wait = pause
            else:
                pause = 0
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


def check_sampling(temperature, top_k=None, top_p=None) -> float:
    """The temperature to sample at, after checking all three (ValueError naming the argument). One check for
    ``generate`` and the server's ``SamplingParams``. A finite temperature below ``GREEDY_BELOW`` becomes 0,
    greedy: float32 logits divided by 1e-300 are inf and their softmax NaN, and below 1e-5 the distribution
    is the argmax anyway unless two logits tie within ~1e-4."""
    if isinstance(temperature, bool) or not isinstance(temperature, Real) \
            or not 0 <= temperature < math.inf:          # NaN fails both comparisons
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, Real) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    return 0.0 if temperature < GREEDY_BELOW else float(temperature)


def sample_batch(logits, temperature=1.0, top_k=None, top_p=None, generator=None) -> torch.Tensor:
    """One token id per row of (B, vocab) logits: greedy at temperature 0 (or below ``GREEDY_BELOW``), else
    softmax(logits / T) restricted to the k largest logits (ties at the k-th included) and to the nucleus of
    mass top_p (the smallest set of most likely tokens whose mass reaches top_p). NaN logits (or +inf, or a
    row all -inf) are a ValueError: argmax would pick an arbitrary id and multinomial draw garbage."""
    temperature = check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        ids = logits.argmax(-1)                     # argmax picks a row's NaN: checking the B picks checks the rows
        _refuse_nan(logits.gather(-1, ids.unsqueeze(-1)))
        return ids
    probs = probabilities(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def probabilities(logits, temperature, top_k=None, top_p=None) -> torch.Tensor:
    """The distribution ``sample_batch`` draws from at a temperature > 0: (B, vocab) logits -> (B, vocab)
    probabilities (unnormalised after top_p; ``torch.multinomial`` normalises). Speculative decoding's acceptance
    rule (``models.speculative``) reads the same one."""
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p is not None and top_p < 1:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p                   # mass before each token is below top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    _refuse_nan(probs)                                      # NaN logits give NaN probabilities
    return probs


def _refuse_nan(x: torch.Tensor):
    """ValueError if ``x`` (logits or probabilities) holds NaN: the model's output is not a number."""
    if torch.isnan(x).any():
        raise ValueError("logits: the model's output holds NaN (weights with NaN, or an overflow in low "
                         "precision?); there is no distribution to sample from")


def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None) -> int:
    """One token id from a (vocab,) logit vector (``sample_batch`` on one row)."""
    return int(sample_batch(logits.unsqueeze(0), temperature, top_k, top_p, generator)[0])
