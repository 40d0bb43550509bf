"""The engine without HTTP: every request's tokens equal ``generate`` run alone (greedy and seeded sampling)
under continuous batching and chunked prefill; prefix states resume exactly and prefill only the rest; the
cache counts bytes exactly; cancel, drain, the queue bound and the memory budget hold."""

import random

import pytest
import torch

from subquad.models import LanguageModel
from subquad.serve import Engine, NotAccepting, QueueFull, SamplingParams
from subquad.serve.prefix_cache import PrefixCache, compact, exact_bytes
from tests.serve.helpers import V, config, folder, load


def model_of(kind):
    torch.manual_seed(0)
    return LanguageModel(config(kind)).eval()


def requests(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(V) for _ in range(rng.choice([1, 2, 9, 23, 41]))]
        greedy = rng.random() < 0.5
        out.append((prompt, SamplingParams(max_tokens=rng.choice([1, 4, 11]), temperature=0 if greedy else 0.9,
                                           seed=1000 + i, top_k=rng.choice([None, 20]),
                                           top_p=rng.choice([None, 0.8]))))
    return out


def alone(model, prompt, p):
    return model.generate(prompt, p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          seed=p.seed)[0]


def run_all(engine, reqs, per_step=3):
    """Submit ``per_step`` requests between steps (they join a batch already decoding), then run to the end."""
    seqs = []
    for i, (prompt, p) in enumerate(reqs):
        seqs.append(engine.submit(prompt, p))
        if i % per_step == per_step - 1:
            engine.step()
    while engine.step():
        pass
    return seqs


@pytest.mark.parametrize("kind", ["mamba2", "bamba"])
def test_every_stream_equals_generate_alone(kind):
    model = model_of(kind)
    reqs = requests(18)
    engine = Engine(model, max_batch=5, prefill_chunk=16, state_cache_mb=0)   # joins, leaves, chunked prefill
    seqs = run_all(engine, reqs)
    for (prompt, p), seq in zip(reqs, seqs):
        assert seq.tokens == alone(model, prompt, p), (prompt, p)
        assert seq.finish_reason == "length" and len(seq.tokens) == p.max_tokens
    assert engine.counters["prefill_tokens"] == sum(len(p) for p, _ in reqs)
    assert engine.active == 0 and engine.batch_state is None


def test_the_compiled_step_serves_the_same_streams():
    """The engine through ``compile_decode``'s graph (batches that grow and shrink, a ragged KV cache): every
    stream's tokens still equal the eager model's ``generate`` alone."""
    from subquad.models.decode import compile_decode

    eager = model_of("bamba")
    fast = compile_decode(model_of("bamba"))
    reqs = requests(10, seed=1)
    seqs = run_all(Engine(fast, max_batch=4, prefill_chunk=16, state_cache_mb=0), reqs)
    for (prompt, p), seq in zip(reqs, seqs):
        assert seq.tokens == alone(eager, prompt, p), (prompt, p)


@pytest.mark.parametrize("kind", ["mamba2", "bamba"])
def test_a_cached_prefix_resumes_exactly_and_prefills_only_the_rest(kind):
    model = model_of(kind)
    rng = random.Random(1)
    first = [rng.randrange(V) for _ in range(30)]
    greedy = SamplingParams(max_tokens=6, temperature=0)
    engine = Engine(model, state_cache_mb=64)
    a = run_all(engine, [(first, greedy)])[0]
    second = first + a.tokens + [rng.randrange(V) for _ in range(5)]   # turn 2: history, answer, new message
    before = engine.counters["prefill_tokens"]
    b = run_all(engine, [(second, greedy)])[0]
    # the finished turn's state has consumed the prompt and every answer token but the last
    assert b.cached_tokens == len(first) + len(a.tokens) - 1
    assert engine.counters["prefill_tokens"] - before == len(second) - b.cached_tokens == 6
    assert b.tokens == alone(model, second, greedy)
    cold = Engine(model, state_cache_mb=0)
    assert run_all(cold, [(second, greedy)])[0].tokens == b.tokens
    assert cold.counters["prefill_tokens"] == len(second)


def test_prefix_cache_counts_bytes_exactly_and_evicts_least_recently_used():
    model = model_of("bamba")
    cfg = model.config
    with torch.no_grad():
        states = {T: model.prefill(torch.zeros(1, T, dtype=torch.long))[1] for T in (3, 20, 40)}
    # independently: a Mamba-2 layer's state is its empty state's size; attention keeps K and V per token
    fixed = sum(t.nelement() * t.element_size() for i, layer in enumerate(model.empty_state(1))
                if cfg.layers[i] != "softmax" for t in layer.values())
    per_token = 2 * cfg.n_kv_heads * (cfg.d_model // cfg.n_heads) * 4
    size = {T: fixed + T * per_token for T in states}
    for T, s in states.items():
        assert exact_bytes(compact(s)) == size[T]
    engine = Engine(model)
    assert engine.row_bytes(20) == size[20]

    cache = PrefixCache(size[3] + size[20] + size[40] - 1)   # not room for all three
    assert cache.insert(range(3), states[3]) and cache.insert(range(20), states[20])
    assert cache.nbytes == size[3] + size[20]
    assert cache.lookup(list(range(25)))[0] == 20            # the longest prefix; 3-token entry now least recent
    assert cache.lookup(list(range(3)) + [99])[0] == 3       # ... and now the 20-token entry is
    assert cache.insert(range(40), states[40])
    assert cache.nbytes == size[3] + size[40] and len(cache) == 2
    assert cache.lookup(list(range(25)), max_len=24)[0] == 3  # the 20-token entry was evicted
    assert not PrefixCache(size[40] - 1).insert(range(40), states[40])   # larger than the whole cache
    assert cache.lookup([5, 6])[1] is None


def test_cancel_frees_the_row_and_leaves_the_others_exact():
    model = model_of("bamba")
    reqs = [([1, 2, 3, 4, 5], SamplingParams(max_tokens=12, temperature=0)),
            ([7] * 9, SamplingParams(max_tokens=12, temperature=0.8, seed=5)),
            ([9, 8], SamplingParams(max_tokens=12, temperature=0))]
    engine = Engine(model, state_cache_mb=0)
    seqs = [engine.submit(p, s) for p, s in reqs]
    for _ in range(3):
        engine.step()
    engine.cancel(seqs[1])
    engine.step()
    assert len(engine.running) == 2 and engine.batch_state[1]["kv"].k.shape[0] == 2
    events = list(engine.stream(seqs[1], timeout=1))
    assert events[-1].finish_reason == "abort" and events[-1].token is None
    while engine.step():
        pass
    for i in (0, 2):
        assert seqs[i].tokens == alone(model, *reqs[i])


def test_stop_strings_across_tokens_and_end_of_text(tmp_path):
    model, tok = load(folder(tmp_path / "m", "bamba"))
    prompt = [11, 40, 12, 9, 30]
    free = alone(model, prompt, SamplingParams(max_tokens=10, temperature=0))
    text = tok.decode(free)
    k = len(tok.decode(free[:3]))                          # the boundary after the third token
    stop = text[k - 1:k + 3]                              # spans it: the last char of one word, then more
    engine = Engine(model, tok, state_cache_mb=0)
    seq = engine.submit(prompt, SamplingParams(max_tokens=10, temperature=0, stop=["zzz", stop]))
    while engine.step():
        pass
    got = "".join(e.text for e in _events(seq))
    assert got == text[:text.index(stop)] and seq.finish_reason == "stop"

    i = next(i for i in range(2, 10) if free[i] not in free[:i])    # a token not emitted before
    model.config.eos_token_ids = [free[i]]
    engine = Engine(model, tok, state_cache_mb=0)
    seq = engine.submit(prompt, SamplingParams(max_tokens=10, temperature=0))
    while engine.step():
        pass
    assert seq.tokens == free[:i + 1] and seq.finish_reason == "stop"
    assert model.generate(prompt, 10, temperature=0)[0] == free[:i + 1]     # generate stops there too


def _events(seq):
    out = []
    while not seq.events.empty():
        out.append(seq.events.get())
    return out


def test_admission_stops_at_the_memory_budget():
    model = model_of("bamba")
    probe = Engine(model)
    p = SamplingParams(max_tokens=10, temperature=0)
    two_rows = probe._reserve([20, 20])                   # two rows of 10 + 10 tokens, batched
    engine = Engine(model, memory_mb=(two_rows + 1) / 2 ** 20, state_cache_mb=0)
    seqs = [engine.submit([3] * 10, p) for _ in range(4)]
    engine.step()
    assert engine.active == 2 and len(engine.waiting) == 2
    while engine.step():
        pass
    assert all(s.tokens == alone(model, [3] * 10, p) for s in seqs)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit([3] * 10, SamplingParams(max_tokens=4000))


def test_queue_bound_drain_and_bad_requests():
    model = model_of("mamba2")
    engine = Engine(model, max_batch=1, max_queue=1, max_context=64)
    p = SamplingParams(max_tokens=50, temperature=0)
    a, b = engine.submit([1], p), engine.submit([2], p)  # one for the free slot, one waiting
    with pytest.raises(QueueFull):
        engine.submit([3], p)
    for bad, match in (([], "prompt"), ([V], "prompt"), ([1] * 65, "prompt"), ([1] * 20, "max_tokens")):
        with pytest.raises(ValueError, match=match):
            engine.submit(bad, p)
    with pytest.raises(ValueError, match="stop"):
        engine.submit([1], SamplingParams(stop=["x"]))   # no tokenizer
    engine.step()
    engine.drain(0)
    with pytest.raises(NotAccepting):
        engine.submit([1], p)
    engine.step()
    assert a.finish_reason == "abort" and b.finish_reason == "abort" and engine.drained.is_set()
    for kw in ({"temperature": -1}, {"top_p": 0}, {"top_k": 0}, {"max_tokens": 0}, {"seed": -1}, {"logprobs": 6}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
