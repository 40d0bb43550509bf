"""GGUF's ``minimax-01``: files written by ggml's own writer from tiny random transformers MiniMax models by
llama.cpp's converter rules (``gguf_minimax_harness.py``) give transformers' logits (F32) and, quantised, the
logits of the same weights dequantised by ``gguf.quants``; ``save_gguf`` writes what the converter writes (names,
shapes, types, bytes, metadata) - with the layout stated where llama.cpp would assume another - and loads back;
bad metadata and what llama.cpp cannot hold are refused by name. (llama.cpp's own run of such files:
benchmarks/llama_gguf_parity.py --kinds minimax.)"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from subquad.models.gguf import save_gguf  # noqa: E402
from subquad.models.hf import from_pretrained  # noqa: E402
from subquad.models.quant import Int8Linear  # noqa: E402
from tests.models import gguf_minimax_harness as harness  # noqa: E402
from tests.models.gguf_harness import assert_same_file  # noqa: E402
from tests.models.gguf_more_harness import dequantized_folder  # noqa: E402
from tests.models.hf_harness import tiny  # noqa: E402

V, E = 96, 4
LAYOUTS = {"default": ["linear_attention"] * 7 + ["full_attention"],      # MiniMax-Text-01's: llama.cpp's default
           "alternating": ["linear_attention", "full_attention"] * 2}


def _hf(tmp_path, layout="default", **over):
    """A tiny transformers MiniMax: 4 heads of 16 (2 KV heads), 4 experts of which 2 a token, residual factors
    (1.5, 1) as llama.cpp holds them, random norms."""
    types = LAYOUTS[layout]
    return tiny(tmp_path, "minimax", transformers.MiniMaxConfig, transformers.MiniMaxForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": len(types),
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": E, "num_experts_per_tok": 2,
        "block_size": 16, "layer_types": types, "linear_attn_alpha_factor": 1.5, "full_attn_alpha_factor": 1.5,
        "mlp_alpha_factor": 1.5, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, **over},
        torch.float32, ("norm.weight",), eager=True)


def _ids():
    return torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))


def _load(path):
    with warnings.catch_warnings():              # the embedding written quantised is dequantised: expected
        warnings.simplefilter("ignore")
        return from_pretrained(path)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_f32_file_gives_transformers_logits(tmp_path, layout):
    hf, folder = _hf(tmp_path, layout)
    types = harness.convert(folder, tmp_path / "m.gguf", "f32")
    assert set(types.values()) == {"F32"} and "blk.0.attn_qkv.weight" in types and "blk.0.slope_rate" not in types
    ours = _load(tmp_path / "m.gguf")
    assert ours.config.layers == ["softmax" if t == "full_attention" else "lightning" for t in LAYOUTS[layout]]
    assert ours.config.scaled_residual == {"lightning": [1.5, 1.0], "softmax": [1.5, 1.0], "mlp": [1.5, 1.0]}
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_quantised_file_equals_its_weights_dequantised_by_gguf(tmp_path, outtype):
    hf, folder = _hf(tmp_path, "alternating")
    types = harness.convert(folder, tmp_path / "m.gguf", outtype)
    ref = _load(dequantized_folder(folder, tmp_path / "m.gguf", tmp_path / "ref", harness.converted))
    with pytest.warns(UserWarning, match=rf"dequantised .*: token_embd\.weight \({outtype.upper()}\)$"):
        ours, _ = from_pretrained(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        want = ref(ids)
        assert torch.allclose(ours(ids), want, rtol=0, atol=1e-5 * want.abs().max())
    # every quantised matrix but the embedding kept as int8 blocks, each stacked expert as E of them
    kept = [g for g, t in types.items() if t == outtype.upper() and g != "token_embd.weight"]
    experts = [g for g in kept if g.endswith("_exps.weight")]
    assert len(experts) == 3 * 4 and re.search("output.weight", " ".join(kept))
    assert len([m for m in ours.modules() if isinstance(m, Int8Linear)]) == len(kept) - len(experts) + E * len(experts)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_save_gguf_writes_the_converters_file_and_loads_back(tmp_path, outtype):
    _, folder = _hf(tmp_path)
    model = _load(folder)
    save_gguf(model, tmp_path / "ours.gguf", outtype)
    harness.convert(folder, tmp_path / "theirs.gguf", outtype)
    assert_same_file(tmp_path / "ours.gguf", tmp_path / "theirs.gguf", outtype != "f32")
    back = _load(tmp_path / "ours.gguf")
    ids = _ids()
    with torch.no_grad():
        want = model(ids) if outtype == "f32" else _load(tmp_path / "theirs.gguf")(ids)
        assert torch.allclose(back(ids), want, rtol=0, atol=1e-5 * want.abs().max())


def test_save_gguf_states_a_layout_llama_cpp_would_not_assume(tmp_path):
    """The converter writes no layout (llama.cpp then takes every 8th layer as attention); save_gguf adds
    ``attention.recurrent_layers`` for any other - otherwise the converter's file."""
    hf, folder = _hf(tmp_path, "alternating")
    save_gguf(_load(folder), tmp_path / "ours.gguf")
    key = "minimax-01.attention.recurrent_layers"
    harness.convert(folder, tmp_path / "theirs.gguf", override={key: [True, False, True, False]})
    assert_same_file(tmp_path / "ours.gguf", tmp_path / "theirs.gguf", False)
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(_load(tmp_path / "ours.gguf")(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("key,value,match", [
    ("minimax-01.residual_scale", None, "GGUF metadata has no minimax-01.residual_scale"),
    ("minimax-01.expert_count", None, "GGUF metadata has no minimax-01.expert_count"),
    ("minimax-01.rope.dimension_count", 8, r"minimax-01.rope.dimension_count=8, .* rotates whole heads of "
                                           r"key_length=16"),
    ("minimax-01.attention.recurrent_layers", [True, True, True, False], r"recurrent_layers=\[True, True, True, "
                                                                         r"False\] .* disagrees with the file's"),
], ids=["residual-scale", "experts", "partial-rotary", "layout"])
def test_bad_metadata_is_refused_by_name(tmp_path, key, value, match):
    _, folder = _hf(tmp_path, "alternating")
    harness.convert(folder, tmp_path / "bad.gguf", "f32", override={key: value})
    with pytest.raises(ValueError, match=match):
        from_pretrained(tmp_path / "bad.gguf")


@pytest.mark.parametrize("over,match", [
    ({"mlp_beta_factor": 0.9}, r"one residual_scale .* and beta factors 1; this model has alphas \[1.5\], "
                               r"betas \[0.9, 1.0\]"),
    ({"full_attn_alpha_factor": 1.2}, r"this model has alphas \[1.2, 1.5\]"),
], ids=["beta", "alphas"])
def test_what_llama_cpp_cannot_hold_is_refused_by_name(tmp_path, over, match):
    _, folder = _hf(tmp_path, "alternating", **over)
    with pytest.raises(ValueError, match=match):
        save_gguf(_load(folder), tmp_path / "x.gguf")


def test_slopes_other_than_minimax_are_refused_on_writing(tmp_path):
    """The file holds no slopes (llama.cpp derives them): a model whose slopes differ cannot be written."""
    _, folder = _hf(tmp_path, "alternating")
    model = _load(folder)
    with torch.no_grad():
        model.blocks[2].mixer.slope.mul_(1.1)
    with pytest.raises(ValueError, match="model.layers.2.self_attn.slope_rate is not MiniMax's slopes for layer 2"):
        save_gguf(model, tmp_path / "x.gguf")
