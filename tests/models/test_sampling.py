"""The sampling options (``models.sampling``): the logits processing against the rules applied by hand in plain
Python loops (OpenAI's presence and frequency penalties, HF/vLLM's repetition penalty, OpenAI's logit_bias,
vLLM's min_p); ``generate`` with them against a decoding loop written here (a full forward per token);
stop ids, ignore_eos, and every bad value refused by name."""

import math
import random

import pytest
import torch

from subquad.models import LanguageModel, ModelConfig
from subquad.models.sampling import OptionError, Sampler, SamplingOptions, sample, sample_batch


def by_hand(logits: list[float], prompt: list[int], generated: list[int], o: dict) -> list[float]:
    """The rules of the module doc on one row, one token at a time."""
    out = []
    for t, x in enumerate(logits):
        x += o.get("logit_bias", {}).get(t, 0.0)
        if t in prompt or t in generated:
            r = o.get("repetition_penalty", 1.0)
            x = x / r if x > 0 else x * r
        c = generated.count(t)
        x -= o.get("frequency_penalty", 0.0) * c + o.get("presence_penalty", 0.0) * (1.0 if c > 0 else 0.0)
        out.append(x)
    return out


OPTIONS = [dict(presence_penalty=0.7), dict(frequency_penalty=-0.4), dict(repetition_penalty=1.7),
           dict(repetition_penalty=0.6, logit_bias={3: 100.0, 7: -2.5}),
           dict(presence_penalty=-1.1, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={0: 1.5})]


@pytest.mark.parametrize("o", OPTIONS)
def test_the_logits_processing_equals_the_rules_applied_by_hand(o):
    g = torch.Generator().manual_seed(0)
    B, V = 3, 11                                           # odd sizes; tokens repeat so counts pass 1
    prompts = [[1, 2, 2], [5], [0, 9, 10, 4]]
    sampler = Sampler(SamplingOptions(**o), prompts)
    generated = [[] for _ in range(B)]
    for step in range(6):
        logits = torch.randn(B, V, generator=g) * 3
        got = sampler.process(logits)
        for i in range(B):
            want = by_hand(logits[i].tolist(), prompts[i], generated[i], o)
            assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-5), (step, i)
        ids = torch.tensor([random.Random(step * 7 + i).choice([2, 4, 6, 2]) for i in range(B)])
        sampler.record(ids)
        for i in range(B):
            generated[i].append(int(ids[i]))
    plain = torch.randn(2, V, generator=g)
    assert Sampler(SamplingOptions(), [[1], [2]]).process(plain) is plain    # nothing asked: untouched


def test_min_p_draws_only_tokens_within_min_p_of_the_most_likely_and_commutes_with_top_k():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 30, generator=g)
    T, min_p = 0.7, 0.2
    for r in range(2):
        p = [math.exp(x / T) for x in logits[r].tolist()]
        keep = {t for t, v in enumerate(p) if v >= min_p * max(p)}
        assert 3 < len(keep) < 30                                         # min_p drops some, keeps several
        draws = {int(sample_batch(logits[r:r + 1], T, None, None, g, min_p)[0]) for _ in range(600)}
        assert draws <= keep and len(draws) > 1, (draws, keep)
        ranked = sorted(range(30), key=lambda t: -logits[r, t].item())[:3]
        both = {int(sample_batch(logits[r:r + 1], T, 3, None, g, min_p)[0]) for _ in range(300)}
        assert both <= keep & set(ranked)


def tiny(eos=None):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=37, d_model=32, n_layers=2, n_heads=2, pattern="mamba2,softmax",
                      tie_embeddings=False)
    model = LanguageModel(cfg).eval()
    model.config.eos_token_ids = [] if eos is None else [eos]
    return model


def test_greedy_generate_with_every_option_equals_a_loop_by_hand():
    """The reference: a full forward over prompt + tokens so far for each token (no decoding state), the rules
    by hand on its last logits, the argmax."""
    model = tiny()
    o = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4, logit_bias={4: 1.0, 9: -3.0})
    for prompt in ([3, 14, 15, 9], [2]):
        ids, want = list(prompt), []
        for _ in range(10):
            with torch.no_grad():
                last = model(torch.tensor([ids]))[0, -1].double().tolist()
            x = by_hand(last, prompt, want, o)
            want.append(max(range(len(x)), key=x.__getitem__))
            ids.append(want[-1])
        got, _ = model.generate(prompt, 10, temperature=0, **o)
        assert got == want
        assert got != model.generate(prompt, 10, temperature=0)[0]            # the options changed something


def test_stop_ids_end_a_sequence_and_ignore_eos_runs_past_the_end_of_text():
    free, _ = tiny().generate([1, 2, 3], 12, temperature=0)
    eos = free[4]
    model = tiny(eos=eos)
    stopped, _ = model.generate([1, 2, 3], 12, temperature=0)
    assert stopped == free[:free.index(eos) + 1]
    assert model.generate([1, 2, 3], 12, temperature=0, ignore_eos=True)[0] == free
    stop = free[2] if free[2] != eos else free[1]
    assert model.generate([1, 2, 3], 12, temperature=0, ignore_eos=True, stop_ids=[stop])[0] == \
        free[:free.index(stop) + 1]


@pytest.mark.parametrize("name, value", [
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", "0.1"), ("presence_penalty", 2.5), ("presence_penalty", True),
    ("frequency_penalty", -2.01), ("frequency_penalty", float("nan")), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")), ("logit_bias", {3: 100.5}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"3": 1.0}), ("logit_bias", [1]), ("logit_bias", {3: "x"}),
    ("stop_ids", [1.5]), ("stop_ids", "1"), ("stop_ids", [-1]), ("stop_ids", [True]), ("ignore_eos", 1),
    ("temperature", -1), ("top_p", 0), ("top_k", 0)])
def test_bad_options_are_refused_by_name(name, value):
    with pytest.raises(OptionError, match=name) as e:
        SamplingOptions(**{name: value})
    assert e.value.name == name
    with pytest.raises(ValueError, match=name):
        tiny().generate([1], 2, **{name: value})


def test_token_ids_outside_the_vocabulary_are_refused_by_name():
    model = tiny()
    for name, value in (("logit_bias", {37: 1.0}), ("stop_ids", [37])):
        with pytest.raises(OptionError, match=f"{name}: token id 37 is not in the vocabulary") as e:
            model.generate([1], 2, **{name: value})
        assert e.value.name == name


def test_argmax_is_torchs_first_maximum_with_nan_taken_as_largest():
    """``sampling.argmax`` (numpy's for float CPU tensors) against torch's argmax: ties (the first), NaN (picked, so
    refused after), -inf rows, strided views, float64, bfloat16 (torch's own), inference tensors, keepdim."""
    from subquad.models.sampling import argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 1000, generator=g)
    x[0, 0, [10, 500]] = 50.0                                          # a tie: the first
    x[1, 2, 7] = float("nan")
    x[1, 2, 900] = float("nan")
    x[2, 1] = float("-inf")
    for t in (x, x.transpose(0, 1), x[..., ::3], x.double()):
        assert torch.equal(argmax(t), t.argmax(-1))
        assert torch.equal(argmax(t, keepdim=True), t.argmax(-1, keepdim=True))
    assert argmax(x)[0, 0] == 10 and argmax(x)[1, 2] == 7
    v = torch.randn(50, generator=g)                                   # one row: a 0-d pick
    assert argmax(v).shape == () and int(argmax(v)) == int(v.argmax()) == sample(v, temperature=0)
    n = torch.randn(3, 40, generator=g)._neg_view()                   # a tensor with the neg bit
    assert torch.equal(argmax(n), n.argmax(-1))
    b = x.bfloat16()
    assert torch.equal(argmax(b), b.argmax(-1))
    with torch.inference_mode():
        y = torch.randn(2, 50280, generator=g)
        assert torch.equal(argmax(y), y.argmax(-1))
    with pytest.raises(ValueError, match="NaN"):
        sample_batch(x[1], temperature=0)


def test_argmax_of_float_cpu_tensors_goes_through_numpy(monkeypatch):
    from subquad.models.sampling import argmax

    x = torch.randn(4, 1000)
    want = x.argmax(-1)
    monkeypatch.setattr(torch.Tensor, "argmax", lambda *a, **k: pytest.fail("torch's argmax was called"))
    assert torch.equal(argmax(x), want)
