"""The prefix cache as a radix tree: attention's keys and values held once along a path and assembled exactly,
bytes counted from the tensors, eviction that keeps what a deeper checkpoint needs; and the engine's prefix
checkpoints (every block, each chat message's end) never returning a wrong state - 500 random conversations
that share, fork and diverge mid-block, each answer equal to ``generate`` run alone."""

import random

import pytest
import torch

from subquad.models import LanguageModel, ModelConfig
from subquad.ops import KVCache
from subquad.serve import Engine, SamplingParams
from subquad.serve.prefix_cache import PrefixCache
from tests.serve.helpers import V, config


def model_of(kind):
    torch.manual_seed(0)
    if kind == "small hybrid":        # Mamba-2 then attention (GQA, partial rotary), no MLP: cheap forwards
        return LanguageModel(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                         pattern="mamba2,softmax", mlp=False, tie_embeddings=False,
                                         mixer_options={"softmax": {"rotary_fraction": 0.5},
                                                        "mamba2": {"norm_eps": 1e-6}})).eval()
    return LanguageModel(config(kind)).eval()


def _prefilled(model, tokens):
    with torch.no_grad():
        return model.prefill(torch.tensor([tokens]))[1]


def _assert_same_state(got, want):
    assert got.pos == want.pos and len(got) == len(want)
    for a, b in zip(got, want):
        assert list(a) == list(b)
        for key in a:
            x, y = a[key], b[key]
            if isinstance(y, KVCache):
                assert isinstance(x, KVCache) and x.seen == y.seen and x.window == y.window
                torch.testing.assert_close(x.k, y.k, rtol=0, atol=1e-6)
                torch.testing.assert_close(x.v, y.v, rtol=0, atol=1e-6)
            else:
                torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_the_tree_holds_each_tokens_kv_once_and_assembles_each_checkpoint_exactly():
    model = model_of("bamba")                         # Mamba-2, attention, Mamba-2
    cfg = model.config
    # independently: a Mamba-2 layer's state is its empty state's size; attention keeps K and V per token
    fixed = sum(t.nelement() * t.element_size() for i, layer in enumerate(model.empty_state(1))
                if cfg.layers[i] != "softmax" for t in layer.values())
    per_token = 2 * cfg.n_kv_heads * (cfg.d_model // cfg.n_heads) * 4
    rng = random.Random(0)
    a = [rng.randrange(V) for _ in range(30)]
    b = a[:13] + [(a[13] + 1) % V] + [rng.randrange(V) for _ in range(9)]   # forks a mid-edge, at token 13
    keys = [a[:8], a[:30], b[:23], a[:20], a[:5]]                          # splits above, inside and below
    states = {tuple(k): _prefilled(model, k) for k in keys}
    cache = PrefixCache(1 << 30)
    for k in keys:
        assert cache.insert(k, states[tuple(k)])
    distinct = {tuple(k[:n]) for k in keys for n in range(1, len(k) + 1)}     # every prefix held once
    assert cache.nbytes == len(keys) * fixed + len(distinct) * per_token == sum(
        t.nelement() * t.element_size() for t in cache.tensors())
    for k in keys:
        n, state = cache.lookup(k + [1, 2])
        assert n == len(k)
        _assert_same_state(state, states[tuple(k)])
    assert cache.lookup(b[:22])[0] == 8               # b's own checkpoint is at 23; it shares 13 tokens with a
    assert cache.lookup(a[:29], max_len=19)[0] == 8 and cache.lookup([(a[0] + 1) % V])[1] is None
    # least recently used first: a[:30]; its tokens 20..29 go with it, a[:20] below keeps its own
    gone = tuple(a)
    assert cache.checkpoints()[0] == gone
    cache.evict(cache.nbytes - 1)
    assert tuple(gone) not in [tuple(k) for k in cache.checkpoints()] and len(cache) == len(keys) - 1
    left = {tuple(k[:n]) for k in keys if tuple(k) != gone for n in range(1, len(k) + 1)}
    assert cache.nbytes == (len(keys) - 1) * fixed + len(left) * per_token
    assert cache.evict(0) and cache.nbytes == 0 and cache.tensors() == [] and len(cache) == 0


def _events(seq):
    out = []
    while not seq.events.empty():
        out.append(seq.events.get_nowait())
    return [ev for ev in out if ev.token is not None]


def _lcp(x, y) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def test_500_random_conversations_equal_generate_alone_and_resume_from_their_deepest_shared_block():
    """Conversations that fork a served prompt at any token (mid-block), continue a served turn, or start
    afresh, with random chat-message ends, 20 per wave: each answer equals ``generate`` alone (and each token's
    log-probability a forward over the whole text's, to 2e-5), and each resumes
    at least ``M - M % block`` tokens in, M the tokens it shares with a prompt served before its wave (at most
    its length - 1), or at a finished turn it continues, or at a message end it shares (one its request
    prefilled through, not skipped by resuming past it)."""
    model = model_of("small hybrid")
    block = 8
    engine = Engine(model, max_batch=16, prefill_chunk=24, state_cache_mb=256, prefix_block=block)
    with pytest.raises(ValueError, match="boundaries"):
        engine.submit([1, 2, 3], boundaries=[3])              # a message end is inside the prompt
    rng = random.Random(0)
    served = []                       # (prompt, message ends it prefilled through, answer) of earlier waves
    total = 0
    while total < 500:
        wave = []
        for _ in range(20):
            r = rng.random()
            if served and r < 0.3:                        # the next turn of a served conversation
                p, _, ans = rng.choice(served)
                prompt = p + ans + [rng.randrange(V) for _ in range(rng.randint(1, 6))]
            elif served and r < 0.85:                     # a fork: shares a prefix, diverges anywhere
                p = rng.choice(served)[0]
                prompt = p[:rng.randint(1, len(p))] + [rng.randrange(V) for _ in range(rng.randint(1, 12))]
            else:
                prompt = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
            prompt = prompt[:48]
            ends = sorted(rng.sample(range(1, len(prompt)), min(len(prompt) - 1, rng.randint(0, 2))))
            wave.append((prompt, ends, SamplingParams(max_tokens=rng.randint(1, 3), temperature=0, logprobs=0)))
        seqs = [engine.submit(p, sp, boundaries=ends) for p, ends, sp in wave]
        while engine.step():
            pass
        for (p, ends, sp), seq in zip(wave, seqs):
            assert seq.tokens == model.generate(p, sp.max_tokens, temperature=0)[0], (total, p)
            # the tokens' log-probabilities against one forward over the whole text: a state off by far less
            # than it takes to change a greedy token shows here
            got = [ev.logprob for ev in _events(seq)]
            with torch.no_grad():
                logits = model.prefill(torch.tensor([p + seq.tokens[:-1]]))[0][0, len(p) - 1:].double()
            want = logits.log_softmax(-1)[torch.arange(len(seq.tokens)), seq.tokens]
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=2e-5)
            m = len(p) - 1
            want = 0
            for q, q_ends, ans in served:
                n = min(_lcp(p, q), m)
                want = max(want, n - n % block, *[e for e in q_ends if e <= n])
                final = q + ans[:-1]
                if len(final) <= m and p[:len(final)] == final:
                    want = max(want, len(final))
            assert seq.cached_tokens >= want, (total, p, seq.cached_tokens, want)
        served += [(p, [e for e in ends if e > seq.cached_tokens], seq.tokens) for (p, ends, _), seq in zip(wave, seqs)]
        total += len(wave)
    assert engine.cache.nbytes < engine.cache.max_bytes // 2          # nothing was evicted
    assert engine.cache.hits > 300
