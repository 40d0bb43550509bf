"""Hugging Face TII Falcon-H1 (``falcon_h1``): Mamba-2 beside attention in every layer, summed
(``ParallelBlock``), a Mamba width of its own (``mamba_d_ssm``) and the muP multipliers folded into the
weights - tiny random transformers models give transformers' logits and greedy tokens, come back through
save_pretrained, and what subquad cannot hold is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained, save_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, tiny  # noqa: E402

V = 96
# every multiplier far from 1 and each part of the in-projection its own, so a missed one shows
MULT = {"embedding_multiplier": 3.0, "lm_head_multiplier": 0.25, "attention_in_multiplier": 0.7,
        "attention_out_multiplier": 1.6, "key_multiplier": 0.4, "ssm_in_multiplier": 1.3, "ssm_out_multiplier": 0.6,
        "ssm_multipliers": [0.5, 1.5, 0.8, 1.25, 2.0], "mlp_multipliers": [0.9, 0.3]}


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: 3 layers, attention heads of 24 dims (4 x 24 != 64), a Mamba 96 wide (not 2 x 64)
    in 6 heads of 16, 2 groups; non-trivial norms, D, dt and conv biases."""
    return tiny(tmp_path, "falcon_h1", transformers.FalconH1Config, transformers.FalconH1ForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "mamba_d_ssm": 96, "mamba_n_heads": 6,
        "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 16, "rope_parameters": {
            "rope_type": "default", "rope_theta": 5000.0},
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **MULT, **over},
        dtype, ("norm.weight", "layernorm.weight", ".D", "conv1d.bias", "dt_bias"))


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


LOGITS = {"untied": {}, "tied-gated-norm": {"tie_word_embeddings": True, "mamba_rms_norm": True,
                                            "mamba_norm_before_gate": False}}
ROUND_TRIP = {"untied": {}, "tied": {"tie_word_embeddings": True}}


def _loaded(ours, over):
    """The logits cases of test_hf_parity.py: the gated norm only with the second."""
    assert (ours.blocks[0].mixer.norm is None) == (not over)


def _saved(hf, ours, c, over, folder):
    """The round trip's folder (test_hf_parity.py): the folded weights written with multipliers of 1."""
    assert c["embedding_multiplier"] == c["key_multiplier"] == 1.0
    assert c["ssm_multipliers"] == [1.0] * 5 and c["mamba_d_ssm"] == 96


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["mamba2"] * 3 and ours.config.parallel == {"mamba2": "softmax"}
    block = ours.blocks[0]
    assert type(block).__name__ == "ParallelBlock" and block.beside.head_dim == 24
    assert block.mixer.d_inner == 96 and block.mixer.norm is None
    assert set(ours.empty_state(1)[0]) == {"ssm", "conv", "kv"}


def test_a_falcon_h1_model_is_written_as_no_other_type(tmp_path):
    """Its parallel blocks and its ungated, 96-wide Mamba-2 layers are Falcon-H1's alone."""
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    for other in ("bamba", "granitemoehybrid", "nemotron_h", "mamba2"):
        with pytest.raises(ValueError, match=f"cannot be written as model_type '{other}'"):
            save_pretrained(ours, tmp_path / other, model_type=other)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True),
                         ("projectors_bias", True), ("mamba_proj_bias", True), ("mamba_n_heads", 5),
                         ("ssm_multipliers", [1.0, 2.0]), ("mlp_multipliers", "1"), ("mamba_rms_norm", 1)):
        assert_refused(folder, field, {**cfg, field: value})
    assert_refused(folder, "mamba_norm_before_gate", {**cfg, "mamba_rms_norm": True, "mamba_norm_before_gate": True})
    for rope, why in (({"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}, "rope_type"),
                      ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                       "partial_rotary_factor")):
        assert_refused(folder, why, {**cfg, "rope_parameters": rope})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    del w["model.layers.2.self_attn.k_proj.weight"]
    assert_refused(folder, "missing.*layers.2.self_attn.k_proj", weights=w)
