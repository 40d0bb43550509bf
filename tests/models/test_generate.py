"""Generation with the recurrent state equals re-running the whole prefix, for every mixer and a hybrid."""

import pytest
import torch

from subquad.layers.registry import causal_mixers
from subquad.models import LanguageModel, ModelConfig, load_state, save_state


def tiny(pattern, n_layers=2, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=n_layers, n_heads=2, context_length=64, pattern=pattern,
                      mixer_options={"swa": {"window": 5}, "mamba2": {"chunk_size": 8}, "*": {"chunk_size": 8}}
                      if pattern != "softmax" else {}, **kw)
    return LanguageModel(cfg).double().eval()


def greedy_by_rerunning(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


PATTERNS = sorted(causal_mixers()) + ["mamba2,softmax", "linear,swa,retention,gla"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_greedy_generation_with_state_equals_rerunning_the_prefix(pattern):
    model = tiny(pattern, n_layers=max(2, pattern.count(",") + 1))
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]
    out, state = model.generate(prompt, 12, temperature=0)
    assert out == greedy_by_rerunning(model, prompt, 12)
    assert model.state_bytes(state) > 0


def test_state_bytes_constant_for_recurrent_mixers_and_growing_for_softmax():
    for pattern, grows in (("linear", False), ("mamba2", False), ("softmax", True), ("swa", False)):
        model = tiny(pattern)
        b1 = model.state_bytes(model.prefill(torch.randint(0, 61, (1, 20)))[1])
        b2 = model.state_bytes(model.prefill(torch.randint(0, 61, (1, 60)))[1])
        assert (b2 > b1) == grows, pattern


@pytest.mark.parametrize("pattern", ["softmax", "linear", "mamba2,swa"])
def test_saved_state_reloads_to_the_same_continuation(pattern, tmp_path):
    model = tiny(pattern)
    prompt = [1, 2, 3, 4, 5, 6]
    full, _ = model.generate(prompt, 10, temperature=0)
    first, state = model.generate(prompt, 4, temperature=0)
    save_state(tmp_path / "s.safetensors", state, {"last_token": first[-1]})
    state2, extra = load_state(tmp_path / "s.safetensors")
    rest, _ = model.generate([extra["last_token"]], 6, temperature=0, state=state2)
    assert first + rest == full


def test_sampling_is_seeded():
    model = tiny("linear")
    a, _ = model.generate([1, 2], 8, temperature=1.0, top_k=3, seed=7)
    b, _ = model.generate([1, 2], 8, temperature=1.0, top_k=3, seed=7)
    assert a == b


def test_sampling_keeps_its_promises_over_many_draws():
    """top-k never emits a token outside the k largest logits, top-p never one outside the nucleus (the
    smallest set of most likely tokens whose mass reaches p), temperature 0 is the argmax; and inside
    those sets the draw frequencies follow the renormalised probabilities."""
    from subquad.models.generate import sample_batch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 2
    draws = torch.stack([sample_batch(logits, 1.0, None, None, g) for _ in range(3000)])     # (n, 4)
    order = logits.argsort(-1, descending=True)
    assert torch.equal(sample_batch(logits, 0.0), logits.argmax(-1))
    topk = torch.stack([sample_batch(logits, 1.0, 5, None, g) for _ in range(2000)])
    for r in range(4):
        assert set(topk[:, r].tolist()) <= set(order[r, :5].tolist())
        assert len(set(topk[:, r].tolist())) > 1
    probs = logits.softmax(-1)
    for p in (0.3, 0.8):
        nucleus = []
        for r in range(4):
            sp = probs[r, order[r]]
            n = int((sp.cumsum(0) - sp < p).sum())                  # tokens whose preceding mass is below p
            nucleus.append(set(order[r, :n].tolist()))
        got = torch.stack([sample_batch(logits, 1.0, None, p, g) for _ in range(2000)])
        for r in range(4):
            assert set(got[:, r].tolist()) <= nucleus[r]
    # plain sampling: the most likely token's frequency within 4 standard errors of its probability
    for r in range(4):
        top = order[r, 0]
        freq = (draws[:, r] == top).float().mean()
        p0 = probs[r, top]
        assert abs(freq - p0) < 4 * (p0 * (1 - p0) / 3000) ** 0.5


@pytest.mark.parametrize("pattern", ["linear", "softmax", "mamba2,swa", "gated_deltanet"])
def test_a_batch_of_prompts_of_different_lengths_equals_each_alone(pattern):
    model = tiny(pattern)
    prompts = [[3, 14, 15], [9, 26, 5, 35, 8, 9, 7], [1], [2, 7, 18, 28, 18]]
    outs, _ = model.generate(prompts, 6, temperature=0)
    for p, o in zip(prompts, outs):
        alone, _ = model.generate(p, 6, temperature=0)
        assert o == alone, (p, o, alone)
    tensor_batch, _ = model.generate(torch.tensor([[3, 14, 15], [9, 26, 5]]), 4, temperature=0)
    assert tensor_batch == [model.generate([3, 14, 15], 4, temperature=0)[0],
                            model.generate([9, 26, 5], 4, temperature=0)[0]]


def test_stop_ids_finish_each_sequence_on_its_own():
    model = tiny("linear")
    prompts = [[3, 14, 15], [9, 26, 5, 35]]
    free, _ = model.generate(prompts, 10, temperature=0)
    stop = free[0][3]                                       # the 4th token the first sequence emits
    outs, _ = model.generate(prompts, 10, temperature=0, stop_ids=[stop])
    assert outs[0] == free[0][:free[0].index(stop) + 1]     # stops right after emitting it
    second = free[1][:free[1].index(stop) + 1] if stop in free[1] else free[1]
    assert outs[1] == second
    seen = []
    model.generate(prompts, 3, temperature=0, on_token=lambda i, t: seen.append((i, t)))
    assert sorted(seen) == sorted((i, t) for i, o in enumerate(model.generate(prompts, 3, temperature=0)[0])
                                  for t in o)


def test_bad_generation_arguments():
    model = tiny("linear")
    with pytest.raises(ValueError, match="temperature"):
        model.generate([1], 2, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        model.generate([1], 2, top_p=1.5)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate([], 2)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate([[1, 2], []], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([1], 2.5)
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[0, 99]]))
    with pytest.raises(ValueError, match=r"token ids .* got \[-1, 0\]"):      # a step's few ids, as ints
        model(torch.tensor([[0], [-1]]))
    with pytest.raises(ValueError, match=r"token ids .* got \[0, 99\]"):      # a prompt's many, by reductions
        model(torch.tensor([[0] * 70 + [99]]))



def test_a_tiny_temperature_is_greedy_and_bad_sampling_arguments_are_refused_by_name():
    """logits / 1e-300 overflow float32 to inf, whose softmax is NaN: a temperature below GREEDY_BELOW is greedy
    (as the server's SamplingParams, one shared check); NaN, inf or a negative one is refused by name."""
    model = tiny("linear")
    greedy, _ = model.generate([1, 2, 3], 6, temperature=0)
    for t in (1e-30, 1e-300):
        assert model.generate([1, 2, 3], 6, temperature=t, seed=0)[0] == greedy
    for t in (float("nan"), float("inf"), -1e-9, "0.5", True):
        with pytest.raises(ValueError, match="temperature"):
            model.generate([1], 2, temperature=t)
    for name, value in (("top_p", float("nan")), ("top_p", 0), ("top_k", 0), ("top_k", 2.5), ("top_k", True)):
        with pytest.raises(ValueError, match=name):
            model.generate([1], 2, **{name: value})


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_nan_logits_are_refused_rather_than_sampled(temperature):
    """A model whose logits are NaN (weights with NaN, an overflow in low precision) would be sampled silently:
    argmax picks an arbitrary id and multinomial fails obscurely or draws garbage on a GPU."""
    model = tiny("linear")
    with torch.no_grad():
        model.embed.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        model.generate([1, 2], 3, temperature=temperature, seed=0)

def test_corrupted_state_file_is_refused(tmp_path):
    model = tiny("linear")
    _, state = model.generate([1, 2, 3], 2, temperature=0)
    save_state(tmp_path / "s.safetensors", state, {"last_token": 1})
    data = (tmp_path / "s.safetensors").read_bytes()
    (tmp_path / "s.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_state(tmp_path / "s.safetensors")


def test_wrong_states_steps_and_seeds_are_refused_by_name(tmp_path):
    """What a user passes by mistake is refused naming the argument, not failing deep inside (a new user's
    trial): a seed that is not an int, a step given several tokens a row or float ids, save_state of something
    that is not a state or into a folder that does not exist, load_state of a model's weights."""
    from subquad.tensorfile import save_file

    model = tiny("mamba2,swa")
    for seed in ("a", 1.5, True):
        with pytest.raises(ValueError, match="seed must be an int"):
            model.generate([1, 2], 2, seed=seed)
    _, state = model.generate([1, 2], 2, temperature=0)
    with torch.no_grad():
        for tokens in (torch.tensor([[1, 2]]), torch.tensor([1.0]), torch.tensor(1), [1], torch.tensor([[[1]]])):
            with pytest.raises(ValueError, match="step's tokens must be one integer id a row"):
                model.step(tokens, state)
        assert model.step(torch.tensor([[1]], dtype=torch.int32), state)[0].shape == (1, 61)
    for bad in ("hello", [torch.zeros(2)]):
        with pytest.raises(ValueError, match="save_state's state must be a decoding state"):
            save_state(tmp_path / "s.safetensors", bad)
    with pytest.raises(ValueError, match="the folder .*missing does not exist"):
        save_state(tmp_path / "missing" / "s.safetensors", state)
    save_file({"embed.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="not a saved decoding state"):
        load_state(tmp_path / "model.safetensors")


def test_a_state_of_another_model_is_refused_by_name(tmp_path):
    """``models.state.check_fits`` (``subquad generate --load-state``): a saved state fits the model it came from
    (a batch of 2, its KV caches holding tokens) and is refused, naming the difference, by a model of another
    depth, mixer or width."""
    from subquad.models.state import check_fits

    model = tiny("mamba2,swa")
    _, state = model.generate([[1, 2, 3], [4, 5, 6]], 3, temperature=0)
    save_state(tmp_path / "s.safetensors", state)
    state, _ = load_state(tmp_path / "s.safetensors")
    check_fits(state, model)
    for other, said in ((tiny("mamba2,swa,swa", n_layers=3), "it holds 2 layers; this model has 3"),
                        (tiny("mamba2,linear"), "layer 1 holds"),
                        (LanguageModel(ModelConfig(vocab_size=61, d_model=16, n_layers=2, n_heads=2,
                                                   pattern="mamba2,swa")).double(), "layer 0's")):
        with pytest.raises(ValueError, match=f"--load-state s: {said}"):
            check_fits(state, other, "--load-state s")
    _, state32 = tiny("mamba2,swa").float().generate([1, 2, 3], 2, temperature=0)
    with pytest.raises(ValueError, match="layer 0's '[a-z]+' is torch.float32; this model's states are torch.float64"):
        check_fits(state32, model)


def test_a_state_passed_to_prefill_that_cannot_be_the_models_is_named():
    """Another model's state, a state of other rows, or not a state at all: a ValueError naming the state (not
    torch's "size of tensor a (2) must match" from inside a layer, nor a KeyError), before any layer runs."""
    model = tiny("mamba2,swa")
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    _, state = model.prefill(ids)
    model.prefill(ids[:, :1], state)                                # its own state continues
    _, other = tiny("mamba2,linear").prefill(ids)
    for bad, ids2, said in ((state, ids[:1], "layer 0's '[a-z]+' holds 2 rows; the input has 1"),
                            (other, ids, "layer 1 holds .*another model's state"),
                            (state[:1], ids, "a decoding state is a list of one dict per layer .*got 1 layers"),
                            ("s", ids, ".*got str")):
        with pytest.raises(ValueError, match=f"^state: {said}"):
            model.prefill(ids2, bad)


def test_prefill_of_the_last_logits_equals_the_full_prefill():
    """logits="last" (what generation samples from) is the full prefill's last position of each row, and of
    each sequence of a packed row; anything else is refused by name."""
    model = tiny("mamba2,softmax", logit_soft_cap=5.0)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 61, (3, 9), generator=g)
    with torch.no_grad():
        full, s_full = model.prefill(idx)
        last, s_last = model.prefill(idx, logits="last")
        torch.testing.assert_close(last, full[:, -1], rtol=0, atol=1e-12)
        for a, b in zip(s_full, s_last):
            for k in a:
                if isinstance(a[k], torch.Tensor):
                    torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
        cu = torch.tensor([0, 4, 5, 12])
        packed = torch.randint(0, 61, (1, 12), generator=g)
        full = model.prefill(packed, cu_seqlens=cu)[0]
        torch.testing.assert_close(model.prefill(packed, cu_seqlens=cu, logits="last")[0], full[0, cu[1:] - 1],
                                   rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="logits must be 'all' or 'last'"):
        model.prefill(idx, logits=1)


def test_learned_positions_refuse_a_generation_past_the_context_before_its_first_token():
    """context_length 16: 3 prompt tokens and 14 new ones take positions 0..15 (the last new token is not fed
    back) and run; 15 new ones would reach position 17 - refused up front, naming the room left (it failed after
    decoding up to there, its tokens lost); a state passed in counts its positions; a prompt alone too long is
    said so."""
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, context_length=16,
                                      pos_emb="learned", pattern="gla"))
    new, state = model.generate([1, 2, 3], 14, temperature=0)
    assert len(new) == 14
    with pytest.raises(ValueError, match=r"context_length=16; this generation would reach position 17 .*at most 14 "
                                         r"new tokens"):
        model.generate([1, 2, 3], 15, temperature=0)
    _, state = model.generate([1, 2, 3], 4, temperature=0)                  # 6 positions taken
    with pytest.raises(ValueError, match=r"reach position 17 \(6 before.*at most 10 new tokens"):
        model.generate([[5]], 11, temperature=0, state=state)
    with pytest.raises(ValueError, match="the prompt alone does not fit"):
        model.generate(list(range(1, 21)), 1, temperature=0)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_generate_records_no_autograd_graph(speculative):
    """``generate`` runs without autograd, whatever the caller's grad mode: the state it returns requires no
    gradient (a decorator once moved to a helper above it: every generation recorded a graph, and a compiled
    step or verification was built for inputs that require one - a second graph, at a training graph's cost,
    when the next call's state did not)."""
    model = tiny("mamba,softmax")
    assert torch.is_grad_enabled()
    _, state = model.generate([[1, 2, 3, 1, 2, 3, 1, 2]], 6, temperature=0, speculative=speculative)
    parts = [v for s in state for v in s.values()]
    tensors = [t for v in parts for t in ([v] if isinstance(v, torch.Tensor) else [v.k, v.v])]
    assert tensors and not any(t.requires_grad for t in tensors)


@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("pattern", ["mamba2,softmax", "gla", "swa,retention"])
def test_a_row_that_finishes_first_keeps_its_own_state(pattern, speculative):
    """A batch whose rows end at different steps (``on_token`` ends them; the others go on, and finished rows are
    fed padding): each row of the returned state is the state of that row generated alone - its prompt and every
    new token but the last consumed, no padding - so a continuation from it is the row's own (float64)."""
    from subquad.layers.rollback import same_state
    from subquad.models.rows import select_rows

    model = tiny(pattern)
    prompts, ends = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7], [8, 9]], [2, 7, 4]
    counts = [0, 0, 0]

    def on_token(i, t):
        counts[i] += 1
        return counts[i] >= ends[i]

    out, state = model.generate(prompts, 7, temperature=0, on_token=on_token, speculative=speculative)
    assert [len(o) for o in out] == ends
    for i, p in enumerate(prompts):
        alone, want = model.generate(p, ends[i], temperature=0)
        got = select_rows(state, [i])
        assert alone == out[i]
        for layer, (a, b) in enumerate(zip(got, want, strict=True)):
            assert same_state(a, b, atol=1e-9) is None, (i, layer, same_state(a, b))
        assert torch.equal(torch.as_tensor(got.pos), torch.as_tensor(want.pos))
