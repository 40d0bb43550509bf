"""Passkey retrieval: prompts of exact length with the needle at its depth, a sweep whose accuracy follows what
a model can still see, and ``subquad eval --passkey`` writing its table and heat map."""

from __future__ import annotations

import json
import re

import pytest
import torch

from subquad.models.state import ModelState
from subquad.tasks.passkey import NEEDLE, QUESTION, passkey_prompt, passkey_sweep


def encode(text):                                   # one token per character: positions are easy to check
    return [ord(c) for c in text]


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_the_prompt_has_its_length_and_the_needle_at_its_depth(depth):
    ids, want, at = passkey_prompt(encode, 700, depth, 48213)
    needle = encode(NEEDLE.format(key=48213))
    assert len(ids) == 700 and want == encode(" 48213")
    assert ids[at:at + len(needle)] == needle and ids[-len(QUESTION):] == encode(QUESTION)
    room = 700 - len(needle) - len(QUESTION)
    assert at == round(depth * room)
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(encode, 700, 1.5, 1)
    with pytest.raises(ValueError, match="length 50"):
        passkey_prompt(encode, 50, 0.5, 1)


class Window(torch.nn.Module):
    """A stand-in model that sees only the last ``window`` tokens (a fixed state) and answers the pass key when
    the needle's first sentence is among them: what the sweep must score right exactly then."""

    def __init__(self, window):
        super().__init__()
        self.embed = torch.nn.Embedding(1, 1)
        self.window = window

    @staticmethod
    def _logits(seen, n_out):
        m = re.search(r"The pass key is (\d{5})\.", "".join(map(chr, seen)))   # the needle's first sentence
        out = torch.zeros(200)
        out[ord((" " + (m.group(1) if m else "00000"))[min(n_out, 5)])] = 1
        return out

    def prefill(self, idx, state=None):
        seen = (state[0]["seen"].tolist() if state else []) + idx[0].tolist()
        seen = seen[-self.window:]
        return self._logits(seen, 0).view(1, 1, -1), ModelState([{"seen": torch.tensor(seen), "out": torch.tensor(0)}])

    def step(self, tokens, state):
        n = int(state[0]["out"]) + 1
        seen = (state[0]["seen"].tolist() + tokens.tolist())[-self.window:]
        return self._logits(seen, n).view(1, -1), ModelState([{"seen": torch.tensor(seen), "out": torch.tensor(n)}])


def test_the_sweep_scores_what_the_model_can_still_see():
    window = 400
    rows = passkey_sweep(Window(window), encode, [300, 600, 1200], [0.0, 0.5, 1.0], trials=2, piece=128)
    for r in rows:
        _, _, at = passkey_prompt(encode, r["length"], r["depth"], 12345)
        visible = r["length"] - at <= window                 # the needle's start is within the last window tokens
        assert r["accuracy"] == (1.0 if visible else 0.0), r
        assert r["state_bytes"] > 0


def test_cli_passkey_writes_table_and_heat_map(tmp_path, capsys, corpus):
    from subquad.cli import main

    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2",
                 "--n-heads", "2", "--context", "32", "--pattern", "gla,softmax", "--steps", "2", "--batch-size", "2",
                 "--out", str(run), "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "pk"
    assert main(["eval", "--run", str(run), "--passkey", "--lengths", "128,256", "--depths", "0,1", "--trials", "1",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 128 |" in text and "| 256 |" in text and "state bytes" in text
    rows = json.loads((out / "passkey.json").read_text())["rows"]
    assert [(r["length"], r["depth"]) for r in rows] == [(128, 0.0), (128, 1.0), (256, 0.0), (256, 1.0)]
    assert (out / "passkey.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "--run", str(run), "--passkey", "--depths", "2"]) == 2


def test_a_training_batch_targets_the_answer_alone():
    import random

    from subquad.tasks.passkey import passkey_batch

    x, y = passkey_batch(encode, 127, 3, random.Random(0), pad=7)
    assert x.shape == y.shape == (3, 127 + 6 - 1)                     # " 12345": 6 characters, one token each
    rng = random.Random(0)
    for b in range(3):
        ids, want, _ = passkey_prompt(encode, 127, rng.random(), rng.randrange(10000, 100000))   # the same draws
        assert x[b].tolist() == ids + want[:-1]
        assert y[b, 126:].tolist() == want and (y[b, :126] == -100).all()   # the question's end predicts the key


def test_repeat_also_targets_the_keys_copy_inside_the_needle():
    import random

    from subquad.tasks.passkey import passkey_batch

    x, y = passkey_batch(encode, 127, 2, random.Random(3), repeat=True)
    plain = passkey_batch(encode, 127, 2, random.Random(3))[1]
    for b in range(2):
        extra = ((y[b] != -100) & (plain[b] == -100)).nonzero().flatten().tolist()
        assert len(extra) == 6                                       # " 12345": the copy after "Remember it."
        copy = "".join(chr(t) for t in y[b, extra].tolist())
        key = "".join(chr(t) for t in y[b, 126:].tolist())
        assert copy == key
        text = "".join(chr(t) for t in x[b].tolist())
        assert text[extra[0] - len(" Remember it.") + 1:extra[0] + 1] == " Remember it."  # read after the 1st copy
