import json
import shutil

import pytest

from subquad.bench import compare
from subquad.cli import main


def _train(corpus, out, pattern):
    argv = ["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2", "--n-heads",
            "2", "--context", "32", "--pattern", pattern, "--steps", "4", "--batch-size", "2", "--eval-every", "2",
            "--ckpt-every", "4", "--out", str(out), "--no-progress"]
    assert main(argv) == 0


def test_compare_reads_each_run_and_overlays_the_curves(tmp_path, corpus, capsys):
    """``subquad compare``: each run's row from its own files (the held-out losses as metrics.jsonl logged them,
    tokens = steps x batch x context, parameters of the model its config builds), one PNG; runs of another
    tokenizer are compared with a warning; what is not a run is refused by name."""
    from subquad.models import LanguageModel, ModelConfig

    a, b = tmp_path / "gla", tmp_path / "mamba2"
    _train(corpus, a, "gla")
    _train(corpus, b, "mamba2")
    capsys.readouterr()
    png = tmp_path / "c.png"
    assert main(["compare", str(a), str(b), "--out", str(png), "--x", "tokens"]) == 0
    out = capsys.readouterr()
    assert png.stat().st_size > 10_000 and "warning" not in out.err
    for run in (a, b):
        logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        held = [r["heldout_loss"] for r in logged if "heldout_loss" in r]
        cfg = json.loads((run / "config.json").read_text())["model"]
        params = sum(p.numel() for p in LanguageModel(ModelConfig.from_dict(cfg)).parameters())
        row = next(line for line in out.out.splitlines() if line.split()[0] == run.name)
        assert f"{held[-1]:.4f}" in row and f"{min(held):.4f}" in row and f"{params:,}" in row
        assert f" {4 * 2 * 32:,} " in row                       # 4 steps of 2 sequences of 32 tokens
    c = tmp_path / "other"
    shutil.copytree(a, c)
    cfg = json.loads((c / "config.json").read_text())
    cfg["tokenizer_sha256"] = "0" * 64
    (c / "config.json").write_text(json.dumps(cfg))
    assert main(["compare", str(a), str(c), "--out", str(png)]) == 0
    assert "2 different tokenizers (gla; other)" in capsys.readouterr().err
    assert main(["compare", str(a), str(tmp_path)]) == 2
    assert f"{tmp_path} is not a training run folder" in capsys.readouterr().err
    (c / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="other has no metrics yet"):
        compare.read_run(c)


def test_the_training_curve_is_a_bias_corrected_moving_average():
    # weights (1 - f) f^(n - i), normalised over the points so far: the first point is itself
    assert compare.smoothed([(1, 1.0), (2, 0.0)], 0.5) == [(1, 1.0), (2, pytest.approx((0.5 * 1.0 + 1 * 0.0) / 1.5))]


def test_compare_counts_every_process_and_refuses_what_it_cannot_write(tmp_path, corpus, capsys):
    """Tokens read are the records' own (a step's over every data stream: a run resumed on another layout counts
    each step as it ran); the rate is all processes'; a folder named twice (another spelling), an --out in a
    missing folder and a run without its tokenizer's hash (an old run: unknown, not another) are handled."""
    a = tmp_path / "a"
    _train(corpus, a, "gla")
    lines = [json.loads(ln) for ln in (a / "metrics.jsonl").read_text().splitlines()]
    for r in lines[2:]:                                  # as if steps 3-4 ran on 2 data-parallel processes
        r["tokens"], r["tokens_per_s"] = 2 * 2 * 32, 100.0
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = compare.read_run(a)
    assert run["tokens"] == 2 * (2 * 32) + 2 * (2 * 2 * 32)
    assert run["tokens_at"] == {1: 64, 2: 128, 3: 256, 4: 384}
    assert sorted([200.0, 200.0] + [r["tokens_per_s"] for r in lines[:2]])[2] == run["tokens_per_s"]
    capsys.readouterr()
    assert main(["compare", str(a), str(tmp_path / "." / "a"), "--out", str(tmp_path / "c.png")]) == 2
    assert "named twice" in capsys.readouterr().err
    assert main(["compare", str(a), "--out", str(tmp_path / "no" / "c.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    old = tmp_path / "old"
    shutil.copytree(a, old)
    cfg = json.loads((old / "config.json").read_text())
    del cfg["tokenizer_sha256"]
    (old / "config.json").write_text(json.dumps(cfg))
    assert compare.mismatches([compare.read_run(a), compare.read_run(old)]) == []
