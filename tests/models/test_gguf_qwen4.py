"""GGUF's ``qwen4exp`` (Qwen3.8-Flash-Next): a file written by ggml's own writer from a tiny random transformers
Qwen4-Exp by llama.cpp's converter rules (``gguf_qwen4_harness.py``) gives transformers' logits (F32: hyper-connections,
QSA's indexer, PLE's hashed n-grams, experts) and, quantised, the logits of the same weights dequantised by
``gguf.quants``; ``save_gguf`` writes what the converter writes (names, shapes, types, metadata - the uint64 hash
constants too) and loads back; what llama.cpp's qwen4exp cannot hold is refused by name. (llama.cpp's own run of
such files: benchmarks/llama_gguf_parity.py.)"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from subquad.models.gguf import save_gguf  # noqa: E402
from subquad.models.hf import from_pretrained  # noqa: E402
from subquad.models.quant import Int8Linear  # noqa: E402
from tests.models import test_hf_qwen4_exp  # noqa: E402
from tests.models.gguf_harness import assert_same_file  # noqa: E402
from tests.models.gguf_qwen4_harness import convert, dequantized_folder  # noqa: E402

# what llama.cpp's qwen4exp holds: value heads as wide as the keys, one PLE layer (a Gated DeltaNet one) reading
# hidden_size, the sigmoid output gate; experts 32 wide, so their down projections fill Q8_0's blocks
GGUF = {"linear_value_head_dim": 8, "ple_layer_ids": [1], "ple_embed_dim": 32, "heads_per_ngram": 2,
        "output_gate_type": "sigmoid", "moe_intermediate_size": 32}


def _hf(tmp_path, **over):
    """The tiny model (test_hf_qwen4_exp's, with GGUF's fields) and its folder, whose config.json names the attention
    layers "full_attention" as the released config does (the converter's test for QSA's compress ratio; transformers
    reads it as "indexed_attention")."""
    hf, folder = test_hf_qwen4_exp._hf(tmp_path, **{**GGUF, **over})
    c = json.loads((folder / "config.json").read_text())
    c["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in c["layer_types"]]
    (folder / "config.json").write_text(json.dumps(c))
    return hf, folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model and its folder, built once (the tests write their files beside it)."""
    return _hf(tmp_path_factory.mktemp("qwen4"))


def _ids():
    ids = test_hf_qwen4_exp.token_ids(test_hf_qwen4_exp.V)       # eos inside: PLE's n-grams restart
    return ids[:, :24]


def _load(path, **kw):
    with warnings.catch_warnings():             # quantised tensors subquad dequantises: said, expected
        warnings.simplefilter("ignore")
        return from_pretrained(path, **kw)[0]


def test_f32_file_gives_transformers_logits(tmp_path, tiny):
    hf, folder = tiny
    types = convert(folder, tmp_path / "m.gguf", "f32")
    assert {"per_layer_token_embd.weight", "blk.1.indexer.k_proj.weight", "blk.0.ple_conv1d.weight",
            "output_hc_up.weight", "blk.3.hc_ffn_inject.weight"} <= set(types) and set(types.values()) == {"F32"}
    ours = _load(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert torch.allclose(ours(ids), want, atol=1e-4, rtol=1e-4)
    assert ours.config.layers == ["gated_deltanet", "qsa"] * 2 and ours.config.hyper["streams"] == 3
    assert ours.blocks[0].mixer.output_gate == "sigmoid" and [b.ple is not None for b in ours.blocks] == \
        [True, False, False, False]
    qsa = ours.blocks[1].mixer
    assert (qsa.index_heads, qsa.index_head_dim, qsa.index_budget, qsa.index_block) == (4, 8, 8, 4)
    ours64 = _load(tmp_path / "m.gguf", dtype=torch.float64)      # what is left: the file's float32 (1 + w norms)
    with torch.no_grad():
        want = copy.deepcopy(hf).double()(ids).logits
        assert ((ours64(ids) - want).abs().max() / want.abs().max()).item() < 1e-6


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_quantised_file_equals_its_weights_dequantised_by_gguf(tmp_path, tiny, outtype):
    hf, folder = tiny
    types = convert(folder, tmp_path / "m.gguf", outtype)
    big = outtype.upper()
    assert types["blk.0.ffn_down_exps.weight"] == types["blk.0.hc_attn_down.weight"] == big
    assert types["blk.0.ple_conv1d.weight"] == types["per_layer_token_embd.weight"] == "F16"    # rows of 3, 8
    ref = _load(dequantized_folder(folder, tmp_path / "m.gguf", tmp_path / "ref"))
    with pytest.warns(UserWarning, match=rf"token_embd.weight \({big}\)"):
        ours, _ = from_pretrained(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        want = ref(ids)
        assert torch.allclose(ours(ids), want, rtol=0, atol=1e-5 * want.abs().max())
    quantised = {n for n, m in ours.named_modules() if isinstance(m, Int8Linear)}
    assert {"blocks.0.norm1.down", "blocks.0.norm1.inject", "blocks.0.ple.key_proj", "blocks.1.mixer.o_proj",
            "head"} <= quantised                                 # hyper-connections, PLE, attention: kept in blocks
    assert sum(".w_gate." in n or ".w_up." in n or ".w_down." in n for n in quantised) == 3 * 4 * 4
    assert ours.quantized == "int8"


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_save_gguf_writes_the_converters_file_and_loads_back(tmp_path, tiny, outtype):
    hf, folder = tiny
    model = _load(folder)
    save_gguf(model, tmp_path / "ours.gguf", outtype)
    convert(folder, tmp_path / "theirs.gguf", outtype)
    assert_same_file(tmp_path / "ours.gguf", tmp_path / "theirs.gguf", outtype != "f32")
    back = _load(tmp_path / "ours.gguf")
    ids = _ids()
    with torch.no_grad():
        want = model(ids) if outtype == "f32" else _load(tmp_path / "theirs.gguf")(ids)
        assert torch.allclose(back(ids), want, rtol=0, atol=1e-5 * want.abs().max())
    if outtype == "f32":                                      # a file's model written again: the same file
        save_gguf(back, tmp_path / "again.gguf", outtype)
        assert_same_file(tmp_path / "again.gguf", tmp_path / "theirs.gguf", False)


def test_a_file_with_dense_attention_layers_loads_as_gated_attention(tmp_path, tiny):
    """Compress ratio 0 at the attention layers (what the converter writes from transformers' own
    "indexed_attention"): llama.cpp attends densely there, and so does the model loaded - its indexer unused."""
    hf, folder = tiny
    convert(folder, tmp_path / "m.gguf", "f32", override={"qwen4exp.attention.compress_ratios": [0] * 4})
    ours = _load(tmp_path / "m.gguf")
    assert ours.config.layers == ["gated_deltanet", "softmax"] * 2
    ref = _load(folder)
    for b in ref.blocks[1::2]:                         # the same weights: QSA with a budget of every block is dense
        b.mixer.index_budget = 1 << 20
    ids = _ids()
    with torch.no_grad():
        want = ref(ids)
        assert torch.allclose(ours(ids), want, rtol=0, atol=1e-5 * want.abs().max())


@pytest.mark.parametrize("key,value,match", [
    ("qwen4exp.attention.compress_ratios", [0, 4, 0, 0], r"compress_ratios=\[0, 4, 0, 0\]: .* share one ratio"),
    ("qwen4exp.ple.layers", [0, 2], r"qwen4exp.ple.layers=\[0, 2\]: llama.cpp's qwen4exp holds one PLE layer"),
    ("qwen4exp.hyper_connection.low_rank", None, "GGUF metadata has no qwen4exp.hyper_connection.low_rank"),
], ids=["mixed-ratios", "two-ple-layers", "missing"])
def test_bad_metadata_is_refused_by_name(tmp_path, tiny, key, value, match):
    _, folder = tiny
    convert(folder, tmp_path / "bad.gguf", "f32", override={key: value})
    with pytest.raises(ValueError, match=match):
        from_pretrained(tmp_path / "bad.gguf")


@pytest.mark.parametrize("over,match", [
    ({"output_gate_type": None}, "output_gate_type='silu'"),
    ({"linear_value_head_dim": 12}, "linear_value_head_dim=12"),
    ({"ple_layer_ids": [1, 3]}, r"ple_layer_ids=\[1, 3\]"),
    ({"ple_embed_dim": 24, "heads_per_ngram": 3}, "ple_embed_dim=24, hidden_size=32"),
], ids=["silu-gate", "value-width", "two-ple-layers", "ple-width"])
def test_what_llama_cpps_qwen4exp_cannot_hold_is_refused_by_name(tmp_path, over, match):
    _, folder = _hf(tmp_path, **over)
    with pytest.raises(ValueError, match=match):
        save_gguf(_load(folder), tmp_path / "x.gguf")
