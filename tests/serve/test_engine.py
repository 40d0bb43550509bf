"""The engine without HTTP: every request's tokens equal ``generate`` run alone (greedy and seeded sampling)
under continuous batching and chunked prefill; prefix states resume exactly and prefill only the rest; the
cache counts bytes exactly; cancel, drain, the queue bound and the memory budget hold."""

import contextlib
import importlib.util
import random

import pytest
import torch

from subquad.models import LanguageModel
from subquad.ops import KVCache
from subquad.serve import Engine, NotAccepting, QueueFull, SamplingParams
from subquad.serve.sampling import OptionError
from subquad.serve.prefix_cache import PrefixCache, compact, exact_bytes
from tests.serve.helpers import V, config, folder, load


def model_of(kind):
    torch.manual_seed(0)
    return LanguageModel(config(kind)).eval()


# the options a request may add (each applies to greedy decoding too but min_p)
EXTRA = [{}, {}, {"presence_penalty": 0.8, "frequency_penalty": 0.4}, {"repetition_penalty": 1.6},
         {"min_p": 0.05}, {"logit_bias": {7: 4.0, 8: -100.0}}, {"repetition_penalty": 0.7, "frequency_penalty": -0.5}]


def requests(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(V) for _ in range(rng.choice([1, 2, 9, 23, 41]))]
        greedy = rng.random() < 0.5
        out.append((prompt, SamplingParams(max_tokens=rng.choice([1, 4, 11]), temperature=0 if greedy else 0.9,
                                           seed=1000 + i, top_k=rng.choice([None, 20]),
                                           top_p=rng.choice([None, 0.8]), **rng.choice(EXTRA))))
    return out


def alone(model, prompt, p, index=0):
    """``generate`` alone with the request's options (choice ``index``: seeded ``seed + index``)."""
    return model.generate(prompt, p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          seed=None if p.seed is None else p.seed + index, stop_ids=p.stop_ids, min_p=p.min_p,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias,
                          ignore_eos=p.ignore_eos)[0]


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


@pytest.mark.parametrize("kind", ["mamba2", "bamba", "qwen4_exp"])
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


def test_serve_compile_decode_times_both_steps_before_it_listens(capsys):
    """``subquad serve --compile-decode`` (``cli.serve._compile_and_warm``): its warm-up steps one row and a ragged
    batch long enough for ``compile_decode(faster=True)``'s trial, so each batch class has kept the faster step
    (printed) before the first request; the engine then serves the eager model's streams - and, held to the
    compiled step in both classes, through its graphs (batches that grow and shrink, a ragged KV cache), every
    stream's tokens still equal the eager model's ``generate`` alone. The hybrid cut to its two kinds of layer
    (Mamba-2, attention): the third, a Mamba-2 again, would compile the same graphs once more."""
    from dataclasses import replace

    from subquad.cli.serve import _compile_and_warm

    cfg = replace(config("bamba"), n_layers=2, pattern="mamba2,softmax")
    torch.manual_seed(0)
    eager = LanguageModel(cfg).eval()
    model = LanguageModel(cfg).eval()
    model.load_state_dict(eager.state_dict())
    eos = list(model.config.eos_token_ids)
    _compile_and_warm(model)
    chosen = model._decode_step.chosen
    assert set(chosen) == {"1", "B"} and set(chosen.values()) <= {"eager", "compiled"}
    assert model.config.eos_token_ids == eos
    err = capsys.readouterr().err
    assert f"decoding step: one row {chosen['1']}, several rows {chosen['B']}" in err
    reqs = requests(6, seed=2)
    seqs = run_all(Engine(model, max_batch=3, prefill_chunk=16, state_cache_mb=0), reqs)
    for (prompt, p), seq in zip(reqs, seqs):
        assert seq.tokens == alone(eager, prompt, p), (prompt, p)
    step = model._decode_step
    chosen.update({"1": "compiled", "B": "compiled"})
    assert step.fallback is None and len(step.graphs) == 2
    reqs = requests(10, seed=1)
    seqs = run_all(Engine(model, max_batch=4, prefill_chunk=16, state_cache_mb=0), reqs)
    for (prompt, p), seq in zip(reqs, seqs):
        assert seq.tokens == alone(eager, prompt, p), (prompt, p)
    assert step.fallback is None and len(step.graphs) == 2     # the warm-up's two graphs served every batch


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

    # a radix tree: the 20-token checkpoint below the 3-token one holds its own state and the KV of tokens 3..19
    # only (attention's keys and values are shared along the path, recurrent states are per checkpoint)
    cache = PrefixCache(3 * fixed + 40 * per_token - 1)      # not room for three checkpoints on 40 tokens
    assert cache.insert(range(3), states[3]) and cache.insert(range(20), states[20])
    assert cache.nbytes == size[3] + size[20] - 3 * per_token
    assert cache.lookup(list(range(25)))[0] == 20            # the longest prefix; 3-token entry now least recent
    assert cache.lookup(list(range(3)) + [99])[0] == 3       # ... and now the 20-token entry is
    assert cache.insert(range(40), states[40])
    # the 20-token checkpoint was evicted, its tokens' KV kept: the 40-token one needs it
    assert cache.nbytes == size[3] + size[40] - 3 * per_token and len(cache) == 2
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


def test_stop_token_ids_end_the_text_without_it_and_ignore_eos_runs_on(tmp_path):
    """A stop token ends the sequence ("stop"), counted among the tokens but its text not output (as vLLM);
    ignore_eos runs past the model's end of text to max_tokens; both as ``generate`` alone."""
    model, tok = load(folder(tmp_path / "m", "bamba"))
    prompt = [11, 40, 12, 9, 30]
    free = alone(model, prompt, SamplingParams(max_tokens=10, temperature=0))
    i = next(i for i in range(2, 9) if free[i] not in free[:i])
    engine = Engine(model, tok, state_cache_mb=0, eos_ids=[free[1]])
    stop = SamplingParams(max_tokens=10, temperature=0, stop_ids=[free[i]], ignore_eos=True)
    seq = engine.submit(prompt, stop)
    while engine.step():
        pass
    assert seq.tokens == free[:i + 1] and seq.finish_reason == "stop"
    assert "".join(e.text for e in _events(seq)) == tok.decode(free[:i])           # without the stop token
    model.config.eos_token_ids = [free[1]]
    assert alone(model, prompt, stop) == free[:i + 1]
    seq = engine.submit(prompt, SamplingParams(max_tokens=10, temperature=0))    # eos honoured: stops at free[1]
    while engine.step():
        pass
    assert seq.tokens == free[:2] == alone(model, prompt, SamplingParams(max_tokens=10, temperature=0))


@pytest.mark.parametrize("kind", ["mamba2", "bamba"])
def test_n_choices_prefill_once_and_choice_i_equals_generate_alone_seeded_seed_plus_i(kind):
    model = model_of(kind)
    prompt = [random.Random(3).randrange(V) for _ in range(37)]
    engine = Engine(model, max_batch=6, prefill_chunk=16, state_cache_mb=0)
    p = SamplingParams(max_tokens=9, temperature=0.9, seed=40, n=4, repetition_penalty=1.3, min_p=0.02)
    other = SamplingParams(max_tokens=5, temperature=0)
    seq, lone = engine.submit(prompt, p), engine.submit([5, 6], other)     # another request shares the batch
    while engine.step():
        pass
    assert [s.index for s in seq.choices] == [0, 1, 2, 3]
    for i, s in enumerate(seq.choices):
        assert s.tokens == alone(model, prompt, p, i), i
        assert s.finish_reason == "length"
    assert len({tuple(s.tokens) for s in seq.choices}) > 1                  # the choices differ
    assert lone.tokens == alone(model, [5, 6], other)
    assert engine.counters["prefill_tokens"] == len(prompt) + 2             # the prompt prefilled once
    assert engine.active == 0 and engine.batch_state is None


def test_n_choices_wait_for_rows_and_cancelling_choice_0_before_its_prompt_is_done_ends_them_all():
    model = model_of("mamba2")
    engine = Engine(model, max_batch=3, prefill_chunk=4, state_cache_mb=0)
    first = engine.submit([1, 2], SamplingParams(max_tokens=6, temperature=0, n=2))
    second = engine.submit([3] * 20, SamplingParams(max_tokens=3, temperature=0, n=2))
    engine.step()
    assert engine.active == 2 and len(engine.waiting) == 1                 # 2 + 2 rows pass max_batch 3
    while engine.step():
        pass
    assert all(s.tokens == alone(model, [1, 2], SamplingParams(max_tokens=6, temperature=0)) for s in first.choices)
    assert all(len(s.tokens) == 3 for s in second.choices)
    third = engine.submit([4] * 20, SamplingParams(max_tokens=3, temperature=0, n=3))
    engine.step()                                                          # 4 of its 20 prompt tokens prefilled
    engine.cancel(third)
    engine.step()
    assert [s.finish_reason for s in third.choices] == ["abort"] * 3
    assert engine.active == 0 and not engine.step()


def _events(seq):
    out = []
    while not seq.events.empty():
        out.append(seq.events.get())
    return out


def test_admission_stops_at_the_memory_budget():
    model = model_of("bamba")
    probe = Engine(model)
    p = SamplingParams(max_tokens=10, temperature=0)
    two_rows = 2 * probe.held_bytes([20, 20])             # two rows of 10 + 10 tokens, batched, while it changes
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
    for bad, match in (([], "prompt"), ([V], "prompt"), ([1] * 65, "prompt"), ([1] * 20, "max_tokens"),
                       ("def f", r"prompt must be a list of token ids, got str \(text: encode it")):
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
    for kw in ({"temperature": -1}, {"top_p": 0}, {"top_k": 0}, {"max_tokens": 0}, {"seed": -2 ** 63 - 1},
               {"logprobs": 21}, {"n": 0}, {"seed": 2 ** 63 - 2, "n": 3}, {"min_p": 2}, {"repetition_penalty": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
    for p, name in ((SamplingParams(n=2), "n"), (SamplingParams(logit_bias={V: 1}), "logit_bias"),
                    (SamplingParams(stop_ids=[V]), "stop_ids")):
        with pytest.raises(OptionError, match=name):
            engine.submit([1], p)


def _storage_bytes(*objs) -> int:
    """Bytes of the distinct tensor storages inside these states, caches and containers (a buffer two
    states share counts once; a KV cache counts its whole buffers, spare capacity included)."""
    seen, stack = {}, list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            seen[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, KVCache):
            stack += [o.k, o.v] + [t for t in (o.pad, o.row_seen) if t is not None]
        elif isinstance(o, dict):
            stack += list(o.values())
        elif isinstance(o, (list, tuple)):
            stack += list(o) + [getattr(o, "pos", None)]
    return sum(seen.values())


def test_the_memory_budget_holds_on_the_bytes_really_allocated(monkeypatch):
    """Bytes measured from the tensors - everything the engine holds (batch, prefilling states, prefix cache)
    plus the inputs and outputs of every prefill, step, join and leave while they are alive - never pass
    --memory-mb, with prefix-cache inserts on; the engine still batches and every stream stays exact."""
    import subquad.serve.engine as engine_module
    import subquad.serve.prefill as prefill_module

    model = model_of("bamba")
    cfg = model.config
    fixed = sum(t.nelement() * t.element_size() for i, layer in enumerate(model.empty_state(1))
                if cfg.layers[i] != "softmax" for t in layer.values())
    per_token = 2 * cfg.n_kv_heads * (cfg.d_model // cfg.n_heads) * 4
    budget = 5 * (fixed + 100 * per_token)                # a few rows of up to 92 tokens: a tight budget
    rng = random.Random(3)
    base = [rng.randrange(V) for _ in range(40)]
    reqs = [(base[:rng.choice([25, 40])] + [rng.randrange(V) for _ in range(rng.choice([0, 20, 40]))],
             SamplingParams(max_tokens=rng.choice([3, 9]), temperature=0)) for _ in range(5)]
    engine = Engine(model, memory_mb=budget / 2 ** 20, state_cache_mb=64, max_batch=8, prefill_chunk=32)
    peak, most = [0], [0]

    def measure(*extra):
        held = [engine.batch_state, [s.state for s in engine.prefilling],
                engine.cache.tensors()]
        peak[0] = max(peak[0], _storage_bytes(*held, *extra))
        most[0] = max(most[0], engine.active)

    def watched(fn):
        def call(*args, **kw):
            out = fn(*args, **kw)
            if watching:
                measure(args, kw, out)
            return out
        return call

    watching = True

    monkeypatch.setattr(model, "prefill", watched(model.prefill))
    monkeypatch.setattr(model, "step", watched(model.step))
    for module in (engine_module, prefill_module):
        for name in ("cat_states", "select_rows", "with_capacity"):
            monkeypatch.setattr(module, name, watched(getattr(module, name)))
    seqs = [engine.submit(p, sp) for p, sp in reqs]
    while engine.step():
        measure()
    kept = engine.cache.checkpoints()[-1]                 # the turn the cache kept last: its next turn
    reqs.append((list(kept) + [7, 8, 9], SamplingParams(max_tokens=5, temperature=0)))
    seqs.append(engine.submit(*reqs[-1]))
    while engine.step():
        measure()
    watching = False                                        # generate alone below is not the engine
    assert all(s.tokens == alone(model, p, sp) for (p, sp), s in zip(reqs, seqs))
    assert peak[0] <= budget, (peak[0], budget)
    assert most[0] >= 2 and seqs[-1].cached_tokens == len(kept) and engine.cache.nbytes > 0
    assert engine.state_bytes == 0 and engine.active == 0


def test_a_request_with_its_final_event_no_longer_counts_as_active():
    """The final event is sent inside the step, before its row leaves the batch: a consumer (another thread, say a
    test or /metrics) that has its final event must not read the row as active (CI once caught 1 here)."""
    engine = Engine(model_of("mamba2"), state_cache_mb=0)
    seen = []
    short = SamplingParams(max_tokens=2, temperature=0)
    engine.submit([1, 2, 3], short, on_event=lambda e: e.finish_reason and seen.append(engine.active))
    engine.submit([4, 5], SamplingParams(max_tokens=5, temperature=0))
    while engine.step():
        pass
    assert seen == [1]                                  # the other request was still decoding, this one was not


def test_a_tiny_temperature_is_greedy_and_cannot_overflow():
    """logits / 1e-300 in float32 are inf and their softmax NaN: below GREEDY_BELOW a temperature is greedy."""
    model = model_of("mamba2")
    engine = Engine(model, state_cache_mb=0)
    seqs = [engine.submit([4, 5, 6], SamplingParams(max_tokens=6, temperature=t, seed=1)) for t in (1e-300, 1e-6)]
    while engine.step():
        pass
    greedy = alone(model, [4, 5, 6], SamplingParams(max_tokens=6, temperature=0))
    assert [s.tokens for s in seqs] == [greedy, greedy] and engine.counters["errors"] == 0
    assert SamplingParams(temperature=1e-300).temperature == 0 and SamplingParams(temperature=1e-5).temperature == 1e-5


def _failing(after: int):
    """A sampler that raises on its call number ``after`` (counted from 0), as NaN logits would."""
    calls = [0]

    def sample(row):
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return int(row.argmax())
    return sample


def test_a_request_whose_own_work_fails_ends_with_error_and_the_others_go_on():
    """One request fails at its first token (between prefilling and the batch), one mid-decoding: each gets a
    final "error" event, the others finish exactly, and the loop goes on serving."""
    model = model_of("bamba")
    engine = Engine(model, state_cache_mb=0)
    p = SamplingParams(max_tokens=8, temperature=0)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
    seqs = [engine.submit(q, p) for q in prompts]
    seqs[1].sampler, seqs[2].sampler = _failing(0), _failing(3)
    engine.start()
    try:
        finals = [[e for e in engine.stream(s, timeout=20)][-1] for s in seqs]
        assert [e.finish_reason for e in finals] == ["length", "error", "error", "length"]
        assert len(seqs[2].tokens) == 3
        for i in (0, 3):
            assert seqs[i].tokens == alone(model, prompts[i], p)
        later = engine.submit([13, 14], p)
        assert [e for e in engine.stream(later, timeout=20)][-1].finish_reason == "length"
        assert later.tokens == alone(model, [13, 14], p)
        assert engine.counters["errors"] == 2 and engine.active == 0 and not engine._unfinished
    finally:
        engine.stop()


def test_a_failed_batched_step_ends_its_rows_and_the_engine_serves_on(monkeypatch):
    """The batched step itself raises (no one row to blame): the rows in the batch end with "error", each once;
    the request still waiting is served exactly afterwards."""
    model = model_of("mamba2")
    engine = Engine(model, max_batch=2, state_cache_mb=0)
    p = SamplingParams(max_tokens=6, temperature=0)
    seqs = [engine.submit([i + 1, i + 2], p) for i in range(3)]
    engine.step()                                            # two rows in the batch, one waiting
    real, calls = model.step, [0]

    def step(*args):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("CUDA out of memory")
        return real(*args)

    monkeypatch.setattr(model, "step", step)
    while engine.step():
        pass
    events = [_events(s) for s in seqs]
    assert [[e.finish_reason for e in ev if e.finish_reason] for ev in events] == [["error"], ["error"], ["length"]]
    assert seqs[2].tokens == alone(model, [3, 4], p) and engine.counters["errors"] == 2
    assert engine.batch_state is None and not engine._unfinished


def test_drain_takes_no_lock_so_a_signal_handler_cannot_deadlock():
    """uvicorn runs its SIGTERM handler on the main thread, which may be inside ``submit`` holding the engine's
    lock (or inside ``Event.set`` holding the event's): the drain path must take neither. Held here on this
    thread, the drain runs in another and must finish (a deadlock shows as a timeout, not a hang)."""
    import signal
    import threading

    engine = Engine(model_of("mamba2"))
    server = None
    if all(importlib.util.find_spec(m) for m in ("uvicorn", "fastapi")):
        from subquad.serve.server import make_server

        server = make_server(engine, "m", port=0, drain_timeout=5)
    cond = getattr(engine._wake, "_cond", None)                 # CPython's Event: a Condition over a plain Lock
    with engine._lock, (cond if cond is not None else contextlib.nullcontext()):
        t = threading.Thread(target=(lambda: server.handle_exit(signal.SIGTERM, None)) if server else
                             (lambda: engine.drain(5)), daemon=True)
        t.start()
        t.join(5)
        done = not t.is_alive()
    t.join(5)
    assert done, "the drain path blocked on a lock the signalled thread holds"
    assert not engine.accepting and (server is None or server.should_exit)
    with pytest.raises(NotAccepting):
        engine.submit([1], SamplingParams())


def test_a_subquad_run_ends_text_at_its_tokenizers_end_of_text():
    """A run's tokenizer ends every training document with <|endoftext|> (``encode_docs``) and its config names
    no end-of-text id: the server stops there. A checkpoint's own ids come first; no such token, no id."""
    from tokenizers import AddedToken, Tokenizer, models

    from subquad.data.tokenizer import EOT
    from subquad.data.tokenizer import end_of_text_ids

    model = model_of("mamba2")
    free = alone(model, [4, 5, 6], SamplingParams(max_tokens=10, temperature=0))
    eot = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    vocab = {f"w{i}": i for i in range(V) if i != eot} | {EOT: eot}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w10"))
    tok.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    assert model.config.eos_token_ids == [] and end_of_text_ids(model, tok) == [eot]
    engine = Engine(model, state_cache_mb=0, eos_ids=end_of_text_ids(model, tok))
    seq = engine.submit([4, 5, 6], SamplingParams(max_tokens=10, temperature=0))
    while engine.step():
        pass
    assert seq.tokens == free[:free.index(eot) + 1] and seq.finish_reason == "stop"
    assert end_of_text_ids(model, Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))) == []
    model.config.eos_token_ids = [7]
    assert end_of_text_ids(model, tok) == [7]


def test_response_format_rows_equal_generate_alone_and_parse():
    """A JSON-schema request and a JSON-object one beside a plain one: each equal to ``generate`` alone with the
    same response_format, the constrained ones ended ("stop") by the grammar, their text valid JSON; the
    request's field checked through the protocol (a 400 naming response_format)."""
    import json

    pytest.importorskip("llguidance")
    from subquad.serve.protocol import parse_completion
    from tests.models.test_constrain import FORMAT, tiny_json_model

    tok, model = tiny_json_model()
    model = model.float()
    prompt = tok.encode("a b").ids
    reqs = [SamplingParams(max_tokens=40, temperature=0.9, seed=5, response_format=FORMAT),
            SamplingParams(max_tokens=8, temperature=0.9, seed=6),
            SamplingParams(max_tokens=60, temperature=0, response_format={"type": "json_schema",
                                                                           "json_schema": {"schema": FORMAT[
                                                                               "json_schema"]["schema"]}})]
    engine = Engine(model, tok, state_cache_mb=0)
    seqs = run_all(engine, [(prompt, p) for p in reqs])
    for seq, p in zip(seqs, reqs, strict=True):
        want = model.generate(prompt, p.max_tokens, temperature=p.temperature, seed=p.seed,
                              response_format=p.response_format, tokenizer=tok)[0]
        assert seq.tokens == want
        if p.response_format is not None:
            assert seq.finish_reason == "stop" and set(json.loads(tok.decode(seq.tokens))) == {"ok", "n", "color"}
    body = {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}
    assert parse_completion(body, 256).params.response_format == {"type": "json_object"}
    with pytest.raises(Exception, match="response_format"):
        parse_completion({**body, "response_format": {"type": "yaml"}}, 256)
    with pytest.raises(OptionError, match="response_format"):
        Engine(model, None, state_cache_mb=0).submit(prompt, SamplingParams(response_format={"type": "json_object"}))



def test_run_steps_on_the_calling_thread_until_told_to_stop():
    """``Engine.run``: the loop on the calling thread (``subquad serve`` runs it on the main thread, where
    OpenMP's parallel regions are fast), until ``until()`` holds; requests submitted meanwhile from another
    thread are served exactly, and every step ran on this thread."""
    import threading

    model = model_of("mamba2")
    engine = Engine(model, state_cache_mb=0)
    p = SamplingParams(max_tokens=7, temperature=0)
    threads, real = set(), engine._iterate            # the loop's iteration (``step`` from outside it)

    def step():
        threads.add(threading.get_ident())
        return real()
    engine._iterate = step
    seqs = []
    submitter = threading.Thread(target=lambda: seqs.extend(engine.submit([i + 1, i + 3], p) for i in range(3)))
    submitter.start()
    engine.run(until=lambda: not submitter.is_alive() and all(s.finish_reason for s in seqs))
    assert [s.tokens for s in seqs] == [alone(model, [i + 1, i + 3], p) for i in range(3)]
    assert threads == {threading.get_ident()}


@pytest.mark.parametrize("kind", ["mamba2", "bamba"])
def test_prompts_due_together_prefill_in_one_packed_forward_and_equal_generate_alone(kind):
    """Prompts of different lengths admitted together go through one packed forward (``cu_seqlens``): one for
    those that start afresh, one for those that resume from a cached state; every stream equals ``generate``
    alone, and a request that shares a block with a prompt prefilled beside it waits a round to resume from it."""
    model = model_of(kind)
    rng = random.Random(3)
    greedy = SamplingParams(max_tokens=5, temperature=0)
    fresh = [[rng.randrange(V) for _ in range(n)] for n in (3, 17, 9, 26)]
    engine = Engine(model, max_batch=8, prefill_chunk=256, state_cache_mb=0)
    seqs = [engine.submit(p, greedy) for p in fresh]
    engine.step()
    assert engine.counters["prefill_forwards"] == 1 and len(engine.running) == 4
    while engine.step():
        pass
    assert [s.tokens for s in seqs] == [alone(model, p, greedy) for p in fresh]

    block = 8
    engine = Engine(model, max_batch=8, prefill_chunk=256, state_cache_mb=64, prefix_block=block)
    base = [rng.randrange(V) for _ in range(20)]
    run_all(engine, [(base, greedy)])
    forwards = engine.counters["prefill_forwards"]
    # two that resume from base's checkpoints (a block end, its prompt's end), one afresh, and one sharing 19
    # tokens with a new prompt beside it
    twin = [rng.randrange(V) for _ in range(19)]
    prompts = [base[:13] + [1, 2], base + [5, 6, 7], [9] * 11, twin + [4], twin + [3, 3]]
    seqs = [engine.submit(p, greedy) for p in prompts]
    engine.step()
    # round 1: the resumed pair in one forward, twin's first block (and [9] * 11's) in another; the second twin
    # waits, so its first round resumes at twin's checkpoint at 16
    assert engine.counters["prefill_forwards"] - forwards >= 2
    while engine.step():
        pass
    assert [s.cached_tokens for s in seqs] == [8, 20, 0, 0, 16]    # base ends a kept prompt: 20
    assert [s.tokens for s in seqs] == [alone(model, p, greedy) for p in prompts]


def test_a_packed_prefill_that_fails_is_run_again_piece_by_piece(monkeypatch):
    """The packed forward raises for one prompt's sake: the pieces run again one by one, that request ends with
    "error", and the others, prefilled alone, equal ``generate`` alone."""
    model = model_of("bamba")
    engine = Engine(model, max_batch=4, state_cache_mb=0)
    real = model.prefill

    def prefill(ids, *args, **kw):
        if 77 in ids.tolist()[0]:
            raise RuntimeError("a bad piece")
        return real(ids, *args, **kw)

    monkeypatch.setattr(model, "prefill", prefill)
    p = SamplingParams(max_tokens=4, temperature=0)
    prompts = [[1, 2, 3], [4, 77, 6], [8, 9, 10, 11]]
    seqs = [engine.submit(q, p) for q in prompts]
    while engine.step():
        pass
    assert [s.finish_reason for s in seqs] == ["length", "error", "length"]
    assert engine.counters["prefill_forwards"] == 4 and engine.counters["errors"] == 1
    monkeypatch.setattr(model, "prefill", real)
    for i in (0, 2):
        assert seqs[i].tokens == alone(model, prompts[i], p)


def test_plain_steps_share_one_steady_span_and_a_callbacks_change_is_read(monkeypatch):
    """The loop's plain steps run in one ``kernels.steady`` span (the kept calls checked once, not every step);
    an ``on_event`` of the caller's renews it, so weights it swaps are read from the next step - the tokens
    ``generate`` gives with the same swap in its ``on_token``."""
    from subquad import kernels
    from subquad.models import stack

    model = model_of("mamba2")                       # two Mamba-2 blocks: a run the stack takes
    marks, valid, still = [], kernels.Held.valid, stack.Plan.still       # the checks, and the span each ran in
    monkeypatch.setattr(kernels.Held, "valid", lambda self: marks.append(kernels.steady_mark()) or valid(self))
    monkeypatch.setattr(stack.Plan, "still", lambda self: marks.append(kernels.steady_mark()) or still(self))
    engine = Engine(model, max_batch=2, state_cache_mb=0)
    grads, real_step = [], model.step
    model.step = lambda *a: grads.append(torch.is_grad_enabled()) or real_step(*a)
    seq = engine.submit([3, 5, 7], SamplingParams(max_tokens=9, temperature=0))
    engine.run(until=lambda: seq.finish_reason is not None)
    del model.step
    assert grads and not any(grads)                  # the loop decodes without autograd (the kernels' condition)
    assert len(marks) >= 5 and marks[0] is not None and all(m is marks[0] for m in marks)
    assert seq.tokens == model.generate([3, 5, 7], 9, temperature=0.0)[0]

    w = model.blocks[1].mixer.out_proj.weight
    keep = w.data

    def swap_at_third(count):
        def call(*_):
            count.append(1)
            if len(count) == 3:
                w.data = keep * -3
        return call

    marks.clear()
    seq = engine.submit([3, 5, 7], SamplingParams(max_tokens=9, temperature=0), on_event=swap_at_third([]))
    engine.run(until=lambda: seq.finish_reason is not None)
    w.data = keep
    seen = list(marks)
    want = model.generate([3, 5, 7], 9, temperature=0.0, on_token=swap_at_third([]))[0]
    w.data = keep
    assert seq.tokens == want and want != model.generate([3, 5, 7], 9, temperature=0.0)[0]
    assert len({id(m) for m in seen}) == 8           # renewed at each event the caller got: one per plain step


def test_the_served_loop_decodes_a_hybrid_in_one_call_a_step(monkeypatch):
    """What ``subquad serve`` runs (the engine's ``run`` loop, rows joining and leaving, ragged caches) takes a
    hybrid's one C call per step (``models.layer_stack``) at every step but at most the first at each new number
    of rows (which may build the blocks' kept steps), so a served path falling back to the modules is seen here,
    not only in a benchmark; each stream's tokens are ``generate``'s."""
    from subquad.models import layer_stack

    model = model_of("bamba")
    calls, rows, run, real_step = [], [], layer_stack.MixedStep.__call__, model.step
    monkeypatch.setattr(layer_stack.MixedStep, "__call__", lambda self, *a: calls.append(1) or run(self, *a))
    model.step = lambda tokens, state: rows.append(tokens.reshape(-1).shape[0]) or real_step(tokens, state)
    engine = Engine(model, max_batch=4, state_cache_mb=0)
    prompts, lengths = [[3, 5, 7], [9] * 11, [2, 4]], [9, 4, 12]
    seqs = [engine.submit(q, SamplingParams(max_tokens=n, temperature=0)) for q, n in zip(prompts, lengths)]
    engine.run(until=lambda: all(s.finish_reason is not None for s in seqs))
    del model.step
    assert len(set(rows)) >= 2 and len(rows) - len(set(rows)) <= len(calls) <= len(rows)
    for s, q, n in zip(seqs, prompts, lengths):
        assert s.tokens == model.generate(q, n, temperature=0.0)[0]


def test_the_fields_openais_clients_send_by_default_ask_for_nothing_here():
    """``store: false``, ``metadata`` (tags of a stored completion: nothing is stored), ``modalities: ["text"]``,
    vLLM's ``top_k: -1`` / ``0`` (no top-k) and OpenAI's int64 seeds, negative ones included, are taken; what
    would ask for something is refused by name - tools in plain words."""
    from subquad.serve.protocol import APIError, parse_chat, parse_completion

    body = {"model": "m", "prompt": "x"}
    for extra in ({"store": False}, {"metadata": {"run": "a"}}, {"modalities": ["text"]}, {"seed": -5},
                  {"seed": -2 ** 63}):
        parse_completion({**body, **extra}, 256)
    for k in (-1, 0):
        assert parse_completion({**body, "top_k": k}, 256).params.top_k is None
    assert parse_completion({**body, "top_k": 3}, 256).params.top_k == 3
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for extra, field, words in (({"store": True}, "store", "not supported"),
                                ({"metadata": {"a": 1}}, "metadata", "string values"),
                                ({"modalities": ["text", "audio"]}, "modalities", "not supported"),
                                ({"top_k": -2}, "top_k", "top_k"), ({"top_k": -1.0}, "top_k", "top_k"),
                                ({"seed": 2 ** 63}, "seed", "int64"),
                                ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
                                 "tools and function calling are not supported")):
        with pytest.raises(APIError, match=words) as e:
            parse_chat({**chat, **extra}, 256)
        assert e.value.param == field
