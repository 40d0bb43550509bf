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
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == 0      # the run's <|endoftext|>
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
    # a model folder or a GGUF file converted from the command line: the file as an int8 folder, that folder's
    # float twin (--format hf) back to GGUF; each loads to the run's logits (int8: to its rounding)
    assert main(["export", "--model", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "q8"), "--quantize",
                 "int8"]) == 0
    assert main(["export", "--model", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "again.gguf")]) == 0
    with torch.no_grad():
        want = ours(ids)
        for path, tol in (("q8", 5e-2), ("hf", 1e-5), ("again.gguf", 1e-5)):
            m, t = from_pretrained(tmp_path / path)
            assert t.encode(text).ids == ids[0].tolist()
            assert (m(ids) - want).abs().max() <= tol * want.abs().max(), path
    assert main(["export", "--model", str(run), "--out", str(tmp_path / "x")]) == 2
    assert "is a run folder: give it as --run" in capsys.readouterr().err
    # never written over (or into) its own source; an int8 folder is not a float checkpoint's source
    for src, out in (("hf", "hf"), ("hf", "hf/../hf"), ("run", "run")):
        flag = "--run" if src == "run" else "--model"
        assert main(["export", flag, str(tmp_path / src), "--out", str(tmp_path / out), "--quantize", "int8"]) == 2
        assert "is the " + flag + " it is exported from" in capsys.readouterr().err
    assert getattr(from_pretrained(tmp_path / "hf")[0], "quantized", None) is None      # the float folder stays
    assert main(["export", "--model", str(tmp_path / "q8"), "--out", str(tmp_path / "q8.gguf")]) == 2
    assert "export the float checkpoint it was quantised from" in capsys.readouterr().err
    for outtype in ("bf16", "q8_0"):                       # a half file becomes a float folder; blocks need --quantize
        assert main(["export", "--run", str(run), "--out", str(tmp_path / f"{outtype}.gguf"), "--outtype",
                     outtype]) == 0
        capsys.readouterr()
        code = main(["export", "--model", str(tmp_path / f"{outtype}.gguf"), "--out", str(tmp_path / outtype)])
        if outtype == "bf16":
            assert code == 0
            with torch.no_grad():
                assert (from_pretrained(tmp_path / "bf16")[0](ids) - want).abs().max() <= 3e-2 * want.abs().max()
        else:
            assert code == 2 and "block-quantised matrices" in capsys.readouterr().err
            assert main(["export", "--model", str(tmp_path / "q8_0.gguf"), "--out", str(tmp_path / "q"),
                         "--quantize", "int8"]) == 0
    for name, said in (("missing.gguf", "no such GGUF file"), ("m.gguf", None)):   # refused by name, no traceback
        if said is None:                                 # a file without a tokenizer: said where one would be
            with pytest.warns(UserWarning, match="without tokenizer=: the file holds no vocabulary"):
                save_gguf(ours, tmp_path / "bare.gguf")
            name, said = "bare.gguf", "no tokenizer in its metadata"
        assert main(["generate", "--model", str(tmp_path / name), "--prompt", "def"]) == 2
        assert said in capsys.readouterr().err


def test_export_gguf_of_a_hybrid_infers_the_format_and_says_how_rotary_can_be_written(tmp_path, capsys, corpus):
    """A hybrid (Mamba-2 and attention with MLPs) with Bamba's rotary (half of each head's dims) leaves as Bamba's
    ``granitehybrid`` to an --out ending in .gguf in a folder not made yet, without --format, and loads back to
    the run's logits; with full rotary (the default: no GGUF hybrid llama.cpp's converter writes has it) it is
    refused with the ways that are written named."""
    logits = {}
    for frac in ("0.5", "1.0"):
        run = tmp_path / f"run{frac}"
        assert main(["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "32", "--n-heads", "2",
                     "--context", "32", "--batch-size", "2", "--no-progress", "--pattern", "mamba2,softmax",
                     "--n-layers", "2", "--steps", "1", "--mixer-option", f"softmax.rotary_fraction={frac}",
                     "--out", str(run)]) == 0
        capsys.readouterr()
        out = tmp_path / "new" / frac / "h.gguf"
        code = main(["export", "--run", str(run), "--out", str(out)])
        captured = capsys.readouterr()
        assert "writing a GGUF file" in captured.err
        if frac == "1.0":
            assert code == 2 and "softmax.rotary_fraction=0.5" in captured.err and "rotary=false" in captured.err
            assert not out.exists()
            continue
        assert code == 0 and "as a GGUF file" in captured.out and out.is_file()
        assert gguf.GGUFReader(str(out)).fields["general.architecture"].contents() == "granitehybrid"
        ours, _, _ = load_run(run)
        back, _ = from_pretrained(out)
        ids = torch.randint(0, 300, (2, 13))
        with torch.no_grad():
            logits[frac] = back(ids), ours(ids)
        with pytest.raises(ValueError, match="as 'mamba2'"):      # a type that cannot hold it, asked for
            save_gguf(ours, tmp_path / "x.gguf", model_type="mamba2")
        assert main(["export", "--run", str(run), "--out", str(out), "--model-type", "subquad"]) == 2
        assert "not --model-type subquad" in capsys.readouterr().err
        upper = tmp_path / "new" / "H.GGUF"                    # the suffix in any case; --format hf wins
        assert main(["export", "--run", str(run), "--out", str(upper)]) == 0 and upper.is_file()
        assert main(["export", "--run", str(run), "--out", str(tmp_path / "f.gguf"), "--format", "hf"]) == 0
        assert (tmp_path / "f.gguf" / "config.json").is_file()
        capsys.readouterr()
    assert torch.allclose(*logits["0.5"], atol=1e-5)


def test_a_run_of_rwkv7_blocks_exports_as_the_rwkv7_type(tmp_path, capsys, corpus):
    """``subquad train --pattern rwkv7 --blocks rwkv7``: RWKV-7's own blocks (LayerNorms, ln0, the channel mix, its
    own head; the group norm's eps 64e-5 as llama.cpp fixes it), so the run exports as a Hugging Face rwkv7 folder
    and a GGUF file, each loading to the run's logits; the default blocks are refused by the type (the message names
    what it needs; as a folder they go to subquad's own format), and --blocks rwkv7 beside another mixer is
    refused."""
    run = tmp_path / "run"
    base = ["train", "--data", str(corpus), "--vocab-size", "300", "--d-model", "64", "--n-heads", "2", "--n-layers",
            "2", "--context", "32", "--batch-size", "2", "--steps", "1", "--no-progress"]
    assert main(base + ["--pattern", "rwkv7", "--blocks", "rwkv7", "--out", str(run)]) == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "m.gguf")]) == 0
    assert "Hugging Face rwkv7 folder" in capsys.readouterr().out
    ours, tok, _ = load_run(run)
    ids = torch.tensor([tok.encode("def k1(a):\n    return a").ids])
    with torch.no_grad():
        want = ours(ids)
        for path in ("hf", "m.gguf"):
            back, _ = from_pretrained(tmp_path / path)
            assert (back(ids) - want).abs().max() <= 1e-5 * want.abs().max(), path
    assert main(base + ["--pattern", "rwkv7", "--out", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(tmp_path / "plain"), "--out", str(tmp_path / "plain.gguf")]) == 2
    assert "nearest: rwkv7, which needs" in capsys.readouterr().err
    assert main(base + ["--pattern", "rwkv7,mamba2", "--blocks", "rwkv7", "--out", str(tmp_path / "mixed")]) == 2
    assert "--blocks rwkv7 is RWKV-7's block layout around rwkv7 mixers" in capsys.readouterr().err
