"""The plain-read safetensors loader (``subquad.tensorfile``) that model folders and training checkpoints use."""

from __future__ import annotations

import pytest
import torch

from subquad.tensorfile import read_safetensors


def test_read_safetensors_equals_the_safetensors_library(tmp_path):
    """The plain-read loader against safetensors' own, every dtype a checkpoint holds, 0-d and empty tensors
    and metadata included; a file cut inside a tensor is refused naming it."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    t = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
         "f16": torch.randn(2, 2, 2, generator=g).half(), "f64": torch.randn(4, generator=g).double(),
         "i64": torch.randint(-9, 9, (6,), generator=g), "i8": torch.randint(-9, 9, (5,), generator=g).to(torch.int8),
         "bool": torch.rand(9, generator=g) > 0.5, "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
         "u8": torch.randint(0, 255, (3,), generator=g).to(torch.uint8)}
    f = tmp_path / "m.safetensors"
    save_file(t, str(f), metadata={"format": "pt"})
    want, got = load_file(str(f)), read_safetensors(f)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k
    whole = f.read_bytes()
    f.write_bytes(whole[:-3])
    with pytest.raises(ValueError, match="past the file's end"):
        read_safetensors(f)
    f.write_bytes(whole[:5])
    with pytest.raises(ValueError, match="8-byte header"):
        read_safetensors(f)


def test_mapped_tensors_equal_read_ones_and_writes_never_reach_the_file(tmp_path):
    """``mapped`` names come back as views of a private map: the same values, checked as they are read, and a
    write to one changes the tensor, not the file (a reread gives the file's values)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    t = {"emb": torch.randn(300, 16, generator=g), "bf": torch.randn(5, 3, generator=g).bfloat16(),
         "w": torch.randn(4, 4, generator=g)}
    f = tmp_path / "m.safetensors"
    save_file(t, str(f))
    before, seen = f.read_bytes(), []
    got = read_safetensors(f, mapped={"emb", "bf"}, check=lambda name, x: seen.append((name, x.clone())))
    assert sorted(n for n, _ in seen) == ["bf", "emb", "w"]
    for k in t:
        assert torch.equal(got[k], t[k]) and dict(seen)[k].equal(t[k]), k
    got["emb"].mul_(2)
    got["bf"][0, 0] = 7
    assert torch.equal(got["emb"], 2 * t["emb"]) and f.read_bytes() == before
    assert torch.equal(read_safetensors(f, mapped={"emb"})["emb"], t["emb"])

    def refuse(name, x):
        if name == "emb":
            raise ValueError("no emb")

    with pytest.raises(ValueError, match="no emb"):
        read_safetensors(f, mapped={"emb"}, check=refuse)


def test_a_misaligned_tensor_asked_mapped_is_read_instead(tmp_path):
    """A float32 tensor at an offset not divisible by 4 (the format allows it; a view of the map could not
    hold it) is read into a fresh tensor, its values the bytes written by hand."""
    import json
    import struct

    head = {"u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "f": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}
    text = json.dumps(head).encode()
    text += b" " * (-(8 + len(text)) % 8)                      # the data starts 8-aligned: "f" at base + 1
    f = tmp_path / "odd.safetensors"
    f.write_bytes(struct.pack("<Q", len(text)) + text + bytes([5]) + struct.pack("<2f", 1.5, -2.25))
    got = read_safetensors(f, mapped={"f", "u"})
    assert got["u"].tolist() == [5] and got["f"].tolist() == [1.5, -2.25]


def test_the_quantised_loader_releases_freed_memory_per_module(tmp_path, monkeypatch):
    """``load_quantized`` hands freed memory back after every module it fills (the int4 folder's peak:
    benchmarks/RESULTS.md)."""
    from subquad.models import LanguageModel, ModelConfig, from_pretrained, quant
    from subquad.models.quant import quantize

    model = LanguageModel(ModelConfig(vocab_size=64, d_model=32, n_layers=2, pattern="mamba", mlp=False)).eval()
    quantize(model, "int4", min_weights=0, group_size=32).save_pretrained(tmp_path / "q")
    calls = []
    monkeypatch.setattr(quant, "release_freed", lambda: calls.append(1))
    from_pretrained(tmp_path / "q")
    assert len(calls) >= 2 * 3          # at least each layer's three quantised matrices' modules


def test_files_written_get_the_mode_of_any_other_file(tmp_path):
    """safetensors creates its files 0600; a model folder, a checkpoint and a saved state get what open() gives
    under the process's umask (another user's server reads the weights)."""
    import os

    from subquad.models import LanguageModel, ModelConfig, save_pretrained, save_state
    from subquad.tensorfile import save_file

    (tmp_path / "plain.txt").write_text("x")
    want = os.stat(tmp_path / "plain.txt").st_mode & 0o777
    save_file({"a": torch.zeros(3)}, tmp_path / "a.safetensors")
    model = LanguageModel(ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, pattern="mamba2"))
    save_pretrained(model, tmp_path / "m")
    save_state(tmp_path / "s.safetensors", model.empty_state(1))
    for f in ("a.safetensors", "m/model.safetensors", "s.safetensors"):
        assert os.stat(tmp_path / f).st_mode & 0o777 == want, f
    old = os.umask(0o027)
    try:
        save_file({"a": torch.zeros(3)}, tmp_path / "b.safetensors")
        assert os.umask(0o027) == 0o027                         # read, not left changed
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "b.safetensors").st_mode & 0o777 == 0o640
