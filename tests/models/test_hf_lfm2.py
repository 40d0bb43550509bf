"""Hugging Face Liquid LFM2 (``lfm2``): gated short convolutions (the ``gated_conv`` mixer) and attention with
q/k norms, SwiGLU MLPs of transformers' adjusted width - tiny random transformers models give transformers'
logits and greedy tokens, come back through save_pretrained, and bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_logits_equal, assert_refused, tiny  # noqa: E402

V = 96
TYPES = ["conv", "full_attention", "conv", "conv"]


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: conv, attention, conv, conv; the MLP width adjusted as the released configs do
    (2/3 of 120, rounded up to a multiple of 24: 96); non-trivial norms and biases."""
    return tiny(tmp_path, "lfm2", transformers.Lfm2Config, transformers.Lfm2ForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 120, "block_multiple_of": 24,
        "block_ffn_dim_multiplier": 1.1, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "layer_types": TYPES, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **over},
        dtype, ("norm.weight", "layernorm.weight", "bias"))


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


LOGITS = {"plain": {}, "bias-conv4-tied": {"conv_bias": True, "conv_L_cache": 4, "tie_word_embeddings": True}}
ROUND_TRIP = {"conv-bias": {"conv_bias": True}}


def _loaded(ours, over):
    """The logits cases of test_hf_parity.py: the head tied only with the second."""
    assert ours.config.tie_embeddings == bool(over)


def _saved(hf, ours, c, over, folder):
    """The round trip's folder (test_hf_parity.py): the adjusted MLP width, written as adjusted."""
    assert c["intermediate_size"] == 96 and c["block_auto_adjust_ff_dim"] is False and c["layer_types"] == TYPES


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["gated_conv", "softmax", "gated_conv", "gated_conv"]
    assert ours.config.mlp_hidden == 96 and ours.blocks[0].mixer.conv.kernel_size == 3
    attn = ours.blocks[1].mixer
    assert attn.qk_norm == "head" and attn.rotary_base == 1e6 and attn.n_kv_heads == 2


def test_a_model_built_here_saves_as_lfm2(tmp_path):
    from subquad import LanguageModel, ModelConfig

    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=2, pattern="gated_conv,softmax,gated_conv",
                      mlp_size=48, norm_eps=1e-5,
                      mixer_options={"softmax": {"qk_norm": "head", "qk_norm_eps": 1e-5, "rotary_base": 5e5}})
    model = LanguageModel(cfg).eval()
    save_pretrained(model, tmp_path / "mine")
    c = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert c["model_type"] == "lfm2" and c["tie_word_embeddings"] is True
    theirs = transformers.Lfm2ForCausalLM.from_pretrained(tmp_path / "mine").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(_ids()).logits, model(_ids()), rtol=0, atol=1e-5)


def test_legacy_fields_read_as_transformers_reads_them(tmp_path):
    """The released configs: full_attn_idxs, tie_embedding, block_ff_dim and a top-level rope_theta."""
    hf, folder = _hf(tmp_path, torch.float64)
    cfg = json.loads((folder / "config.json").read_text())
    for k in ("layer_types", "intermediate_size", "rope_parameters", "tie_word_embeddings"):
        cfg.pop(k)
    cfg.update({"full_attn_idxs": [1], "block_ff_dim": 120, "rope_theta": 1e6, "tie_embedding": False})
    (folder / "config.json").write_text(json.dumps(cfg))
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    assert ours.config.layers == ["gated_conv", "softmax", "gated_conv", "gated_conv"]
    assert_logits_equal(ours, hf, _ids(), torch.float64, 1e-6)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("layer_types", ["conv", "sliding_attention", "conv", "conv"]), ("conv_L_cache", "3"),
                         ("block_auto_adjust_ff_dim", 1), ("conv_bias", "no")):
        assert_refused(folder, field, {**cfg, field: value})
    for rope, why in (({"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}, "rope_type"),
                      ({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
                       "partial_rotary_factor")):
        assert_refused(folder, why, {**cfg, "rope_parameters": rope})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    del w["model.layers.2.conv.in_proj.weight"]
    assert_refused(folder, "missing.*layers.2.conv.in_proj", weights=w)
