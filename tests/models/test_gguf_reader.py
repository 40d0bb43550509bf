"""The GGUF reader against ggml's own: gguf's GGUFWriter writes metadata and tensors of every type the reader
takes, gguf's GGUFReader and ``gguf.quants.dequantize`` are the expected values - bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from subquad.models.gguf.reader import GGUFFile

Q = gguf.GGMLQuantizationType


def _random_blocks(kind, rows, cols, rng):
    """Raw bytes of (rows, cols) values of a K-quant (gguf quantises none): random codes and scales, the f16
    super-block scales set to finite values."""
    bs, nb = gguf.GGML_QUANT_SIZES[kind]
    b = rng.integers(0, 256, (rows * cols // bs, nb), dtype=np.uint8)
    d = rng.uniform(-0.02, 0.02, (b.shape[0], 2)).astype(np.float16).view(np.uint8)
    if kind == Q.Q4_K:
        b[:, 0:4] = d                                                  # d and dmin
    else:
        b[:, -2:] = d[:, :2]
    return b.reshape(rows, -1)


def test_metadata_and_every_tensor_type_read_as_ggufs_reader_reads_them(tmp_path):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "mamba")
    w.add_block_count(3)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_bool("x.flag", True)
    w.add_array("x.ints", [1, -2, 3])
    w.add_token_list(["a", "b", "ab"])
    x = rng.standard_normal((6, 64)).astype(np.float32)
    for kind in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0):
        w.add_tensor(f"t.{kind.name}", gguf.quants.quantize(x, kind), raw_dtype=kind)
    for kind in (Q.Q4_K, Q.Q6_K):
        w.add_tensor(f"t.{kind.name}", _random_blocks(kind, 3, 512, rng), raw_dtype=kind)
    w.add_tensor("t.3d", rng.standard_normal((2, 3, 4)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, theirs = GGUFFile(tmp_path / "t.gguf"), gguf.GGUFReader(str(tmp_path / "t.gguf"))
    assert ours.metadata["general.architecture"] == "mamba" and ours.metadata["mamba.block_count"] == 3
    assert ours.metadata["x.flag"] is True and ours.metadata["x.ints"] == [1, -2, 3]
    assert ours.metadata["tokenizer.ggml.tokens"] == ["a", "b", "ab"]
    assert ours.metadata["mamba.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        got = ours.dequantize(t.name)
        assert ours.tensors[t.name].type == t.tensor_type.name and tuple(got.shape) == want.shape
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want))), t.name   # bit for bit


def test_cut_short_and_unknown_types_are_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "mamba")
    w.add_tensor("a", np.zeros((4, 32), np.float32))
    w.add_tensor("b", gguf.quants.quantize(np.zeros((4, 32), np.float32), Q.Q5_0), raw_dtype=Q.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="tensor b has ggml type 6"):
        GGUFFile(tmp_path / "t.gguf")
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:60])
    with pytest.raises(ValueError, match="cut short"):
        GGUFFile(tmp_path / "cut.gguf")


def test_the_library_never_imports_ggufs_package():
    """ggml's ``gguf`` is the tests' reference only: no module of subquad imports it."""
    import re
    from pathlib import Path

    import subquad

    for f in Path(subquad.__file__).parent.rglob("*.py"):
        assert not re.search(r"^\s*(import gguf|from gguf)\b", f.read_text(), re.MULTILINE), f
