"""GGUF's ``lfm2moe`` and ``rwkv7``: files written by ggml's own writer from tiny random models by llama.cpp's
converter rules (``gguf_more_harness.py``) give the reference's logits (F32: transformers for LFM2-MoE, subquad's
own fla-folder load for RWKV-7, which test_rwkv7.py holds to BlinkDL's rwkv package) and, quantised, the logits of
the same weights dequantised by ``gguf.quants`` loaded from a folder; ``save_gguf`` writes what the converter
writes (names, shapes, types, metadata) and loads back; bad metadata is refused by name. (llama.cpp's own run of
such files: benchmarks/llama_gguf_parity.py.)"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from subquad.models.gguf import save_gguf  # noqa: E402
from subquad.models.hf import from_pretrained  # noqa: E402
from subquad.models.quant import Int8Linear  # noqa: E402
from tests.models import gguf_more_harness as harness  # noqa: E402
from tests.models.gguf_harness import assert_same_file  # noqa: E402
from tests.models import test_hf_kimi, test_hf_lfm2_moe  # noqa: E402

KINDS = ["lfm2_moe", "rwkv7", "kimi_linear"]


def _hf(tmp_path, kind, **over):
    """(reference model or None, folder): LFM2-MoE's tiny transformers model (conv, attention, conv; a dense first
    layer, then 6 experts of which 3 a token, random expert biases), tied and unscaled as llama.cpp holds it; or
    RWKV-7's fla folder of test_rwkv7.py's random BlinkDL checkpoint (D 128, head 64, 3 layers, LoRA ranks 16,
    16, 8, 32: the a and v LoRAs' up-projections too narrow for a block, written F16); or Kimi-Linear's tiny
    transformers model (KDA, MLA, KDA, MLA; a dense first layer, then 8 experts and a shared one; ungrouped routing,
    as llama.cpp routes) in the released checkpoints' spelling, which the converter reads."""
    if kind == "lfm2_moe":
        return test_hf_lfm2_moe._hf(tmp_path, **{"tie_word_embeddings": True, "routed_scaling_factor": 1.0, **over})
    if kind == "kimi_linear":
        hf, folder = test_hf_kimi._hf(tmp_path, **{"n_group": 1, "topk_group": 1, **over})
        return hf, harness.released_kimi_folder(folder)
    from tests.models import test_rwkv7          # needs BlinkDL's rwkv package (the `rwkv` extra): only here

    folder = tmp_path / "fla"
    test_rwkv7.fla_folder(test_rwkv7.random_pth(tmp_path / "model.pth"), folder)
    if over:
        c = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**c, **over}))
    return None, folder


def _ids():
    return torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))


def _convert_fn(kind):
    return {"rwkv7": harness.rwkv7_converted, "kimi_linear": harness.kimi_converted}.get(kind, harness.converted)


def _load(path, **kw):
    with warnings.catch_warnings():             # the embedding / experts written quantised are dequantised: expected
        warnings.simplefilter("ignore")
        return from_pretrained(path, **kw)[0]


def _reference_logits(hf, folder, ids):
    """transformers' logits; for RWKV-7, subquad's own load of the fla folder (test_rwkv7.py: BlinkDL's)."""
    return hf(ids).logits if hf is not None else _load(folder)(ids)


@pytest.mark.parametrize("kind", KINDS)
def test_f32_file_gives_the_references_logits(tmp_path, kind):
    hf, folder = _hf(tmp_path, kind)
    types = harness.convert(folder, tmp_path / "m.gguf", "f32")
    assert set(types.values()) == {"F32"}
    ours = _load(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        want = _reference_logits(hf, folder, ids)
        assert torch.allclose(ours(ids), want, atol=1e-4, rtol=1e-4)
    if kind == "lfm2_moe":
        assert "blk.1.ffn_gate_exps.weight" in types and "blk.0.ffn_gate.weight" in types
        assert ours.config.moe_layers == [1, 2] and ours.blocks[1].mlp.score_bias.abs().sum() > 0
    elif kind == "rwkv7":
        assert "blk.0.time_mix_v1.weight" in types and "blk.2.time_mix_lerp_fused.weight" in types
        assert ours.config.n_heads == 2 and ours.blocks[0].mixer.v_lora[0].weight.abs().sum() == 0
    else:
        assert "blk.1.attn_k_b.weight" in types and "blk.0.ssm_conv1d_q.weight" in types
        assert ours.config.layers == ["kda", "mla"] * 2 and ours.config.moe_layers == [1, 2, 3]


# GGUF matrices subquad keeps as int8 blocks: attention's, the short convolutions' projections, the dense MLP's; the
# stacked experts are dequantised (load.py); + the tied head
# the quantised tensors dequantised on loading, named in a warning (a tied embedding keeps its blocks for the head)
WARNED = {"lfm2_moe": None, "rwkv7": r"token_embd\.weight \(Q8_0\)", "kimi_linear": r"token_embd\.weight \(Q8_0\)"}
# the Q8_0 matrices kept as int8 blocks (and + 1: LFM2-MoE's tied head): LFM2's projections; every RWKV-7 matrix but
# the embedding and layer 0's unused v1 (dropped); every Kimi-Linear matrix but the embedding; and the stacked
# experts, one module per expert (counted apart)
KEPT = {"kimi_linear": (r"^(?!token_embd|.*_exps\.)", 0),
        "lfm2_moe": (r"\.(attn_[qkv]|attn_output|shortconv\.(in|out)_proj|ffn_(gate|up|down))\.weight$", 1),
        "rwkv7": (r"^(?!token_embd|blk\.0\.time_mix_v1)", 0)}


@pytest.mark.parametrize("kind", KINDS)
def test_q8_0_file_equals_its_weights_dequantised_by_gguf(tmp_path, kind, monkeypatch):
    from subquad.kernels import qgemv

    monkeypatch.setattr(qgemv, "Q8_0_EXACT", True)   # x exact in the experts' few rows too: the weights are the test
    hf, folder = _hf(tmp_path, kind)
    types = harness.convert(folder, tmp_path / "m.gguf", "q8_0")
    ref = _load(harness.dequantized_folder(folder, tmp_path / "m.gguf", tmp_path / "ref", _convert_fn(kind)))
    if WARNED[kind] is None:                    # tied embedding, experts kept: nothing dequantised, nothing said
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours, _ = from_pretrained(tmp_path / "m.gguf")
    else:
        with pytest.warns(UserWarning, match=WARNED[kind]) as said:
            ours, _ = from_pretrained(tmp_path / "m.gguf")
        assert not any("blk.0.time_mix_v1" in str(w.message) for w in said)      # dropped, not dequantised
    ids = _ids()
    with torch.no_grad():
        want = ref(ids)
        assert torch.allclose(ours(ids), want, rtol=0, atol=1e-5 * want.abs().max())
    kept, head = KEPT[kind]
    expect = sum(t == "Q8_0" and re.search(kept, g) is not None and not g.endswith("_exps.weight")
                 for g, t in types.items()) + head
    c = json.loads((folder / "config.json").read_text())
    E = c.get("num_experts") or c.get("num_local_experts") or 0
    experts = E * sum(t == "Q8_0" for g, t in types.items() if g.endswith("_exps.weight"))
    quantised = [m for m in ours.modules() if isinstance(m, Int8Linear)]
    assert len(quantised) == expect + experts and ours.quantized == "int8"
    assert (experts > 0) == (kind != "rwkv7")


@pytest.mark.parametrize("kind,outtype", [(k, t) for k in KINDS for t in ("f32", "q8_0")])
def test_save_gguf_writes_the_converters_file_and_loads_back(tmp_path, kind, outtype):
    hf, folder = _hf(tmp_path, kind)
    model = _load(folder)
    save_gguf(model, tmp_path / "ours.gguf", outtype)
    harness.convert(folder, tmp_path / "theirs.gguf", outtype)
    assert gguf.GGUFReader(str(tmp_path / "ours.gguf")).fields["general.architecture"].contents() == \
        harness.ARCH[kind]
    assert_same_file(tmp_path / "ours.gguf", tmp_path / "theirs.gguf", outtype != "f32", theirs_vocab_size=True)
    back = _load(tmp_path / "ours.gguf")
    ids = _ids()
    with torch.no_grad():
        want = model(ids) if outtype == "f32" else _load(tmp_path / "theirs.gguf")(ids)
        assert torch.allclose(back(ids), want, rtol=0, atol=1e-5 * want.abs().max())


@pytest.mark.parametrize("kind,key,value,match", [
    ("lfm2_moe", "lfm2moe.expert_gating_func", 1, r"lfm2moe.expert_gating_func=1: LFM2-MoE routes by sigmoid"),
    ("lfm2_moe", "lfm2moe.expert_feed_forward_length", None, "GGUF metadata has no lfm2moe.expert_feed_forward"),
    ("lfm2_moe", "lfm2moe.leading_dense_block_count", 7, r"lfm2moe.leading_dense_block_count=7 must be in \[0, 3\]"),
    ("rwkv7", "rwkv7.wkv.head_size", 48, r"rwkv7.wkv.head_size=48 must divide rwkv7.embedding_length=128"),
    ("rwkv7", "rwkv7.attention.gate_lora_rank", None, "GGUF metadata has no rwkv7.attention.gate_lora_rank"),
    ("kimi_linear", "kimi-linear.expert_gating_func", 1, "kimi-linear.expert_gating_func=1: Kimi-Linear routes by"),
    ("kimi_linear", "kimi-linear.attention.head_count_kv", [0, 4, 0, 4],
     r"kimi-linear.attention.head_count_kv=\[0, 4, 0, 4\] must give each of the 4 layers 0 \(KDA\) or 1 \(MLA\)"),
    ("kimi_linear", "kimi-linear.attention.key_length_mla", None, "GGUF metadata has no kimi-linear.attention.key_len"),
], ids=["lfm2moe-gating", "lfm2moe-missing", "lfm2moe-dense", "rwkv7-head-size", "rwkv7-missing", "kimi-gating",
        "kimi-head-count-kv", "kimi-missing"])
def test_bad_metadata_is_refused_by_name(tmp_path, kind, key, value, match):
    _, folder = _hf(tmp_path, kind)
    harness.convert(folder, tmp_path / "bad.gguf", "f32", override={key: value})
    with pytest.raises(ValueError, match=match):
        from_pretrained(tmp_path / "bad.gguf")


@pytest.mark.parametrize("kind,over,match", [
    ("lfm2_moe", {"routed_scaling_factor": 1.5}, "lfm2moe: llama.cpp's lfm2moe holds routed_scaling_factor=1.0 only; "
                                                 "this model has routed_scaling_factor=1.5"),
    ("lfm2_moe", {"norm_topk_prob": False}, "lfm2moe: llama.cpp's lfm2moe holds norm_topk_prob=True only"),
    ("rwkv7", {"norm_eps": 2e-5}, r"rwkv7: llama.cpp norms ln_x with 0.00064; this model's head_dim x norm_eps is "
                                  r"64 x 2e-05"),
    ("kimi_linear", {"n_group": 2}, r"kimi-linear: llama.cpp's kimi-linear holds .* ungrouped routing, .*; this "
                                    r"model has num_expert_group=2"),
], ids=["lfm2moe-scale", "lfm2moe-renorm", "rwkv7-group-norm-eps", "kimi-grouped"])
def test_what_llama_cpp_cannot_hold_is_refused_by_name(tmp_path, kind, over, match):
    _, folder = _hf(tmp_path, kind, **over)
    with pytest.raises(ValueError, match=match):
        save_gguf(_load(folder), tmp_path / "x.gguf")


def test_kimi_low_rank_q_is_read_from_the_converters_file_and_refused_on_writing(tmp_path):
    """Kimi-Linear's MLA with a low-rank q (``q_lora_rank``: q_a_proj, q_a_layernorm, q_b_proj as ``attn_q_a``,
    ``attn_q_a_norm``, ``attn_q_b``): the converter's file gives transformers' logits; save_gguf refuses it by name
    (llama.cpp's kimi-linear multiplies by a full-rank attn_q only and fails to load such a file)."""
    hf, folder = _hf(tmp_path, "kimi_linear", q_lora_rank=24)
    types = harness.convert(folder, tmp_path / "theirs.gguf", "f32")
    assert "blk.1.attn_q_b.weight" in types and "blk.1.attn_q.weight" not in types
    ours = _load(tmp_path / "theirs.gguf")
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert torch.allclose(ours(ids), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="a full-rank q only; this model has q_lora_rank=24"):
        save_gguf(_load(folder), tmp_path / "ours.gguf", "f32")
