"""benchmarks/bench_passkey.py: the curriculum's loss is the model's own loss on the answer tokens, and its runs are
run folders ``subquad eval --passkey`` reads."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.bench_passkey import curriculum_model, main, parse_stages, train_curriculum
from subquad.tasks.passkey import passkey_batch


def encode(text):
    return [ord(c) for c in text]


def test_the_head_only_where_read_is_the_models_masked_loss():
    """The curriculum computes logits only at the answer tokens; the model's own loss (every position's hidden
    state through the chunked head, -100 ignored) must agree."""
    model = curriculum_model("gla,softmax", d_model=32, vocab=128, seed=0).double()
    x, y = passkey_batch(encode, 127, 2, random.Random(1))
    mask = y != -100
    h, _ = model._hidden(x)
    ours = torch.nn.functional.cross_entropy(model._logits(h[mask]), y[mask])
    assert torch.allclose(ours, model(x, targets=y), atol=1e-10)


def test_a_short_curriculum_trains_in_stages():
    model = curriculum_model("softmax,softmax", d_model=32, vocab=128, seed=0)
    before = model.embed.weight.detach().clone()
    curve = train_curriculum(model, encode, parse_stages("100:2,127:2"), batch=2, warmup=1, log=lambda m: None)
    assert [p["length"] for p in curve] == [100, 100, 127, 127] and all(0 <= p["token_accuracy"] <= 1 for p in curve)
    assert not torch.equal(before, model.embed.weight) and not model.training
    with pytest.raises(ValueError, match="stages"):
        parse_stages("16:3")


def test_quick_curriculum_saves_runs_the_cli_sweeps(tmp_path, corpus, capsys):
    from subquad.cli import main as cli

    runs = tmp_path / "runs"
    assert main(["curriculum", "--quick", "--models", "gla", "--data", str(corpus), "--runs", str(runs)]) == 0
    capsys.readouterr()
    assert cli(["eval", "--run", str(runs / "gla"), "--passkey", "--lengths", "128", "--depths", "0,1",
                "--trials", "1"]) == 0
    assert "| 128 |" in capsys.readouterr().out
