"""GGUF's ``qwen3next``, ``qwen35`` and ``qwen35moe``: files written by ggml's own writer from tiny random transformers
models by llama.cpp's converter rules (``gguf_qwen_harness.py``) give transformers' logits (F32) and, quantised,
the logits of the same weights dequantised by ``gguf.quants`` loaded from a Hugging Face folder; ``save_gguf``
writes what the converter writes (names, shapes, types, metadata) and loads back; the MTP layer (``nextn``)
loads as ``model.mtp``; bad metadata is refused by name. (llama.cpp's own run of such files: benchmarks/.)"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file, save_file  # noqa: E402

from subquad.models.gguf import save_gguf  # noqa: E402
from subquad.models.hf import from_pretrained  # noqa: E402
from subquad.models.quant import Int8Linear  # noqa: E402
from tests.models import test_hf_delta, test_hf_qwen3_5  # noqa: E402
from tests.models.gguf_harness import assert_same_file  # noqa: E402
from tests.models.gguf_qwen_harness import ARCH, convert, converted, dequantized_folder  # noqa: E402

KINDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


def _hf(tmp_path, kind, dtype=torch.float32):
    """A tiny random transformers model and its folder: Gated DeltaNet and gated attention alternating, 2 key
    heads for 4 value heads (K 16, V 24); Qwen3-Next with experts in every layer (llama.cpp's qwen3next has no
    dense layers), Qwen3.5 dense or with experts (multimodal folders with a one-block vision tower); experts 64
    wide, so that their down projections fill Q8_0's blocks of 32 and stay quantised."""
    if kind == "qwen3_next":
        return test_hf_delta._hf(tmp_path, kind, dtype, decoder_sparse_step=1, moe_intermediate_size=64)
    wide = {"moe_intermediate_size": 64} if kind == "qwen3_5_moe" else {}
    return test_hf_qwen3_5._hf(tmp_path, kind, dtype, **wide)


def _ids():
    return torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


def _load(path, **kw):
    with warnings.catch_warnings():             # the embedding written quantised is dequantised: said, expected
        warnings.simplefilter("ignore")
        return from_pretrained(path, **kw)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_f32_file_gives_transformers_logits(tmp_path, kind):
    hf, folder = _hf(tmp_path, kind)
    types = convert(folder, tmp_path / "m.gguf", "f32")
    assert set(types.values()) == {"F32"} and "blk.0.attn_qkv.weight" in types
    ours, tok = from_pretrained(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert torch.allclose(ours(ids), want, atol=1e-4, rtol=1e-4)
    assert ours.config.layers == ["gated_deltanet", "softmax"] * 2 and tok is None
    gdn = ours.blocks[0].mixer
    assert (gdn.n_heads, gdn.n_key_heads, gdn.head_dim, gdn.value_head_dim) == (4, 2, 16, 24)
    assert ours.blocks[1].mixer.rotary_dim == 8
    if kind == "qwen3_5_moe":     # float64: what is left is the file's float32 rounding (norms stored as 1 + w)
        ours64 = _load(tmp_path / "m.gguf", dtype=torch.float64)
        with torch.no_grad():
            want = hf.double()(ids).logits
            assert ((ours64(ids) - want).abs().max() / want.abs().max()).item() < 1e-6


def test_a_legacy_qwen3next_file_with_ssm_in_loads(tmp_path):
    """Older converters wrote Qwen3-Next's in_proj_qkvz whole, as ``ssm_in`` (llama.cpp still reads it)."""
    hf, folder = _hf(tmp_path, "qwen3_next")
    types = convert(folder, tmp_path / "m.gguf", "q8_0", legacy=True)
    assert "blk.0.ssm_in.weight" in types and "blk.0.attn_qkv.weight" not in types
    ref = _load(dequantized_folder(folder, tmp_path / "m.gguf", tmp_path / "ref"))
    ours = _load(tmp_path / "m.gguf")
    with torch.no_grad():
        want = ref(_ids())
        assert torch.allclose(ours(_ids()), want, rtol=0, atol=1e-5 * want.abs().max())


# GGUF matrices subquad keeps as int8 blocks: attention's, the MLPs' and shared experts', the head; and the Gated
# DeltaNet's output where the converter did not permute its columns (qwen3next). The fused or reordered Gated
# DeltaNet projections and the stacked experts are dequantised (load.py).
KEPT = r"\.(attn_[qkv]|attn_output|ffn_(gate|up|down)|ffn_(gate|up|down)_shexp)\.weight$"


@pytest.mark.parametrize("kind,outtype", [("qwen3_next", "q8_0"), ("qwen3_5", "q4_0"), ("qwen3_5_moe", "q8_0")])
def test_quantised_file_equals_its_weights_dequantised_by_gguf(tmp_path, kind, outtype):
    hf, folder = _hf(tmp_path, kind)
    types = convert(folder, tmp_path / "m.gguf", outtype)
    assert types["blk.0.ffn_gate_inp.weight" if kind != "qwen3_5" else "blk.0.ssm_conv1d.weight"] == "F32"
    ref = _load(dequantized_folder(folder, tmp_path / "m.gguf", tmp_path / "ref"))
    # the embedding and the projections the converter regrouped (Qwen3.5's Gated DeltaNet) dequantised and named
    match = rf"token_embd.weight \({outtype.upper()}\)" + (r", blk\.0\.\w+\.weight" if kind != "qwen3_next" else "")
    with pytest.warns(UserWarning, match=match):
        ours, _ = from_pretrained(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        want = ref(ids)
        assert torch.allclose(ours(ids), want, rtol=0, atol=1e-5 * want.abs().max())
    kept = KEPT[:-len(")\\.weight$")] + ("|ssm_out" if kind == "qwen3_next" else "") + ")\\.weight$"
    expect = sum(t == outtype.upper() and re.search(kept, g) is not None for g, t in types.items()) + 1   # + head
    experts = sum(4 * (t == outtype.upper()) for g, t in types.items() if g.endswith("_exps.weight"))  # 4 each
    quantised = [m for m in ours.modules() if isinstance(m, Int8Linear)]
    assert len(quantised) == expect + experts and ours.quantized == "int8"
    assert experts == 3 * 4 * 4 * (kind != "qwen3_5")     # every layer's gate, up and down, 4 experts, 4 layers


@pytest.mark.parametrize("kind,outtype", [("qwen3_next", "f32"), ("qwen3_5", "q8_0"), ("qwen3_5_moe", "f32")])
def test_save_gguf_writes_the_converters_file_and_loads_back(tmp_path, kind, outtype):
    hf, folder = _hf(tmp_path, kind)
    model = _load(folder)
    save_gguf(model, tmp_path / "ours.gguf", outtype)
    convert(folder, tmp_path / "theirs.gguf", outtype)
    assert gguf.GGUFReader(str(tmp_path / "ours.gguf")).fields["general.architecture"].contents() == ARCH[kind]
    assert_same_file(tmp_path / "ours.gguf", tmp_path / "theirs.gguf", outtype != "f32")
    back = _load(tmp_path / "ours.gguf")
    ids = _ids()
    with torch.no_grad():
        want = model(ids) if outtype == "f32" else _load(tmp_path / "theirs.gguf")(ids)
        assert torch.allclose(back(ids), want, rtol=0, atol=1e-5 * want.abs().max())


def _with_mtp(tmp_path, kind):
    """The tiny model's folder given an MTP head under the published names: ``mtp.layers.0.*`` a perturbed copy of
    attention layer 1 (with its experts, or its dense MLP), random fc and norms."""
    hf, folder = _hf(tmp_path, kind)
    sd = load_file(str(folder / "model.safetensors"))
    src = "model.layers.1." if kind == "qwen3_next" else "model.language_model.layers.1."
    g = torch.Generator().manual_seed(5)
    for k in [k for k in sd if k.startswith(src)]:
        sd["mtp.layers.0." + k[len(src):]] = sd[k] + 0.05 * torch.randn(sd[k].shape, generator=g)
    d = 64
    for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        sd[f"mtp.{n}.weight"] = 0.3 * torch.randn(d, generator=g)
    sd["mtp.fc.weight"] = 0.1 * torch.randn(d, 2 * d, generator=g)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_the_mtp_layer_loads_as_model_mtp_and_is_written_back(tmp_path, kind):
    """The converter writes the MTP head as block n (``nextn_predict_layers`` 1, ``nextn.*``): it loads as the
    folder's head does, and save_gguf writes it back as the converter did."""
    folder = _with_mtp(tmp_path, kind)
    types = convert(folder, tmp_path / "theirs.gguf", "f32")
    assert "blk.4.nextn.eh_proj.weight" in types and "blk.4.attn_q.weight" in types
    ours = _load(tmp_path / "theirs.gguf")
    ref = _load(folder)
    assert ours.mtp is not None
    a, b = ours.mtp.state_dict(), ref.mtp.state_dict()
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=2e-6) for k in a)
    save_gguf(ours, tmp_path / "ours.gguf", "f32")
    assert_same_file(tmp_path / "ours.gguf", tmp_path / "theirs.gguf", False)


@pytest.mark.parametrize("kind,key,value,match", [
    ("qwen3_5", "qwen35.ssm.group_count", None, "GGUF metadata has no qwen35.ssm.group_count"),
    ("qwen3_next", "qwen3next.ssm.inner_size", 90, "qwen3next.ssm.inner_size=90"),
    ("qwen3_5_moe", "qwen35moe.rope.dimension_sections", [2, 1, 0, 1],
     r"qwen35moe.rope.dimension_sections=\[2, 1, 0, 1\]"),
    ("qwen3_next", "qwen3next.attention.recurrent_layers", [True, False, True],
     r"qwen3next.attention.recurrent_layers=\[True, False, True\] must give each of the 4 blocks"),
], ids=["missing", "inner-size", "4th-section", "recurrent-layers"])
def test_bad_metadata_is_refused_by_name(tmp_path, kind, key, value, match):
    _, folder = _hf(tmp_path, kind)
    convert(folder, tmp_path / "bad.gguf", "f32", override={key: value})
    with pytest.raises(ValueError, match=match):
        from_pretrained(tmp_path / "bad.gguf")


def test_what_llama_cpps_qwen3next_cannot_hold_is_refused_by_name(tmp_path):
    _, folder = test_hf_delta._hf(tmp_path, "qwen3_next")       # dense MLPs in every second layer
    with pytest.raises(ValueError, match="qwen3next: llama.cpp's qwen3next has experts in every layer"):
        save_gguf(_load(folder), tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="qwen3next's tensor map has no dense MLP"):
        converted(folder)                                    # nor does the converter write it
