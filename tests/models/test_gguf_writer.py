"""save_gguf and `subquad export --format gguf`: ggml's own reader reads the files (metadata as llama.cpp's
converter writes it), its dequantisers give our weights quantised by ggml's own quantisers (the same bytes),
and our reader loads the file back to the same logits. (llama.cpp's own load of such a file is checked in
benchmarks/, where llama-cpp-python is built: the suite needs no llama.cpp build.)"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from subquad.models.gguf import save_gguf
from subquad.models.gguf.writer import quantize_q4_0, quantize_q8_0
from subquad.models.hf import from_pretrained
from tests.models.gguf_harness import TYPES, dequantized_folder, gguf_name
from tests.models.test_hf import _hf_mamba, _ids
from tests.models.test_hf_lfm2 import _hf as _hf_lfm2


def test_quantisers_write_ggmls_bytes():
    x = torch.randn(8, 96, generator=torch.Generator().manual_seed(0))
    x[0, :32] = 0                                                      # an all-zero block: d = 0
    x[1, :32] = torch.arange(32) / 2 - 8                              # halves: rounding away from zero
    for ours, kind in ((quantize_q8_0, "q8_0"), (quantize_q4_0, "q4_0")):
        want = gguf.quants.quantize(x.numpy(), TYPES[kind])
        assert np.array_equal(ours(x).numpy(), want), kind


@pytest.mark.parametrize("kind,outtype", [("mamba", "q8_0"), ("mamba2", "q4_0"), ("mamba2", "f32"), ("lfm2", "q8_0"),
                                          ("mamba", "f16"), ("mamba2", "bf16")])
def test_written_file_reads_in_gguf_and_loads_back(tmp_path, monkeypatch, kind, outtype):
    hf, folder = _hf_lfm2(tmp_path) if kind == "lfm2" else _hf_mamba(tmp_path, falcon=kind)
    model, _ = from_pretrained(folder)
    types = save_gguf(model, tmp_path / "m.gguf", outtype)
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    field = r.fields[f"{kind}.block_count"]
    assert r.fields["general.architecture"].contents() == kind and field.contents() == hf.config.num_hidden_layers
    assert field.types == [gguf.GGUFValueType.UINT32]                  # the type llama.cpp reads it as
    if kind == "lfm2":                                                  # which layers attend: llama.cpp's array
        assert r.fields["lfm2.attention.head_count_kv"].contents() == [0, 2, 0, 0]
        assert r.fields["lfm2.feed_forward_length"].contents() == 96
    sd = hf.state_dict()
    stored = {t.name: t for t in r.tensors}
    assert set(stored) == {gguf_name(n) for n in sd if n != "lm_head.weight" or kind != "mamba"}
    for name, t in sd.items():                        # ggml's dequantiser of each = ours quantised by ggml
        g = gguf_name(name)
        if g not in stored:
            continue
        s = stored[g]
        assert s.tensor_type.name == types[g]
        got = gguf.quants.dequantize(np.asarray(s.data), s.tensor_type)
        w = t.detach().float()
        if name.endswith("A_log"):
            w = -torch.exp(w)
        w = w.numpy().reshape(got.shape)
        if s.tensor_type != gguf.GGMLQuantizationType.F32:
            w = gguf.quants.dequantize(gguf.quants.quantize(w, s.tensor_type), s.tensor_type)
        assert np.array_equal(got, w), g
    from subquad.models import quant

    monkeypatch.setattr(quant, "MIN_WEIGHTS", 0)   # bf16: the tiny matrices kept as a model's large ones are
    with warnings.catch_warnings():           # an untied embedding written quantised loads dequantised: said
        warnings.simplefilter("ignore")
        back, _ = from_pretrained(tmp_path / "m.gguf")
    ids = _ids() % hf.config.vocab_size
    with torch.no_grad():
        if outtype == "f32":
            assert torch.allclose(back(ids), model(ids), atol=1e-5)
        else:                                 # the logits of the file's weights dequantised by ggml
            ref, _ = from_pretrained(dequantized_folder(hf, tmp_path / "m.gguf", tmp_path / "ref"))
            want = ref(ids)
            assert getattr(back, "quantized", None) == {"q8_0": "int8", "q4_0": "int8", "bf16": "bf16",
                                                        "f16": "f16"}.get(outtype)
            if outtype in ("bf16", "f16"):    # its matrices kept as the file holds them, exactly
                kept = back.blocks[0].mixer.in_proj
                assert type(kept).__name__ == {"bf16": "Bf16Linear", "f16": "F16Linear"}[outtype]
                assert torch.equal(kept.w.float(), ref.blocks[0].mixer.in_proj.weight)
                back.save_pretrained(tmp_path / "kept")          # and saved and read back as they are
                again, _ = from_pretrained(tmp_path / "kept")
                assert again.quantized == outtype and torch.equal(again(ids), back(ids))
                as_float, _ = from_pretrained(tmp_path / "m.gguf", dtype=torch.float32)   # asked for: float32
                assert getattr(as_float, "quantized", None) is None
            # bf16: x rounded to bfloat16 too, as llama.cpp's BF16 products; f16: x exact
            tol = 2e-2 if outtype == "bf16" else 1e-5
            assert torch.allclose(back(ids), want, rtol=0, atol=tol * want.abs().max())


def test_refusals_name_the_problem(tmp_path):
    _, folder = _hf_mamba(tmp_path)
    model, _ = from_pretrained(folder)
    with pytest.raises(ValueError, match="outtype must be one of f32, f16, bf16, q8_0, q4_0"):
        save_gguf(model, tmp_path / "x.gguf", "q5_1")
    assert set(save_gguf(model, tmp_path / "u.gguf", "Q8_0").values()) >= {"Q8_0"}    # as file names spell it
    with pytest.raises(ValueError, match="quantised"):
        save_gguf(from_pretrained(folder, quantize="int8")[0], tmp_path / "x.gguf")
