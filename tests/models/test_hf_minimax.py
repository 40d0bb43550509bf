"""Hugging Face MiniMax - lightning attention (fixed per-head decays by depth, gated norm) and softmax layers,
a softmax-routed MoE in every layer, MiniMax's scaled residual from the normed stream: tiny random
transformers models give transformers' logits and greedy tokens, come back through save_pretrained, and
bad folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, tiny  # noqa: E402

V = 96


def _hf(tmp_path, dtype=torch.float32, **over):
    """Lightning and softmax layers alternating, residual factors other than 1, blocks of 16 tokens."""
    return tiny(tmp_path, "minimax", transformers.MiniMaxConfig, transformers.MiniMaxForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 16,
        "layer_types": ["linear_attention", "full_attention"] * 2, "linear_attn_alpha_factor": 1.5,
        "linear_attn_beta_factor": 0.7, "full_attn_alpha_factor": 1.2, "mlp_beta_factor": 0.9, "pad_token_id": None,
        "bos_token_id": None, "eos_token_id": None, **over}, dtype, ("norm.weight",), eager=True)


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def test_the_loaded_structure_and_the_slopes(tmp_path):
    hf, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.layers == ["lightning", "softmax"] * 2 and ours.config.moe_layers == [0, 1, 2, 3]
    assert ours.config.scaled_residual == {"lightning": [1.5, 0.7], "softmax": [1.2, 1.0], "mlp": [1.0, 0.9]}
    for i in (0, 2):          # the checkpoint's slopes, which a fresh model of this structure also builds
        want = hf.model.layers[i].self_attn.slope_rate.view(-1)
        torch.testing.assert_close(ours.blocks[i].mixer.slope, want)
    from subquad import LanguageModel

    with torch.device("cpu"):
        fresh = LanguageModel(ours.config)
    torch.testing.assert_close(fresh.blocks[2].mixer.slope, ours.blocks[2].mixer.slope)


def test_refusals_name_the_problem(tmp_path):
    from safetensors.torch import load_file

    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("hidden_act", "gelu"), ("sliding_window", 32), ("router_jitter_noise", 0.1),
                         ("layer_types", ["lightning"] * 4)):
        assert_refused(folder, field, {**cfg, field: value})
    (folder / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(folder / "model.safetensors"))
    w["model.layers.0.self_attn.query_decay"] = w["model.layers.0.self_attn.query_decay"] * 0.5
    assert_refused(folder, "query_decay disagrees with .*slope_rate", weights=w)
