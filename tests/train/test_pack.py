"""Packed training: boundaries at document starts, no target across a boundary, the loss equal to each
document's own, and the trainer packing a corpus of many documents by default."""

import json

import pytest
import torch
import torch.nn.functional as F

from subquad.cli import main
from subquad.data.dataset import IGNORE, pack_batch, prepare
from subquad.models import LanguageModel, ModelConfig
from subquad.train.trainer import cross_entropy, packing_eot


def test_pack_batch_boundaries_and_targets():
    eot = 0
    x = torch.tensor([[5, 6, 0, 7, 8, 9], [1, 0, 0, 2, 3, 4]])
    y = torch.tensor([[6, 0, 7, 8, 9, 1], [0, 0, 2, 3, 4, 5]])
    xp, yp, cu = pack_batch(x, y, eot)
    # row 0: [5 6 0] [7 8 9]; row 1: [1 0] [0] [2 3 4]  (a new document after every end-of-text)
    assert cu.tolist() == [0, 3, 6, 8, 9, 12]
    assert xp.tolist() == [[5, 6, 0, 7, 8, 9, 1, 0, 0, 2, 3, 4]]
    assert yp.tolist() == [[6, 0, IGNORE, 8, 9, 1, 0, IGNORE, IGNORE, 3, 4, 5]]


def test_packed_loss_is_each_documents_own_loss():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=20, d_model=16, n_layers=3, n_heads=2, context_length=16,
                      pattern="softmax,mamba2,gated_deltanet", mixer_options={"*": {"chunk_size": 4}})
    model = LanguageModel(cfg).double()
    eot = 0
    x = torch.tensor([[3, 4, 5, 0, 6, 7, 8, 9], [0, 11, 12, 13, 0, 14, 15, 16]])
    y = torch.tensor([[4, 5, 0, 6, 7, 8, 9, 10], [11, 12, 13, 0, 14, 15, 16, 17]])
    loss = cross_entropy(model, x, y, eot=eot)
    # independently: every document of every row alone, targets inside the document only
    total, count = 0.0, 0
    for row in range(2):
        start = 0
        for t in range(1, 9):
            if t == 8 or x[row, t - 1] == eot:
                seg_x, seg_y = x[row:row + 1, start:t], y[row, start:t].clone()
                seg_y[seg_x[0] == eot] = -1
                logits = model(seg_x)[0]
                keep = seg_y >= 0
                total += F.cross_entropy(logits[keep], seg_y[keep], reduction="sum")
                count += int(keep.sum())
                start = t
    torch.testing.assert_close(loss.double(), total / count, rtol=0, atol=1e-6)      # the trainer takes the loss in float32


def _docs(tmp_path, n):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(n):
        (d / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(60)))
    return d


def test_packing_is_on_for_a_corpus_of_documents_and_off_for_one_text(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    many = prepare(str(_docs(tmp_path, 12)), vocab_size=300, log=lambda m: None)
    one = prepare(str(corpus), vocab_size=300, log=lambda m: None)
    assert many.documents() >= 2 and packing_eot(None, many) == many.eot
    assert packing_eot(None, one) is None and packing_eot(False, many) is None
    assert packing_eot(True, one) == one.eot                 # asked for: one text packs harmlessly

    class NoEnd:
        eot = None
    with pytest.raises(ValueError, match="end-of-text"):
        packing_eot(True, NoEnd())
    with pytest.raises(ValueError, match="context parallelism"):
        packing_eot(True, many, context_parallel=2)
    assert packing_eot(None, many, context_parallel=2) is None


def test_resume_refuses_a_change_of_packing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    data, run = _docs(tmp_path, 12), tmp_path / "run"
    argv = ["train", "--data", str(data), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2", "--n-heads",
            "2", "--context", "32", "--pattern", "gla,softmax", "--batch-size", "2", "--eval-every", "2",
            "--ckpt-every", "2", "--out", str(run), "--no-progress", "--steps", "2"]
    assert main(argv) == 0
    assert json.loads((run / "config.json").read_text())["train"]["pack"] is None     # auto: packed here
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--no-progress", "--no-pack"]) == 2
    assert "pack" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["packed"] is True           # what auto chose
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--no-progress", "--context-parallel",
                 "2"]) == 2                       # another layout may not change the batches: a split one cannot pack
    assert "context_parallel 2 (the run packed its batches at document starts" in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--no-progress", "--pack"]) == 0  # the same
    assert main(["eval", "--run", str(run)]) == 0
    assert "packed" in capsys.readouterr().out


def test_a_context_parallel_run_continues_on_one_process_unpacked(tmp_path, monkeypatch, capsys):
    """A context-parallel run reads the concatenated stream (a split sequence cannot take document starts); on one
    process the same corpus of documents would pack automatically - a resume keeps the run's stream."""
    monkeypatch.setenv("SUBQUAD_CACHE", str(tmp_path / "cache"))
    data, run = _docs(tmp_path, 12), tmp_path / "run"
    argv = ["train", "--data", str(data), "--vocab-size", "300", "--d-model", "32", "--n-layers", "2", "--n-heads",
            "2", "--context", "32", "--pattern", "gla,softmax", "--batch-size", "2", "--eval-every", "2",
            "--ckpt-every", "2", "--out", str(run), "--no-progress"]
    assert main(argv + ["--steps", "2", "--context-parallel", "2"]) == 0
    assert json.loads((run / "config.json").read_text())["packed"] is False
    assert main(["train", "--out", str(run), "--resume", "--steps", "4", "--context-parallel", "1",
                 "--no-progress"]) == 0
    assert "packed at document starts" not in capsys.readouterr().out
    assert json.loads((run / "config.json").read_text())["packed"] is False
