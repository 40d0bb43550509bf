"""Generation with the recurrent state equals re-running the whole prefix, for every mixer and a hybrid."""

import pytest
import torch

from subquad.layers import MIXERS
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


PATTERNS = sorted(MIXERS) + ["mamba2,softmax", "linear,swa,retention,gla"]


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


def test_sampling_is_seeded_and_respects_top_k():
    model = tiny("linear")
    a, _ = model.generate([1, 2], 8, temperature=1.0, top_k=3, seed=7)
    b, _ = model.generate([1, 2], 8, temperature=1.0, top_k=3, seed=7)
    assert a == b
    c, _ = model.generate([1, 2], 8, temperature=1.0, top_p=0.5, seed=7)
    assert len(c) == 8


def test_bad_generation_arguments():
    model = tiny("linear")
    with pytest.raises(ValueError, match="temperature"):
        model.generate([1], 2, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        model.generate([1], 2, top_p=1.5)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate([], 2)
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[0, 99]]))


def test_corrupted_state_file_is_refused(tmp_path):
    model = tiny("linear")
    _, state = model.generate([1, 2, 3], 2, temperature=0)
    save_state(tmp_path / "s.safetensors", state, {"last_token": 1})
    data = (tmp_path / "s.safetensors").read_bytes()
    (tmp_path / "s.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_state(tmp_path / "s.safetensors")
