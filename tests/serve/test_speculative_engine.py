"""Speculation in the serving engine (``Engine(speculative="ngram")``, or a draft model): inside the continuous
batch every request's tokens still equal ``generate`` run alone - greedy, seeded sampling, penalties, several
choices - while rows accept different numbers of drafts in the same verification; logprobs equal the plain
engine's."""

import random

import pytest
import torch

from subquad.models import LanguageModel
from subquad.serve import Engine, SamplingParams
from tests.serve.helpers import V, config
from tests.serve.test_engine import EXTRA, alone, run_all

pytestmark = pytest.mark.usefixtures("unpaced")     # counts verifications: no pacing by wall time


def model_of(kind):
    torch.manual_seed(0)
    return LanguageModel(config(kind)).double().eval()      # float64: no near-tie between a k-token forward and steps


def repetitive(n, seed):
    """Requests whose prompts repeat a phrase (prompt lookup finds it) with greedy and sampled options."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(V) for _ in range(rng.choice([3, 5, 8]))]
        prompt = (phrase * 4)[:rng.choice([7, 12, 25, 33])]
        greedy = i % 3 != 2
        out.append((prompt, SamplingParams(max_tokens=rng.choice([5, 17, 30]), temperature=0 if greedy else 0.9,
                                           seed=500 + i, top_k=rng.choice([None, 20]), **rng.choice(EXTRA))))
    return out


@pytest.mark.parametrize("kind", ["mamba2", "bamba"])
def test_every_stream_equals_generate_alone_and_rows_accept_different_counts(kind):
    model = model_of(kind)
    reqs = repetitive(14, seed=3)
    engine = Engine(model, max_batch=5, prefill_chunk=16, state_cache_mb=0, speculative="ngram", draft_tokens=4)
    accepted = []
    verify = engine._emit_drafted

    def counting(seq, rows, drafts):
        n = verify(seq, rows, drafts)
        accepted.append((len(drafts), n))
        return n
    engine._emit_drafted = counting
    seqs = run_all(engine, reqs)
    for (prompt, p), seq in zip(reqs, seqs):
        assert seq.tokens == alone(model, prompt, p), (prompt, p)
    c = engine.counters
    assert c["verifications"] > 0 and 0 < c["accepted"] < c["drafted"], c
    # the same verification kept several tokens of one row and one of another (a ragged rollback)
    assert any(n > 1 for d, n in accepted) and any(d and n == 1 for d, n in accepted)
    assert c["generated_tokens"] == sum(len(s.tokens) for s in seqs)
    assert c["decode_steps"] < c["generated_tokens"] - len(reqs)       # fewer forwards than tokens decoded
    if kind == "mamba2":                                   # what /metrics shows a scraper
        pytest.importorskip("fastapi")
        from subquad.serve.api import metrics_text

        text = metrics_text(engine.metrics())
        for name in ("verifications", "drafted", "accepted"):
            assert f"\nsubquad_{name}_total {c[name]}\n" in text


def test_a_large_batch_drafts_fewer_tokens_per_row(monkeypatch):
    """Each row drafts at most ``draft_budget`` tokens at the batch's size (C_ROWS // rows - 1, at least one): 8
    running rows verify 2 tokens each; streams equal generate alone."""
    from subquad.serve import engine as engine_mod

    model = model_of("bamba")
    widths, real = [], engine_mod.verify
    monkeypatch.setattr(engine_mod, "verify", lambda m, ids, *a, **k: widths.append(ids.shape) or real(m, ids, *a, **k))
    reqs = [(prompt, SamplingParams(max_tokens=20, temperature=0)) for prompt, _ in repetitive(10, seed=5)]
    engine = Engine(model, max_batch=8, state_cache_mb=0, speculative="ngram", draft_tokens=4)
    seqs = run_all(engine, reqs)
    for (prompt, p), seq in zip(reqs, seqs):
        assert seq.tokens == alone(model, prompt, p)
    assert all(t - 1 <= max(1, 16 // b - 1) for b, t in widths), widths
    assert (8, 2) in widths and any(t == 5 for b, t in widths if b <= 3), widths    # few rows: all 4 drafts


def test_a_row_running_alone_asks_the_pacer_by_its_match_length(monkeypatch):
    """A row of prompt lookup running alone drafts first and the pacer is asked under the n its draft matched (the
    longest n <= 3 whose tail of the row's tokens occurred before, found again here from them), as generate's one
    row; streams equal generate alone. Two rows at once: the pacer is asked first, without a key."""
    from subquad.models.speculative import Pacer, PromptLookup

    asked, found = [], []
    monkeypatch.setattr(Pacer, "want", lambda self, key=None: asked.append(key) or True)
    real = PromptLookup.draft

    def draft(self, k):
        h = self.tokens
        found.append(max([0] + [n for n in (1, 2, 3) if any(h[s:s + n] == h[-n:] for s in range(len(h) - n))]))
        return real(self, k)
    monkeypatch.setattr(PromptLookup, "draft", draft)
    model = model_of("bamba")
    reqs = [(prompt, SamplingParams(max_tokens=20, temperature=0)) for prompt, _ in repetitive(2, seed=11)]
    engine = Engine(model, max_batch=1, state_cache_mb=0, speculative="ngram", draft_tokens=4)
    seqs = run_all(engine, reqs)
    for (prompt, p), seq in zip(reqs, seqs):
        assert seq.tokens == alone(model, prompt, p)
    assert len(asked) >= 3 and asked == [n for n in found if n] and engine.counters["verifications"] > 0
    asked.clear()
    engine = Engine(model, max_batch=2, state_cache_mb=0, speculative="ngram", draft_tokens=4)
    seqs = run_all(engine, reqs, per_step=2)
    assert asked and None in asked


def test_choices_and_logprobs_equal_the_plain_engine():
    model = model_of("bamba")
    start = [5, 9, 14, 2, 7]
    seen = start + model.generate(start, 20, temperature=0)[0] + start     # its own continuation, then the start
    reqs = [(seen, SamplingParams(max_tokens=20, temperature=0, logprobs=3)),
            (seen, SamplingParams(max_tokens=20, temperature=0.5, seed=11, n=3, logprobs=0))]

    def runner(speculative):
        engine = Engine(model, max_batch=4, state_cache_mb=0, speculative=speculative)
        got = []
        for r, (prompt, p) in enumerate(reqs):
            engine.submit(prompt, p,
                          on_event=lambda e, r=r: got.append((r, e.index, e.token, e.logprob, e.top_logprobs)))
        while engine.step():
            pass
        return sorted(got, key=lambda x: (x[0], x[1])), engine.counters
    (plain, _), (spec, c) = runner(None), runner("ngram")
    assert c["accepted"] > 0
    assert [x[:3] for x in spec] == [x[:3] for x in plain]
    for a, b in zip(spec, plain):
        assert (a[3] is None) == (b[3] is None)
        if a[3] is not None:
            assert a[3] == pytest.approx(b[3], abs=1e-9)
            assert [t for t, _ in a[4]] == [t for t, _ in b[4]]


def draft_state_is_a_prefill(engine, draft):
    """Every running row's draft state equals the draft model prefilled on the tokens that row's state covers
    (its prompt and its tokens but the last): the next-token logits of both, fed the row's last token."""
    from subquad.models.rows import select_rows

    engine.draft.catch_up()                         # the plain steps' tokens, prefilled at the next proposal
    for i, seq in enumerate(engine.running):
        row = select_rows(engine.draft.state, [i])
        got, _ = draft.step(torch.tensor([seq.tokens[-1]]), row)
        want, _ = draft.prefill(torch.tensor([seq.prompt + seq.tokens]), logits="last")
        torch.testing.assert_close(got, want.view(1, -1), rtol=0, atol=1e-9)


@pytest.mark.parametrize("kind,draft_kind", [("bamba", "same"), ("mamba2", "bamba")])
def test_a_draft_model_drafts_for_rows_that_join_and_leave_and_every_stream_equals_generate_alone(kind, draft_kind):
    """A draft model in the batch (``serve.drafting.BatchDraft``): a hybrid drafting for itself (every greedy draft
    accepted, sampled ones in part: its KV cache rolled back by a different count per row) and an unrelated
    hybrid drafting for a Mamba-2 model (its drafts rejected).
    Requests join a batch already decoding and leave at different times; each equals generate alone, and after
    every step each row's draft state equals a prefill of the tokens its row's state covers."""
    model = model_of(kind)
    if draft_kind == "same":
        draft = model
    else:
        torch.manual_seed(1)
        draft = LanguageModel(config(draft_kind)).double().eval()
    reqs = repetitive(9, seed=5)
    engine = Engine(model, max_batch=4, prefill_chunk=16, state_cache_mb=0, speculative=draft, draft_tokens=3)
    seqs, steps = [], 0
    for i, (prompt, p) in enumerate(reqs):
        seqs.append(engine.submit(prompt, p))
        if i % 3 == 2:
            engine.step()
    while engine.step():
        steps += 1
        if steps % 4 == 1 and engine.running:
            assert engine.draft.rows == len(engine.running)
            draft_state_is_a_prefill(engine, draft)
    for (prompt, p), seq in zip(reqs, seqs):
        assert seq.tokens == alone(model, prompt, p), (prompt, p)
    c = engine.counters
    assert c["verifications"] > 0, c
    if draft_kind == "same":
        assert 0 < c["accepted"] < c["drafted"] and c["decode_steps"] < c["generated_tokens"] - len(reqs), c
    assert engine.draft.state is None and engine.draft.rows == 0


@pytest.mark.usefixtures("unpaced")
def test_a_draft_model_drafts_within_each_rows_grammar():
    """Rows with a response_format beside a plain one, a draft model (the model itself) drafting: every stream
    equals ``generate`` alone, and the constrained rows' drafts are held to their grammars (most kept; drafted
    blind, the grammar refused nearly all)."""
    pytest.importorskip("llguidance")
    from tests.models.test_constrain import FORMAT, tiny_json_model

    tok, model = tiny_json_model()
    prompt = tok.encode("a b").ids
    reqs = [SamplingParams(max_tokens=40, temperature=0, response_format=FORMAT),
            SamplingParams(max_tokens=40, temperature=0, response_format=FORMAT),
            SamplingParams(max_tokens=8, temperature=0.9, seed=6)]
    engine = Engine(model, tok, state_cache_mb=0, speculative=model, draft_tokens=3)
    seqs = run_all(engine, [(prompt, p) for p in reqs])
    for seq, p in zip(seqs, reqs, strict=True):
        assert seq.tokens == model.generate(prompt, p.max_tokens, temperature=p.temperature, seed=p.seed,
                                            response_format=p.response_format, tokenizer=tok)[0]
    c = engine.counters
    assert c["verifications"] > 0 and c["accepted"] >= 0.6 * c["drafted"]


def test_speculation_options_are_checked_by_name():
    model = model_of("mamba2")
    with pytest.raises(ValueError, match="speculative='mtp': this model has no MTP head"):
        Engine(model, speculative="mtp")
    with pytest.raises(ValueError, match="speculative must be"):
        Engine(model, speculative="medusa")
    with pytest.raises(ValueError, match="draft_tokens"):
        Engine(model, speculative="ngram", draft_tokens=0)
    torch.manual_seed(0)
    other = LanguageModel(config("mamba2").__class__(**{**config("mamba2").__dict__, "vocab_size": V + 4}))
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(model, speculative=other.double())


def test_serve_takes_speculative_and_draft_tokens(tmp_path, capsys):
    from subquad.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--model", "m", "--speculative", "ngram", "--draft-tokens", "6"])
    assert (args.speculative, args.draft_tokens) == ("ngram", 6)
    args = build_parser().parse_args(["serve", "--model", "m", "--speculative", str(tmp_path)])
    assert args.speculative == str(tmp_path)
    folder = tmp_path / "m"
    model_of("mamba2").float().save_pretrained(folder)
    assert main(["serve", "--model", str(folder), "--speculative", "mtp"]) != 0
    assert "--speculative mtp" in (err := capsys.readouterr().err) and "no multi-token-prediction head" in err
    assert main(["serve", "--model", str(folder), "--speculative", str(tmp_path / "nowhere")]) != 0
    assert "nowhere is neither" in capsys.readouterr().err
    assert main(["serve", "--model", str(folder), "--draft-tokens", "6"]) != 0          # it would change nothing
    assert "--draft-tokens goes with --speculative" in capsys.readouterr().err


def test_a_draft_model_with_another_tokenizer_of_the_same_size_is_refused(monkeypatch):
    import argparse

    from tokenizers import Tokenizer, models

    import subquad.cli.generate as cli

    target = model_of("mamba2")
    ours, theirs = (Tokenizer(models.WordLevel({f"w{i + j}": i for i in range(V)}, unk_token="w0")) for j in (0, 1))
    monkeypatch.setattr(cli, "load_model", lambda args: (model_of("mamba2"), theirs))
    args = argparse.Namespace(speculative="draft", run=None, model="m")
    with pytest.raises(ValueError, match="its tokenizer is not the model's"):
        cli.load_draft(args, target, ours)
    monkeypatch.setattr(cli, "load_model", lambda args: (model_of("mamba2"), ours))
    assert isinstance(cli.load_draft(args, target, ours), LanguageModel)


def test_drafts_stop_at_the_learned_positions_end(monkeypatch):
    """Rows padded to the longest draft never pass max_context: with a drafter that always drafts 6 tokens (and
    never pauses), a model with learned positions serves two rows up to its last position, each as generate
    alone (a padded row past the last position would index past the position table: every row "error")."""
    from dataclasses import replace

    from subquad.models.speculative import PromptLookup
    from subquad.serve import speculation

    monkeypatch.setattr(speculation, "MAX_PAUSE", 0)
    monkeypatch.setattr(PromptLookup, "draft", lambda self, k: [self.tokens[-1]] * k)
    torch.manual_seed(0)
    model = LanguageModel(replace(config("bamba"), pos_emb="learned", context_length=48)).double().eval()
    engine = Engine(model, max_batch=2, max_context=48, state_cache_mb=0, speculative="ngram", draft_tokens=6)
    long, short = [5, 9, 14, 2, 7] * 8, [5, 9, 14]
    a = engine.submit(long, SamplingParams(max_tokens=48 - len(long), temperature=0))
    b = engine.submit(short, SamplingParams(max_tokens=48 - len(short), temperature=0))
    while engine.step():
        pass
    assert a.finish_reason == b.finish_reason == "length"
    assert a.tokens == model.generate(long, 48 - len(long), temperature=0)[0]
    assert b.tokens == model.generate(short, 48 - len(short), temperature=0)[0]
    assert engine.counters["verifications"] >= 8


@pytest.mark.paced
def test_the_batch_takes_plain_steps_while_verifying_costs_more(monkeypatch):
    """A verification made slow on purpose (25 ms more): the engine soon steps plainly; the same tokens."""
    from subquad.serve import engine as engine_mod
    from tests.models.test_speculative import slow_verification

    model = model_of("mamba2")
    reqs = [(([3, 8, 1] * 5)[:n], SamplingParams(max_tokens=40, temperature=0)) for n in (7, 11, 15)]
    plain = [s.tokens for s in run_all(Engine(model, max_batch=3, state_cache_mb=0), reqs)]
    slow_verification(monkeypatch, engine_mod)
    engine = Engine(model, max_batch=3, state_cache_mb=0, speculative="ngram", draft_tokens=3)
    assert [s.tokens for s in run_all(engine, reqs)] == plain
    c = engine.counters
    assert 0 < c["verifications"] < c["decode_steps"] / 3, c


def test_under_compile_decode_the_verification_is_compiled_and_every_stream_equals_generate_alone(tmp_path):
    """With ``compile_decode`` the batch verifies through the compiled verification (drafts padded to
    ``draft_tokens``: one shape), the rows keeping their states per token and accepting different counts; the
    greedy streams equal ``generate`` alone."""
    from subquad.models.decode import compile_decode

    model = model_of("mamba2")
    # seed 9: prompts whose drafts this model accepts (13 of 24 eagerly), in different counts in 7 steps
    reqs = [(prompt, SamplingParams(max_tokens=24, temperature=0)) for prompt, _ in repetitive(2, seed=9)]
    want = [alone(model, prompt, p) for prompt, p in reqs]
    compile_decode(model, cache=tmp_path)
    # two drafts: the graph unrolls the recurrences over its 3 tokens (each token's more to build)
    engine = Engine(model, max_batch=2, prefill_chunk=64, state_cache_mb=0, speculative="ngram", draft_tokens=2)
    kept = {}                                             # step -> tokens each row kept
    verify = engine._emit_drafted

    def counting(seq, rows, drafts):
        n = verify(seq, rows, drafts)
        kept.setdefault(engine.counters["decode_steps"], []).append(n)
        return n
    engine._emit_drafted = counting
    seqs = run_all(engine, reqs, per_step=2)
    assert [s.tokens for s in seqs] == want
    assert engine.counters["verifications"] > 0
    assert any(len(set(ns)) > 1 for ns in kept.values() if len(ns) == 2), kept     # one step, two counts
    # always draft_tokens + 1 tokens a row; two rows, then one (the other finished first, having kept more)
    assert model._decode_step.verifier().shapes == {(2, 3), (1, 3)}


def test_the_mtp_head_drafts_for_each_row_from_the_hidden_states_it_consumed(tmp_path, monkeypatch):
    """speculative="mtp": a drafter per row, fed the model's hidden states of what its row consumed - from the
    prompt tokens it prefilled (a request resumed from the prefix cache drafts from the rest) and every kept
    verified position; each choice of a request its own. Every stream equals generate alone, and every first
    draft is the head's argmax at the pair (hidden state at the last consumed position, the token fed) over the
    row's pairs, computed afresh."""
    pytest.importorskip("transformers")
    from subquad.models import from_pretrained
    from subquad.models.speculative import MTPDrafter, capture_hidden
    from tests.models.test_mtp import _with_mtp

    _, _, folder = _with_mtp(tmp_path)
    model, _ = from_pretrained(folder, dtype=torch.float64)
    rng = random.Random(7)
    V = model.config.vocab_size
    shared = [rng.randrange(V) for _ in range(10)]
    reqs = [(shared + [rng.randrange(V) for _ in range(n)],
             SamplingParams(max_tokens=m, temperature=0 if i % 2 == 0 else 0.8, seed=40 + i))
            for i, (n, m) in enumerate([(3, 14), (6, 9), (2, 12), (5, 11)])]
    reqs[1] = (reqs[1][0], SamplingParams(max_tokens=9, temperature=0.8, seed=41, n=2))   # a drafter per choice
    engine = Engine(model, max_batch=3, prefill_chunk=8, prefix_block=4, speculative="mtp", draft_tokens=3)
    proposals, propose = [], MTPDrafter.propose

    def recording(self, feed, active, k):
        drafts = propose(self, feed, active, k)
        seq = next(s for s in engine.running if s.mtp is self)
        proposals.append((seq.cached_tokens, seq.prompt + seq.tokens, drafts[0][0]))
        return drafts
    monkeypatch.setattr(MTPDrafter, "propose", recording)
    seqs = run_all(engine, reqs, per_step=2)
    for (prompt, p), seq in zip(reqs, seqs):
        for c in seq.choices:
            assert c.tokens == alone(model, prompt, p, c.index), (prompt, p, c.index)
    assert len(seqs[1].choices) == 2 and engine.counters["verifications"] > 0
    assert any(s.cached_tokens > 0 for s in seqs)
    assert any(c > 0 for c, _, _ in proposals) and any(c == 0 for c, _, _ in proposals)
    with torch.no_grad():
        for start, full, first in proposals:                # full: consumed tokens and the one fed
            with capture_hidden(model) as seen:
                model.prefill(torch.tensor([full[:-1]]))
            h = model.norm(seen[-1])[:, start:]
            logits, _, _ = model.mtp(model, h, torch.tensor([full[start + 1:]]))
            assert first == logits[0, -1].argmax().item()
