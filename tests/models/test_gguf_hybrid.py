"""GGUF for the Mamba-2 hybrids - granitehybrid (Granite 4 hybrids, Bamba), nemotron_h, falcon-h1: files written by
ggml's own writer from tiny random transformers models, by llama.cpp's converter rules (tests/models/
gguf_hybrid_harness.py), give transformers' logits (F32) and, as Q8_0, the logits of the same weights dequantised
by gguf with the projections kept quantised; save_gguf writes what the converter writes (metadata, names, types,
bytes) and loads back; a wrong metadata field is refused by name."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from subquad.models.gguf import save_gguf  # noqa: E402
from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from subquad.models.quant import Int8Linear  # noqa: E402
from tests.models.gguf_hybrid_harness import arch_name, convert, dequantized_folder  # noqa: E402
from tests.models.test_hf_falcon_h1 import _hf as _falcon  # noqa: E402
from tests.models.test_hf_granite import _hf as _granite  # noqa: E402
from tests.models.test_hf_hybrid import _hf as _hybrid  # noqa: E402
from tests.models.test_hf_nemotron_h import MOE  # noqa: E402
from tests.models.test_hf_nemotron_h import _hf as _nemotron  # noqa: E402

V = 96
# Granite's and Falcon-H1's multipliers at values that change nothing (attention_multiplier 1 / sqrt(16)): what
# save_gguf writes from subquad's folded weights, so the converter's file of the same model is byte for byte it
GRANITE_ONE = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 0.25,
               "logits_scaling": 1.0}
FALCON_ONE = {"embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "attention_in_multiplier": 1.0,
              "attention_out_multiplier": 1.0, "key_multiplier": 1.0, "ssm_in_multiplier": 1.0,
              "ssm_out_multiplier": 1.0, "ssm_multipliers": [1.0] * 5, "mlp_multipliers": [1.0, 1.0]}
MODELS = {
    "granite-moe": lambda p, **o: _granite(p, **o),                     # experts + shared expert, multipliers
    "granite-dense-tied": lambda p, **o: _granite(p, num_local_experts=0, tie_word_embeddings=True,
                                                  intermediate_size=48, **o),
    "bamba": lambda p, **o: _hybrid(p, "bamba", **o),                   # rotary on half of each head
    "nemotron_h": lambda p, **o: _nemotron(p, **o),                     # M-M*-MM-: squared-ReLU MLP layers
    # Nemotron 3's MoE layers (sigmoid grouped routing, correction bias, shared expert); no dense "-" layer,
    # which nemotron_h_moe cannot hold
    "nemotron_h_moe": lambda p, **o: _nemotron(p, hybrid_override_pattern="ME*EM", **{**MOE, **o}),
    "falcon_h1": lambda p, **o: _falcon(p, **o),                        # muP multipliers folded by the converter
    "falcon_h1-gated-tied": lambda p, **o: _falcon(p, mamba_rms_norm=True, mamba_norm_before_gate=False,
                                                   tie_word_embeddings=True, **o),
    "jamba": lambda p, **o: _hybrid(p, "jamba", **o),                   # Mamba-1 with dt/B/C norms, experts
}
ONE = {"granite-moe": GRANITE_ONE, "granite-dense-tied": GRANITE_ONE, "falcon_h1": FALCON_ONE,
       "falcon_h1-gated-tied": FALCON_ONE, "bamba": {}, "nemotron_h": {}, "jamba": {},
       "nemotron_h_moe": {}}


def _ids(T=40):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def _arch(hf) -> str:
    return arch_name(hf.config)


@pytest.mark.parametrize("kind", [k for k in MODELS if k != "falcon_h1-gated-tied"])
def test_f32_file_gives_transformers_logits(tmp_path, kind):
    hf, folder = MODELS[kind](tmp_path)
    convert(hf, folder, tmp_path / "m.gguf", "f32")
    ours, tok = from_pretrained(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    assert tok is None and not getattr(ours, "quantized", None)


@pytest.mark.parametrize("kind", ["granite-moe", "granite-dense-tied", "bamba", "nemotron_h", "nemotron_h_moe",
                                  "falcon_h1-gated-tied", "jamba"])
def test_q8_0_file_equals_its_weights_dequantised_by_gguf(tmp_path, kind):
    """Every 2-D Q8_0 matrix but the embedding (looked up) stays quantised - q and k reordered by whole rows, a
    Granite multiplier folded into the blocks' scales -, a tied head of the embedding's blocks; the stacked
    experts are dequantised."""
    hf, folder = MODELS[kind](tmp_path)
    types = convert(hf, folder, tmp_path / "m.gguf", "q8_0")
    ref, _ = from_pretrained(dequantized_folder(hf, folder, tmp_path / "m.gguf", tmp_path / "ref"))
    tied = "output.weight" not in types
    if tied:                                # the head multiplies with the embedding's blocks: nothing to say
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours, _ = from_pretrained(tmp_path / "m.gguf")
    else:                                   # an untied embedding is looked up: dequantised, and said so
        with pytest.warns(UserWarning, match=r"token_embd.weight \(Q8_0\)"):
            ours, _ = from_pretrained(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        want = ref(ids)
        assert torch.allclose(ours(ids), want, rtol=0, atol=1e-5 * want.abs().max())
    dims = {t.name: len(t.shape) for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    matrices = [g for g, t in types.items() if t == "Q8_0" and dims[g] == 2 and g != "token_embd.weight"]
    # stacked experts: one module per expert where all of a layer's are Q8_0 (a row off Q8_0's blocks is F16)
    stacked = {}
    for g in (g for g in types if dims[g] == 3):
        stacked.setdefault(g.split(".")[1], []).append(types[g])
    E = getattr(hf.config, "num_local_experts", None) or getattr(hf.config, "n_routed_experts", None) or \
        getattr(hf.config, "num_experts", 0)
    experts = sum(E * len(t) for t in stacked.values() if set(t) == {"Q8_0"})
    assert sum(isinstance(m, Int8Linear) for m in ours.modules()) == len(matrices) + tied + experts
    assert experts > 0 or kind not in ("nemotron_h_moe", "jamba")
    assert ours.quantized == "int8" and any(g.endswith("attn_q.weight") for g in matrices)
    save_pretrained(ours, tmp_path / "saved")            # a quantised folder keeps the blocks, bit for bit
    assert "_gguf_scales" not in (tmp_path / "saved" / "config.json").read_text()
    again, _ = from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))


def _fields(path, arch) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if k.startswith(arch + ".")}


@pytest.mark.parametrize("kind,outtype", [("granite-moe", "q8_0"), ("granite-dense-tied", "f32"), ("bamba", "q8_0"),
                                          ("nemotron_h", "q8_0"), ("falcon_h1", "f32"),
                                          ("falcon_h1-gated-tied", "q8_0"), ("jamba", "q8_0"),
                                          ("nemotron_h_moe", "q8_0")])
def test_save_gguf_writes_what_the_converter_writes(tmp_path, kind, outtype):
    """A model loaded from the folder, written by save_gguf: the converter's file of the same folder, metadata
    (keys, values, types), tensor names, shapes, types and bytes; and it loads back to the model's logits (F32)
    or to its weights dequantised by gguf (Q8_0)."""
    hf, folder = MODELS[kind](tmp_path, **ONE[kind])
    model, _ = from_pretrained(folder)
    ours = save_gguf(model, tmp_path / "ours.gguf", outtype)
    theirs = convert(hf, folder, tmp_path / "theirs.gguf", outtype)
    assert ours == theirs
    a, b = gguf.GGUFReader(str(tmp_path / "ours.gguf")), gguf.GGUFReader(str(tmp_path / "theirs.gguf"))
    arch = _arch(hf)
    assert a.fields["general.architecture"].contents() == arch
    mine_fields = _fields(tmp_path / "ours.gguf", arch)
    if arch == "jamba":          # no vocabulary written here: vocab_size said instead (llama.cpp needs n_vocab)
        assert mine_fields.pop("jamba.vocab_size") == V
    assert mine_fields == _fields(tmp_path / "theirs.gguf", arch)
    for k in mine_fields:                                      # the types llama.cpp reads them as
        assert a.fields[k].types == b.fields[k].types, k
    mine = {t.name: t for t in a.tensors}
    for t in b.tensors:
        assert tuple(mine[t.name].shape) == tuple(t.shape) and mine[t.name].tensor_type == t.tensor_type, t.name
        assert np.array_equal(np.asarray(mine[t.name].data), np.asarray(t.data)), t.name
    with warnings.catch_warnings():                 # a quantised embedding is looked up dequantised: said
        warnings.simplefilter("ignore")
        back, _ = from_pretrained(tmp_path / "ours.gguf")
    ids = _ids()
    with torch.no_grad():
        if outtype == "f32":
            assert torch.allclose(back(ids), model(ids), rtol=0, atol=1e-5)
        else:
            ref, _ = from_pretrained(dequantized_folder(hf, folder, tmp_path / "ours.gguf", tmp_path / "ref"))
            want = ref(ids)
            assert torch.allclose(back(ids), want, rtol=0, atol=1e-5 * want.abs().max())


BAD = {   # (model, a metadata change made after the converter's, the error's words)
    "head_count_kv-length": ("bamba", lambda w: w.add_head_count_kv([2, 2]), r"attention\.head_count_kv=\[2, 2\]"),
    "bamba-rope-dims": ("bamba", lambda w: w.add_rope_dimension_count(6), r"rope\.dimension_count=6"),
    "ssm-inner": ("granite-moe", lambda w: w.add_ssm_inner_size(100), r"ssm\.inner_size=100"),
    "nemotron-layer-both": ("nemotron_h", lambda w: w.add_feed_forward_length([80] * 8),
                            r"head_count_kv=.*feed_forward_length=.*attention or an MLP"),
    "nemotron-moe": ("nemotron_h", lambda w: w.add_expert_count(8), r"nemotron_h\.expert_count=8"),
    "falcon-kv-array": ("falcon_h1", lambda w: w.add_head_count_kv([2, 2, 2]), r"falcon-h1\.attention\.head_count_kv"),
    "jamba-attn-layout": ("jamba", lambda w: w.add_head_count_kv([2, 2, 0, 2]), r"attn layers \[0, 1, 3\]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_wrong_metadata_field_is_refused_by_name(tmp_path, case):
    kind, change, words = BAD[case]
    hf, folder = MODELS[kind](tmp_path)
    convert(hf, folder, tmp_path / "m.gguf", "f32", after=change)
    with pytest.raises(ValueError, match=words):
        from_pretrained(tmp_path / "m.gguf")


def test_a_nemotron_h_file_without_its_head_is_refused_by_name(tmp_path):
    """transformers' Nemotron-H reads lm_head whatever tie_word_embeddings says: no output.weight, no model."""
    hf, folder = MODELS["nemotron_h"](tmp_path)
    convert(hf, folder, tmp_path / "m.gguf", "f32", drop=("output.weight",))
    with pytest.raises(ValueError, match="has no output.weight"):
        from_pretrained(tmp_path / "m.gguf")


def test_what_save_gguf_cannot_write_is_refused_by_name(tmp_path):
    """A Granite 4 hybrid with rotary attention (the converter writes rotary for Bamba alone, so the file would
    lose it); a Nemotron-H with both dense and MoE MLP layers (nemotron_h_moe reads every MLP layer as experts);
    one without Mamba layers."""
    _, folder = _granite(tmp_path, position_embedding_type="rope")
    model, _ = from_pretrained(folder)
    with pytest.raises(ValueError, match="position_embedding_type='rope'"):
        save_gguf(model, tmp_path / "x.gguf")
    _, folder = _nemotron(tmp_path, hybrid_override_pattern="ME*-MM*E", **MOE)
    model, _ = from_pretrained(folder)
    with pytest.raises(ValueError, match=r"hybrid_override_pattern='ME\*-MM\*E'"):
        save_gguf(model, tmp_path / "x.gguf")
    _, folder = _nemotron(tmp_path, hybrid_override_pattern="*-*-")     # the converter makes it a Granite
    model, _ = from_pretrained(folder)
    with pytest.raises(ValueError, match="nemotron_h without Mamba layers"):
        save_gguf(model, tmp_path / "x.gguf")


def test_jamba_with_a_vocabulary_writes_no_vocab_size(tmp_path):
    """The converter writes no jamba.vocab_size (llama.cpp counts the vocabulary); save_gguf writes it only for a
    file without one. A byte-level BPE of the model's 96 tokens comes back as written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from subquad.models.gguf.reader import GGUFFile

    _, folder = _hybrid(tmp_path, "jamba")
    model, _ = from_pretrained(folder)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet)[:V])}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    save_gguf(model, tmp_path / "with.gguf", "f32", tokenizer=tok)
    meta = GGUFFile(tmp_path / "with.gguf").metadata
    assert "jamba.vocab_size" not in meta and len(meta["tokenizer.ggml.tokens"]) == V
    back, tok2 = from_pretrained(tmp_path / "with.gguf")
    assert tok2.encode("abc").ids == tok.encode("abc").ids == [64, 65, 66]
    save_gguf(model, tmp_path / "without.gguf", "f32")
    assert GGUFFile(tmp_path / "without.gguf").metadata["jamba.vocab_size"] == V
