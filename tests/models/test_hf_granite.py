"""Hugging Face IBM Granite 4 (``granitemoehybrid``): Mamba-2 and attention without positions (or rotary),
a mixture of experts beside an ungated shared expert, and Granite's four multipliers folded into the
weights - tiny random transformers models give transformers' logits, greedy tokens and router loss,
come back through save_pretrained, and bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, tiny  # noqa: E402

V = 96
# multipliers far from 1 (the released models': 12, 0.22, 1/128 and 8 at their widths), so a missed one shows
MULT = {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1, "logits_scaling": 2.0}


def _hf(tmp_path, dtype=torch.float32, **over):
    """A tiny random model: Mamba-2, attention, Mamba-2 (the released configs' legacy layer names), MoE layers
    of 4 experts beside a shared expert; non-trivial norms, D, dt and conv biases."""
    return tiny(tmp_path, "granite", transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 40, "shared_intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "layer_types": ["mamba", "attention", "mamba"], "num_local_experts": 4, "num_experts_per_tok": 2,
        "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 16,
        "position_embedding_type": "nope", "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        **MULT, **over}, dtype, ("norm.weight", ".D", "conv1d.bias", "dt_bias"), eager=True)


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


LOGITS = {"moe-nope": {}, "rope-tied": {"position_embedding_type": "rope", "tie_word_embeddings": True},
          "dense": {"num_local_experts": 0}}
ROUND_TRIP = {"untied": {}, "tied": {"tie_word_embeddings": True}}


def _loaded(ours, over):
    """The logits cases of test_hf_parity.py: rotary only with rope, no experts only with none."""
    assert ours.blocks[1].mixer.rotary == ("position_embedding_type" in over)
    assert (ours.config.moe is None) == ("num_local_experts" in over)


def _saved(hf, ours, c, over, folder):
    """The round trip's folder (test_hf_parity.py): the folded weights written with multipliers of 1."""
    assert c["embedding_multiplier"] == c["logits_scaling"] == 1.0


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["mamba2", "softmax", "mamba2"] and ours.config.moe_layers == [0, 1, 2]
    mlp = ours.blocks[0].mlp
    assert mlp.w_gate.shape == (4, 40, 64) and mlp.shared.w_up.weight.shape == (48, 64) and mlp.shared_gate is None
    assert not ours.blocks[1].mixer.rotary


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("position_embedding_type", "alibi"), ("mamba_proj_bias", True), ("hidden_act", "gelu"),
                         ("attention_bias", True), ("layer_types", ["mamba", "cross_attention", "mamba"]),
                         ("head_dim", 8)):
        assert_refused(folder, field, {**cfg, field: value})
    rope = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    assert_refused(folder, "rope_type", {**cfg, "position_embedding_type": "rope", "rope_parameters": rope})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    del w["model.layers.2.shared_mlp.input_linear.weight"]
    assert_refused(folder, "missing.*layers.2.shared_mlp.input_linear", weights=w)
