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
