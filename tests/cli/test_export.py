"""`subquad export --format gguf`: a run trained here written as a GGUF file that ggml's reader reads (with
llama.cpp's vocabulary of the run's tokenizer) and from_pretrained loads back to the run's logits and tokenizer."""

from __future__ import annotations

import pytest
import torch

from subquad.cli import main
from subquad.models import from_pretrained
from subquad.train import load_run

gguf = pytest.importorskip("gguf")


from subquad.models.gguf import save_gguf  # noqa: E402


def test_export_gguf_of_a_run(tmp_path, capsys, corpus):
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-heads", "2",
                 "--context", "32", "--batch-size", "2", "--no-progress", "--pattern", "mamba2", "--n-layers", "1",
                 "--no-mlp", "--steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "m.gguf"), "--format", "gguf"]) == 0
    assert "as a GGUF file" in capsys.readouterr().out
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 300 == r.fields["mamba2.vocab_size"].contents()
    ours, tok0, _ = load_run(run)
    back, tok = from_pretrained(tmp_path / "m.gguf")
    text = "def k1(a):\n    return a"
    assert tok.encode(text).ids == tok0.encode(text).ids
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        assert torch.allclose(back(ids), ours(ids), atol=1e-5)
    capsys.readouterr()                                  # the file generates from the command line
    assert main(["generate", "--model", str(tmp_path / "m.gguf"), "--prompt", "def", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    new, _ = ours.generate(tok0.encode("def").ids, max_new_tokens=4, temperature=0)
    assert tok0.decode(new) in capsys.readouterr().out             # the run's own greedy tokens
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "q.gguf"), "--format", "gguf",
                 "--quantize", "int8"]) == 2
    assert "not --quantize" in capsys.readouterr().err
    for name, said in (("missing.gguf", "no such GGUF file"), ("m.gguf", None)):   # refused by name, no traceback
        if said is None:                                 # a file without a tokenizer: said where one would be
            save_gguf(ours, tmp_path / "bare.gguf")
            name, said = "bare.gguf", "no tokenizer in its metadata"
        assert main(["generate", "--model", str(tmp_path / name), "--prompt", "def"]) == 2
        assert said in capsys.readouterr().err
