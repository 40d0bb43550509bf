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


def test_distance_split_sorts_cells_by_how_far_the_needle_is_from_the_end():
    from benchmarks.bench_passkey import distance_split

    rows = [{"length": 128, "depth": 0.0, "accuracy": 1.0},       # trained length: left out
            {"length": 1024, "depth": 1.0, "accuracy": 1.0},      # the needle 35 tokens from the end
            {"length": 1024, "depth": 0.9, "accuracy": 0.5},      # 1024 - round(0.9 * 989) = 134
            {"length": 1024, "depth": 0.5, "accuracy": 0.0}]      # 530
    split = distance_split(rows, {"needle": 23, "question": 12}, 256)
    assert split == {"near": 0.75, "near_cells": 2, "far": 0.0, "far_cells": 1}


def test_the_attention_probe_reads_the_hybrids_layer(tmp_path, corpus, capsys):
    runs = tmp_path / "runs"
    assert main(["curriculum", "--quick", "--models", "hybrid_nope", "--data", str(corpus), "--runs", str(runs)]) == 0
    assert main(["attention", "--quick", "--run", str(runs / "hybrid_nope"), "--lengths", "128"]) == 0
    out = capsys.readouterr().out
    assert "hybrid_nope 128 depth 0.0: weight on the key per head" in out
    with pytest.raises(ValueError, match="without positions"):
        main(["attention", "--quick", "--run", str(runs / "hybrid_nope"), "--layer", "0"])
