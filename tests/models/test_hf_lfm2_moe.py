"""Hugging Face Liquid LFM2-MoE (``lfm2_moe``): LFM2's layers, dense MLPs first, then sigmoid-routed experts
chosen with an expert bias and renormalised as transformers does (w / (sum w + 1e-6)) - tiny random
transformers models give transformers' logits and greedy tokens and come back through save_pretrained."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

transformers = pytest.importorskip("transformers")   # the `hf` extra installs it (make test requires it); the library never does

from subquad.models.hf import from_pretrained  # noqa: E402
from tests.models.hf_harness import assert_refused, buffers_by, tiny  # noqa: E402

V = 96


def _hf(tmp_path, dtype=torch.float32, **over):
    """conv, attention, conv: the first layer's MLP dense, the others 6 experts of which 3 per token;
    non-trivial norms and expert biases."""
    return tiny(tmp_path, "lfm2_moe", transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM, {
        "vocab_size": V, "hidden_size": 64, "intermediate_size": 80, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_dense_layers": 1, "num_experts": 6, "num_experts_per_tok": 3,
        "routed_scaling_factor": 1.5, "num_attention_heads": 4, "num_key_value_heads": 2,
        "layer_types": ["conv", "full_attention", "conv"], "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **over},
        dtype, ("norm.weight", "layernorm.weight"), eager=True,
        tweak=partial(buffers_by, "expert_bias", lambda b: b.copy_(torch.randn_like(b) * 0.1)))


def _ids(T=50):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


LOGITS = {"bias-renorm": {}, "plain": {"use_expert_bias": False, "norm_topk_prob": False}}


def _saved(hf, ours, c, over, folder):
    """The round trip's folder (test_hf_parity.py): the dense layers and the experts as read."""
    assert c["num_dense_layers"] == 1 and c["num_experts"] == 6 and c["routed_scaling_factor"] == 1.5


def test_the_loaded_structure(tmp_path):
    _, folder = _hf(tmp_path)
    ours, _ = from_pretrained(folder)
    assert ours.config.moe_layers == [1, 2] and ours.config.moe["router"] == "sigmoid"
    assert ours.blocks[0].mlp.w_gate.weight.shape == (80, 64) and ours.blocks[1].mlp.w_gate.shape == (6, 32, 64)
    assert ours.blocks[1].mlp.score_bias.abs().sum() > 0


def test_refusals_name_the_problem(tmp_path):
    _, folder = _hf(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for field, value in (("norm_topk_prob", 1), ("use_expert_bias", "yes"), ("routed_scaling_factor", "2"),
                         ("layer_types", ["conv", "moe", "conv"])):
        assert_refused(folder, field, {**cfg, field: value})
