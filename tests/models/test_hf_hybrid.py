"""Hugging Face hybrids - Bamba (Mamba-2 + attention with partial rotary) and Jamba (Mamba with weighted
dt/B/C norms + attention without positions + a mixture of experts): tiny random transformers models, saved
and loaded here, give transformers' logits, greedy tokens and router loss, and come back through
save_pretrained; bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, tiny  # noqa: E402

KINDS = ["bamba", "jamba"]
# Greedy tokens equal to transformers' `generate` until it departs from its own forward: for Jamba here
# (float64) its cached decoding picks token 15 at step 27 where its forward over the same prefix ranks
# token 1 higher by 0.012 - every one of our 32 tokens is still checked against that forward (test_hf_parity.py).
MIN_AGREE = {"bamba": 32, "jamba": 27}
V = 96
NOISY = ("norm.weight", "layernorm.weight", ".D", "conv1d.bias", "dt_bias")   # non-trivial norms, D, dt, conv biases


def _hf(tmp_path, kind, dtype=torch.float32, **over):
    """A tiny random model with at least one attention layer (and, for Jamba, MoE and dense MLP layers)."""
    if kind == "bamba":
        return tiny(tmp_path, kind, transformers.BambaConfig, transformers.BambaForCausalLM, {
            "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": [1], "mamba_n_heads": 8,
            "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 16, **over}, dtype, NOISY)
    return tiny(tmp_path, kind, transformers.JambaConfig, transformers.JambaForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "expert_layer_period": 2,
        "expert_layer_offset": 1, "attn_layer_period": 4, "attn_layer_offset": 2, "mamba_d_state": 8,
        "mamba_dt_rank": 8, **over}, dtype, NOISY, eager=True)


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path, "jamba")
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["mamba", "mamba", "softmax", "mamba"]
    assert ours.config.moe_layers == [1, 3] and ours.config.mlp_hidden == 96
    _, folder = _hf(tmp_path, "bamba")
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["mamba2", "softmax", "mamba2"]
    assert ours.blocks[1].mixer.rotary_dim == 8                    # half of a head of 16


def test_jamba_without_experts_and_a_model_trained_here(tmp_path):
    """num_experts=1 (dense MLPs everywhere) loads; a subquad model of Jamba's structure saves as jamba."""
    from subquad import LanguageModel, ModelConfig

    hf, folder = _hf(tmp_path, "jamba", torch.float64, num_experts=1, tie_word_embeddings=True)
    ours, _ = from_pretrained(folder, dtype=torch.float64)
    assert ours.config.moe is None and ours.head is None
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), hf(_ids()).logits, rtol=0, atol=1e-6)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=6, n_heads=2, pattern="mamba,softmax,mamba,mamba,softmax,mamba",
                      mlp_size=48, norm_eps=1e-6, moe={"experts": 3, "top_k": 1, "every": 3, "offset": 0},
                      mixer_options={"mamba": {"bcdt_rms_eps": 1e-6, "bcdt_rms_weight": True, "d_state": 4},
                                     "softmax": {"rotary": False}})
    model = LanguageModel(cfg).eval()
    save_pretrained(model, tmp_path / "mine")
    c = json.loads((tmp_path / "mine" / "config.json").read_text())
    assert (c["attn_layer_period"], c["attn_layer_offset"], c["expert_layer_period"]) == (3, 1, 3)
    theirs = transformers.JambaForCausalLM.from_pretrained(tmp_path / "mine").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(_ids()).logits, model(_ids()), rtol=0, atol=1e-5)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    from subquad import LanguageModel, ModelConfig

    _, folder = _hf(tmp_path, "jamba")
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("mamba_proj_bias", True), ("hidden_act", "gelu")):
        assert_refused(folder, field, {**cfg, field: value})
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(folder / "model.safetensors"))
    w = dict(weights)
    del w["model.layers.3.feed_forward.experts.2.up_proj.weight"]
    assert_refused(folder, "missing.*layers.3.feed_forward.experts.2.up_proj", weights=w)
    w = dict(weights)
    w["model.layers.1.mamba.b_layernorm.weight"] = torch.zeros(5)
    assert_refused(folder, r"b_layernorm.weight has shape \(5,\)", weights=w)
    _, folder = _hf(tmp_path, "bamba")
    cfg = json.loads((folder / "config.json").read_text())
    rope = {**cfg["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    assert_refused(folder, "rope_type", {**cfg, "rope_parameters": rope})
    assert_refused(folder, "attn_layer_indices", {**cfg, "attn_layer_indices": [7]})
    # attention layers no period describes cannot be written as Jamba
    odd = ModelConfig(vocab_size=V, d_model=32, n_layers=4, n_heads=2, pattern="mamba,softmax,softmax,mamba",
                      norm_eps=1e-6, mixer_options={"mamba": {"bcdt_rms_eps": 1e-6, "bcdt_rms_weight": True},
                                                    "softmax": {"rotary": False}})
    with pytest.raises(ValueError, match="no Hugging Face model type has this structure.*model_type='subquad'"):
        save_pretrained(LanguageModel(odd), tmp_path / "odd")
    LanguageModel(odd).save_pretrained(tmp_path / "odd", model_type="subquad")    # the method takes the way out
    assert from_pretrained(tmp_path / "odd")[0].config.pattern == odd.pattern
