"""Structured output (``models.constrain``): ``generate(..., response_format=...)`` holds each row to a JSON
schema or any JSON object - the outputs parse and satisfy the schema; greedy decoding equals a loop written
here that masks the full forward's logits with a fresh matcher fed the output so far; bad formats are refused
by name."""

from __future__ import annotations

import json

import pytest
import torch

llguidance = pytest.importorskip("llguidance")   # the `grammar` extra installs it (make test requires it)

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from subquad.models import LanguageModel, ModelConfig  # noqa: E402
from subquad.models.constrain import FormatError, Grammar  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99},
                                          "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "color"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def tok_and_model():
    return tiny_json_model()


def tiny_json_model():
    """(a byte-level BPE tokenizer trained on a little JSON, a float64 hybrid model of its vocabulary)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"ok": true, "n": 42, "color": "red"}', '{"a": [1, 2.5, null, false]}'] * 4, trainer)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=2, pattern="mamba2,softmax",
                      context_length=256)
    return tok, LanguageModel(cfg).double().eval()


def test_sampled_rows_satisfy_the_schema(tok_and_model):
    tok, model = tok_and_model
    prompts = [tok.encode("a b").ids, tok.encode("{").ids, tok.encode("x y z").ids]
    out, _ = model.generate(prompts, 60, temperature=1.0, seed=3, response_format=FORMAT, tokenizer=tok)
    for ids in out:
        assert len(ids) < 60                                          # ended by the grammar, not the budget
        obj = json.loads(tok.decode(ids))
        assert set(obj) == {"ok", "n", "color"} and isinstance(obj["ok"], bool)
        assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 99 and obj["color"] in ("red", "green", "blue")


def test_json_object_mode_gives_an_object(tok_and_model):
    tok, model = tok_and_model
    closing = {t: 6.0 for s, t in tok.get_vocab().items() if s in ('"', "}", '"}')}   # strings and objects end soon
    out, _ = model.generate([tok.encode("hi").ids] * 2, 120, temperature=1.0, seed=1, logit_bias=closing,
                            response_format={"type": "json_object"}, tokenizer=tok)
    for ids in out:
        assert isinstance(json.loads(tok.decode(ids)), dict)


def test_greedy_equals_masking_each_full_forward(tok_and_model):
    """The reference: the whole sequence through the model each step, a fresh matcher fed the output so far,
    the argmax among the tokens it allows."""
    tok, model = tok_and_model
    prompt = tok.encode("x").ids
    got, _ = model.generate(prompt, 40, temperature=0, response_format=FORMAT, tokenizer=tok)
    g = Grammar(FORMAT, tok, model.config.vocab_size)
    want = []
    for _ in range(40):
        m = g.matcher()
        for t in want:
            m.consume(t)
        if m.done:
            break
        with torch.no_grad():
            logits = model(torch.tensor([prompt + want]))[0, -1]
        want.append(int(logits.masked_fill(~m.allowed(), float("-inf")).argmax()))
    assert got == want
    assert json.loads(tok.decode(got))["color"] in ("red", "green", "blue")


@pytest.mark.parametrize("bad,match", [({"type": "xml"}, "response_format must be"),
                                       ({"type": "json_schema", "json_schema": 3}, "json_schema must be"),
                                       ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
                                        "schema is not usable"),
                                       ({"type": "json_schema", "json_schema": {"schema": False}},
                                        "json_schema must be")])
def test_bad_formats_are_refused_by_name(tok_and_model, bad, match):
    tok, model = tok_and_model
    with pytest.raises(FormatError, match=match):
        model.generate([1, 2], 3, response_format=bad, tokenizer=tok)


def test_a_schema_of_true_is_no_schema():
    """JSON Schema's ``true`` allows anything: as no schema, any object (it was refused, no schema accepted)."""
    from subquad.models.constrain import check_format

    for spec in ({"schema": True}, {"name": "x"}, {"schema": {}}):
        assert check_format({"type": "json_schema", "json_schema": spec}) == {"type": "object"}


def test_whitespace_between_json_tokens_is_llama_cpps(tok_and_model):
    """Between JSON's tokens: nothing, one space, or one or two newlines and an indent of up to 20 (llama.cpp's
    json_schema_to_grammar ``space``) - the JSON models write (``{"ok": true}``, indented) - but no run of spaces
    and no third newline; a schema's own x-guidance options replace the rule."""
    tok, model = tok_and_model

    def takes(text, fmt=FORMAT):
        m = Grammar(fmt, tok, model.config.vocab_size).matcher()
        for t in tok.encode(text).ids:
            if m.done or not bool(m.allowed()[t]):
                return False
            m.consume(t)
        return True

    for text in ('{"ok":true,"n":1,"color":"red"}', '{"ok": true, "n": 1, "color": "red"}',
                 '{\n  "ok": true,\n  "n": 1,\n\n\t"color" : "red"\n}', '{ "ok":true,"n":1,"color":"red"' + " " * 1):
        assert takes(text), text
    for text in ('{"ok":  true', '{\n\n\n"ok"', '{' + "\n" + " " * 21 + '"ok"', '{"ok":\ttrue'):
        assert not takes(text), text
    flexible = {"type": "json_schema", "json_schema": {"schema": {**SCHEMA, "x-guidance": {"whitespace_flexible": True}}}}
    assert takes('{"ok":     true', flexible)


def test_a_format_needs_the_tokenizer(tok_and_model):
    tok, model = tok_and_model
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        model.generate([1, 2], 3, response_format={"type": "json_object"})
    assert model.generate([1, 2], 3, temperature=0, response_format={"type": "text"})[0] == \
        model.generate([1, 2], 3, temperature=0)[0]


@pytest.mark.usefixtures("unpaced")
@pytest.mark.parametrize("drafter", ["ngram", "itself"])
def test_speculation_under_a_format_gives_the_plain_tokens(tok_and_model, drafter):
    """Each verified position held to the grammar after the drafts before it (``RowMatcher.along``): greedy
    rows (prompts of different lengths, one alone) equal plain greedy decoding under the same format - by
    prompt lookup over prompts holding JSON (drafts kept: runs that reach the grammar's end inside a
    verification), and by the model drafting for itself within each row's grammar (every draft kept up to the
    grammar's end: 48 of 56 where a grammar-blind draft model kept 1 of 84); seeded
    sampled rows still parse under the schema."""
    tok, model = tok_and_model
    spec = "ngram" if drafter == "ngram" else model
    prompts = [tok.encode('{"ok":true,"n":33,"color":"blue"} {"ok":true,"n":3').ids, tok.encode("x").ids,
               tok.encode('{"ok":false,"n":33,"color":"blue"}').ids]
    # compact JSON, as the prompts hold it (the random model's greedy text is then what prompt lookup finds)
    compact = {"type": "json_schema", "json_schema": {"schema": {**SCHEMA,
                                                                 "x-guidance": {"whitespace_flexible": False}}}}
    for rows in (prompts, prompts[0]):
        want, _ = model.generate(rows, 50, temperature=0, response_format=compact, tokenizer=tok)
        got, _ = model.generate(rows, 50, temperature=0, response_format=compact, tokenizer=tok,
                                speculative=spec, draft_tokens=4)
        assert got == want
        stats = model.speculation_stats
        assert stats.verifications > 0 and stats.accepted >= stats.drafted // 4
        if drafter == "itself":          # its greedy text within the grammar is the target's (but past its end)
            assert stats.accepted >= 0.8 * stats.drafted > 0
    out, _ = model.generate(prompts, 60, temperature=1.0, seed=5, response_format=FORMAT, tokenizer=tok,
                            speculative=spec, draft_tokens=3)
    for ids in out:
        assert len(ids) < 60 and set(json.loads(tok.decode(ids))) == {"ok", "n", "color"}


def test_the_cli_flags(tok_and_model, tmp_path, capsys, monkeypatch):
    """``subquad generate --json-schema FILE`` prints JSON valid under it; --json an object; a bad file is named."""
    import subquad.cli.generate as cli
    from subquad.cli import main

    tok, model = tok_and_model
    monkeypatch.setattr(cli, "load_model", lambda args, need_tokenizer=None: (model, tok))
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    argv = ["generate", "--run", str(tmp_path), "--prompt", "x", "--max-new-tokens", "60", "--temperature", "0"]
    assert main(argv + ["--json-schema", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip()[1:])["color"] in ("red", "green", "blue")
    assert main(argv + ["--json-schema", str(tmp_path / "s.json"), "--speculative", "ngram"]) == 0
    said = capsys.readouterr()
    assert said.out == out and "cut off" not in said.err               # the same text, speculating
    short = [a if a != "60" else "5" for a in argv]                     # too few tokens: an incomplete object, said
    assert main(short + ["--json-schema", str(tmp_path / "s.json")]) == 0
    said = capsys.readouterr()
    assert said.out.strip() and "JSON was cut off by --max-new-tokens 5 before it was complete" in said.err
    (tmp_path / "bad.json").write_text("{")
    assert main(argv + ["--json-schema", str(tmp_path / "bad.json")]) != 0
    assert "--json-schema" in capsys.readouterr().err
