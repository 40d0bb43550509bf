"""Sampling from a language model, decoding with its recurrent state.

    new_ids, state = generate(model, prompt, max_new_tokens, temperature=0)    # or model.generate(...)

A batch of prompts is prefilled in one packed call (``prefill(..., cu_seqlens=...)``), then decoded one
token per sequence per step with ``model.step`` (the compiled step when ``models.decode`` set one).
``models.sampling.Sampler`` draws the next token of each row (penalties, logit bias, temperature, min_p, top_k,
top_p); the server draws with it too, so a request's tokens equal a lone ``generate`` call's.
"""

from __future__ import annotations

import torch

from subquad.models.sampling import (GREEDY_BELOW, Sampler, SamplingOptions, check_sampling,  # noqa: F401
                                     sample, sample_batch)                                  # (re-exported)


@torch.no_grad()
def generate(model, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, state=None, on_token=None, stop_ids=None, *,
             min_p: float | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, logit_bias: dict | None = None, ignore_eos: bool = False):
    """Sample up to ``max_new_tokens`` after each prompt, decoding with the recurrent state.

    ``prompt``: one sequence (a list of ids, or a (T,) / (1, T) tensor) -> returns (new ids, state), or a
    batch (a list of id lists of any lengths, or a (B, T) tensor) -> returns (list of new id lists, state).
    A batch is prefilled in one packed call (``prefill(..., cu_seqlens=...)``: no padding, nothing
    crossing between prompts), then decoded together, one token per sequence per step, each from its
    own state (a ragged KV cache for softmax layers). A sequence finishes when it has emitted
    ``max_new_tokens`` or a token in ``stop_ids`` or the checkpoint's end-of-text ids
    (``config.eos_token_ids``; not with ``ignore_eos``) - emitted, then it stops; finished sequences are fed
    a pad token until all are done. ``temperature=0`` is greedy. The sampling options (``temperature``,
    ``top_k``, ``top_p``, ``min_p``, the penalties, ``logit_bias``: ``{token id: value}``) are
    ``models.sampling.SamplingOptions``, checked and applied there for every row; one generator seeded with
    ``seed`` draws for the whole batch. ``on_token(id)`` (one sequence) or
    ``on_token(i, id)`` (a batch) streams tokens as they come. Everything runs on the model's device.

    The returned state has consumed each prompt and every new token but the last:
    ``generate(model, [new[-1]], n, state=state)`` continues exactly where a one-sequence call stopped.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    options = SamplingOptions(temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty,
                              repetition_penalty, logit_bias, list(stop_ids or ()), ignore_eos)
    options.check_vocab(model.config.vocab_size)
    prompts, single = _as_prompts(prompt)
    stop = options.ends(model.config.eos_token_ids)
    was_training = model.training
    model.eval()
    dev = model.embed.weight.device                 # prompt, tokens and sampler follow the model
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    sampler = Sampler(options, prompts, gen)
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
    while not all(done):
        nxt = sampler(last).tolist()
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
